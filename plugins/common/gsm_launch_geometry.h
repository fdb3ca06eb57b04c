/*
 * gsm_launch_geometry.h: the geometry of a kernel launch as a record, computed by the same host function the
 * launchers use, so that the device limits (threads, grid, shared memory) can be checked without a device.
 *
 * Why records and not `<<<>>>` arguments in place: a launch beyond a limit fails only on the GPU, at run time
 * (cudaErrorInvalidConfiguration or a silent no-op). The C API exports these records (gsm_cuda_launch_geometry)
 * and tests/test_cuda_launch_limits.py checks them against the sm_87 / sm_90 limits for every shape the builder
 * accepts.
 */
#pragma once

#include "gsm_cuda_compat.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gsm
{
namespace cuda
{

// Every __global__ function of the plugins (the names are the kernels' own, so that ptxas' resource report can be
// matched to them).
enum KernelId : int32_t
{
    kKernelIndexScores = 0,
    kKernelSelect = 1,
    kKernelCountSelected = 2,
    kKernelAttend = 3,
    kKernelKVCacheUpdate = 4,
    kKernelKVDemoteStage = 5,
    kKernelKVDemoteWrite = 6,
    kKernelMass = 7,
    kKernelCount = 8
};

inline char const* kernelName(int32_t id)
{
    static char const* const kNames[kKernelCount] = {"indexScoresKernel", "selectKernel", "countSelectedKernel",
        "attendKernel", "kvCacheUpdateKernel", "kvDemoteStageKernel", "kvDemoteWriteKernel", "massKernel"};
    return id >= 0 && id < kKernelCount ? kNames[id] : nullptr;
}

// CUDA's gridDim.y / gridDim.z limit on every SM since 3.0: launchers split wider work into several launches.
constexpr int64_t kMaxGridDimY = 65535;
// Dynamic shared memory a kernel gets without cudaFuncSetAttribute(MaxDynamicSharedMemorySize).
constexpr int64_t kSharedMemoryWithoutOptIn = 48 * 1024;

// One launch. Plain C layout: the Python binding (gsm_edge_plugins.launch_limits) mirrors it with ctypes.
// Sizes are int64 so that a value a dim3 would truncate still shows as what the launcher computed.
struct LaunchGeometry
{
    int32_t kernel;           // KernelId
    int32_t optIn;            // the launcher raises MaxDynamicSharedMemorySize to dynamicSmemBytes first
    int64_t grid[3];
    int64_t block[3];
    int64_t dynamicSmemBytes;
    int64_t launches;         // how many launches of a call have exactly this geometry
};

inline LaunchGeometry launchOf(int32_t kernel, int64_t gx, int64_t gy, int64_t threads, int64_t dynamicSmemBytes)
{
    return LaunchGeometry{kernel, dynamicSmemBytes > kSharedMemoryWithoutOptIn ? 1 : 0, {gx, gy, 1},
        {threads, 1, 1}, dynamicSmemBytes, 1};
}

// The launches of one piece of work, in launch order (a fixed array: the launchers build one per chunk, no heap).
struct LaunchList
{
    LaunchGeometry items[4];
    int32_t count = 0;

    void add(LaunchGeometry const& g)
    {
        items[count++] = g;
    }
    LaunchGeometry const& operator[](int32_t i) const
    {
        return items[i];
    }
    LaunchGeometry const* begin() const
    {
        return items;
    }
    LaunchGeometry const* end() const
    {
        return items + count;
    }
};

inline dim3 gridOf(LaunchGeometry const& g)
{
    return dim3(static_cast<unsigned>(g.grid[0]), static_cast<unsigned>(g.grid[1]), static_cast<unsigned>(g.grid[2]));
}

inline dim3 blockOf(LaunchGeometry const& g)
{
    return dim3(
        static_cast<unsigned>(g.block[0]), static_cast<unsigned>(g.block[1]), static_cast<unsigned>(g.block[2]));
}

inline size_t smemOf(LaunchGeometry const& g)
{
    return static_cast<size_t>(g.dynamicSmemBytes);
}

// The records of a launcher that covers `total` items in pieces of `chunk` (the last piece smaller), issuing the
// launches `piece(n)` returns for a piece of n items: one record per distinct geometry.
template <typename Piece>
void appendChunked(std::vector<LaunchGeometry>& out, int64_t total, int64_t chunk, Piece piece)
{
    auto const emit = [&](int64_t n, int64_t times) {
        if (n <= 0 || times <= 0)
        {
            return;
        }
        for (LaunchGeometry g : piece(n))
        {
            g.launches = times;
            out.push_back(g);
        }
    };
    emit(chunk, total / chunk);
    emit(total % chunk, 1);
}

} // namespace cuda
} // namespace gsm
