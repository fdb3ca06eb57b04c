/*
 * CUDA kernels of GsmKVCacheUpdate and GsmKVDemote (docs/engine_io.md 4.1, 4.3). Host-callable
 * launchers only; the TensorRT wrappers and the ctypes C API share them.
 */
#pragma once

#include "../common/gsm_cuda_compat.h"
#include "../common/gsm_launch_geometry.h"
#include "../common/gsm_layout.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gsm
{
namespace cuda
{

// Write valid new rows (FP16 RNE) and indexer keys. T = float or __half for ck/cv/key.
// Malformed slot entries (not an FP16-tier row) are skipped: a kernel cannot raise, and writing
// through a bad entry would corrupt another position; the runtime owns kv_slots and validates it.
template <typename T>
cudaError_t launchKVCacheUpdate(GsmDims const& d, int32_t B, int32_t S, T const* ck, T const* cv, T const* key,
    int32_t* pool, void* indexKeys, int32_t const* slots, int32_t const* pastLengths, int32_t const* newLengths,
    CacheRows rows, cudaStream_t stream);

// The kernel launches of launchKVCacheUpdate(d, B, S, ...), one record per distinct geometry.
std::vector<LaunchGeometry> kvCacheUpdateLaunches(int32_t B, int32_t S);

// Staging buffer of the demotion (all sources are read before any destination is written).
size_t kvDemoteWorkspaceBytes(GsmDims const& d, int64_t maxEntries);

// list [M,3] (b, old entry, new entry) on the device; workspace >= kvDemoteWorkspaceBytes(d, M).
cudaError_t launchKVDemote(GsmDims const& d, int32_t B, int32_t M, int32_t const* list, int32_t* pool,
    float const* quant, void* workspace, cudaStream_t stream);

// The kernel launches of launchKVDemote(d, B, M, ...).
std::vector<LaunchGeometry> kvDemoteLaunches(int32_t M);

} // namespace cuda
} // namespace gsm
