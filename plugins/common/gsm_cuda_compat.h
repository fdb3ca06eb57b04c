/*
 * gsm_cuda_compat.h: what lets one copy of the kernel sources (plugins/<plugin>/...Kernels.cu) build two ways.
 *
 *   nvcc (CUDA)              the kernels as they run on Orin / H200: CUDA's own headers, `<<<>>>` launches.
 *   GSM_HIP_CPU (C++17)      the same sources on the HIP CPU Runtime (../shared/tools/hip-cpu), which runs every
 *                            block on one CPU thread with a fiber per GPU thread: real __shared__ memory,
 *                            __syncthreads, atomics; the emulated library CI tests the kernels with.
 *
 * The kernels write CUDA and use exactly two things from here: GSM_LAUNCH (there is no `<<<>>>` in plain C++)
 * and GSM_DYNAMIC_SHARED (no `extern __shared__` either). Everything else is CUDA's names, given meaning on the
 * CPU below. Warp shuffles are the one semantic gap: HIP CPU's shuffles are block-wide barriers with 64-lane
 * warps, so a shuffle inside warp-uniform but block-divergent code (`if (warp == 0)`, one warp per head) would
 * deadlock or read the wrong lanes. The emulated __shfl_*_sync below are warp-scoped instead: 32 lanes that
 * exchange through a per-block buffer and wait for each other by yielding to the next lane's fiber, which is
 * what CUDA's full-mask __shfl_*_sync requires (all 32 lanes converged). `width` is honoured as CUDA does.
 */
#pragma once

#if defined(GSM_HIP_CPU)

#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

// HIP CPU marks kernels and device functions `simd` for GCC (vector clones of every kernel, one warning per struct
// argument); our kernels are fiber code, run one thread at a time.
#undef __global__
#define __global__
#undef __device__
#define __device__

// Launches on one stream run in order on a GPU. HIP CPU's stream processor can run two consecutive null-stream
// launches at once (Runtime::wait_all_streams_ drains the null stream from two threads), which made the second
// kernel read the first one's half-written output now and then; waiting for each launch restores CUDA's order.
#define GSM_LAUNCH(kernel, grid, block, smem, stream, ...) \
    do \
    { \
        hipLaunchKernelGGL(kernel, grid, block, smem, stream, __VA_ARGS__); \
        hipDeviceSynchronize(); \
    } while (0)
#define GSM_DYNAMIC_SHARED(type, name) HIP_DYNAMIC_SHARED(type, name)

using cudaError_t = hipError_t;
using cudaStream_t = hipStream_t;
constexpr hipError_t cudaSuccess = hipSuccess;
constexpr hipError_t cudaErrorInvalidValue = hipErrorInvalidValue;
// The emulation has no limit to lift; scripts and tests check the device limits statically
// (tests/test_cuda_launch_limits.py).
enum cudaFuncAttribute
{
    cudaFuncAttributeMaxDynamicSharedMemorySize
};

template <typename F>
inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int)
{
    return cudaSuccess;
}

inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream)
{
    (void)stream; // in order with the launches, which complete before they return (GSM_LAUNCH)
    return hipMemset(p, value, bytes);
}

inline cudaError_t cudaGetLastError()
{
    return hipGetLastError();
}

inline cudaError_t cudaDeviceSynchronize()
{
    return hipDeviceSynchronize();
}

inline char const* cudaGetErrorName(cudaError_t e)
{
    return hipGetErrorName(e);
}

inline char const* cudaGetErrorString(cudaError_t e)
{
    return hipGetErrorString(e);
}

// Separately rounded float32 operations: plain operators, the emulated build is compiled with -ffp-contract=off.
inline float __fadd_rn(float a, float b)
{
    return a + b;
}

inline float __fmul_rn(float a, float b)
{
    return a * b;
}

using std::max;
using std::min;

namespace gsm
{
namespace emu
{

constexpr int32_t kWarp = 32; // CUDA's warp, not HIP CPU's warpSize (64)

inline int32_t fiberId()
{
    return static_cast<int32_t>(id(::hip::detail::Fiber::this_fiber()));
}

// Wait for the other 31 lanes of this warp: yield to the next lane; the last lane yields to the first. Every lane
// of a converged warp calls this the same number of times, so each call returns once all 32 lanes have reached
// it. Block barriers (__syncthreads) go round the whole block the same way, so the two interleave correctly.
inline void warpBarrier()
{
    auto const& tile = ::hip::detail::Tile::this_tile();
    int32_t const n = static_cast<int32_t>(count(tile.dimensions()));
    int32_t const f = fiberId();
    int32_t const base = f / kWarp * kWarp;
    int32_t const lanes = std::min(kWarp, n - base);
    if (lanes == 1)
    {
        return;
    }
    ::hip::detail::this_tile::has_barrier = true; // tells the launcher to run the block's fibers to completion
    ::hip::detail::Fiber::yield(::hip::detail::Tile::fibers()[base + (f - base + 1) % lanes]);
}

template <typename T>
inline T* exchange()
{
    thread_local static T slots[1024]; // one per thread of a block (CUDA's maximum block size)
    return slots;
}

// Value of lane `src` of this lane's `width`-lane segment, as CUDA's __shfl_sync.
template <typename T>
inline T shuffleFrom(T v, int32_t src, int32_t width, bool keepOwnWhenOutside, int32_t self)
{
    T* slot = exchange<T>();
    int32_t const f = fiberId();
    slot[f] = v;
    warpBarrier();
    int32_t const seg = self / width * width;
    T const r = keepOwnWhenOutside ? v : slot[f - self + seg + src];
    warpBarrier(); // nobody overwrites a slot before every lane has read
    return r;
}

inline int32_t laneOf()
{
    return fiberId() % kWarp;
}

} // namespace emu
} // namespace gsm

// CUDA's warp shuffles (sm_30+ semantics, full mask): v of lane srcLane within this lane's width-wide segment.
template <typename T>
inline T __shfl_sync(unsigned, T v, int32_t srcLane, int32_t width = 32)
{
    int32_t const self = gsm::emu::laneOf();
    return gsm::emu::shuffleFrom(v, ((srcLane % width) + width) % width, width, false, self);
}

template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int32_t width = 32)
{
    int32_t const self = gsm::emu::laneOf();
    int32_t const inSeg = self % width;
    int32_t const src = inSeg - static_cast<int32_t>(delta);
    return gsm::emu::shuffleFrom(v, src < 0 ? inSeg : src, width, src < 0, self);
}

template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int32_t width = 32)
{
    int32_t const self = gsm::emu::laneOf();
    int32_t const inSeg = self % width;
    int32_t const src = inSeg + static_cast<int32_t>(delta);
    return gsm::emu::shuffleFrom(v, src >= width ? inSeg : src, width, src >= width, self);
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int32_t laneMask, int32_t width = 32)
{
    int32_t const self = gsm::emu::laneOf();
    int32_t const inSeg = self % width;
    int32_t const src = inSeg ^ laneMask;
    return gsm::emu::shuffleFrom(v, src >= width ? inSeg : src, width, src >= width, self);
}

#else // CUDA

#include <cuda_runtime_api.h>
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#define GSM_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define GSM_DYNAMIC_SHARED(type, name) extern __shared__ type name[]

#endif
