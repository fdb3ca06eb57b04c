/*
 * C ABI of the CUDA kernels (libgsm_plugins_cuda.so) for tests/gpu and scripts/gpu_check.sh:
 * every pointer is a device pointer (e.g. torch.cuda tensors' data_ptr()), float32 activations,
 * the default stream unless one is passed. The same launchers back the TensorRT plugins.
 */
#include "../gsmKVCache/gsmKVCacheKernels.h"
#include "../gsmSparseAttention/gsmSparseAttentionKernels.h"
#include "gsm_layout.h"

#include "gsm_cuda_compat.h"

#include <algorithm>
#include <string>
#include <vector>

#define GSM_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{
thread_local std::string gLastError;

int32_t status(cudaError_t e)
{
    gLastError = e == cudaSuccess ? std::string() : std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    return e == cudaSuccess ? 0 : 1;
}
} // namespace

using gsm::GsmDims;

GSM_EXPORT char const* gsm_cuda_last_error()
{
    return gLastError.c_str();
}

// SMs this library carries code for (what CMAKE_CUDA_ARCHITECTURES compiled), e.g. "87;90".
GSM_EXPORT char const* gsm_cuda_architectures()
{
#ifdef GSM_CUDA_ARCHS
    return GSM_CUDA_ARCHS;
#else
    return "";
#endif
}

// fp16 0: ck/cv/key float32; 1: float16 bits (what TensorRT passes when it picks kHALF for the plugins' I/O).
GSM_EXPORT int32_t gsm_cuda_kv_update(GsmDims const* d, int32_t B, int32_t S, int32_t fp16, void const* ck,
    void const* cv, void const* key, int32_t* pool, void* indexKeys, int32_t const* slots, int32_t const* past,
    int32_t const* newLengths, int32_t const* cacheRowsDevice, int32_t poolRows, void* stream)
{
    cudaStream_t const st = static_cast<cudaStream_t>(stream);
    gsm::CacheRows const rows = gsm::cacheRowsOf(cacheRowsDevice, poolRows, B);
    if (fp16)
    {
        return status(gsm::cuda::launchKVCacheUpdate(*d, B, S, static_cast<__half const*>(ck),
            static_cast<__half const*>(cv), static_cast<__half const*>(key), pool, indexKeys, slots, past, newLengths,
            rows, st));
    }
    return status(gsm::cuda::launchKVCacheUpdate(*d, B, S, static_cast<float const*>(ck),
        static_cast<float const*>(cv), static_cast<float const*>(key), pool, indexKeys, slots, past, newLengths, rows,
        st));
}

GSM_EXPORT int64_t gsm_cuda_kv_demote_workspace_bytes(GsmDims const* d, int64_t maxEntries)
{
    return static_cast<int64_t>(gsm::cuda::kvDemoteWorkspaceBytes(*d, maxEntries));
}

GSM_EXPORT int32_t gsm_cuda_kv_demote(GsmDims const* d, int32_t B, int32_t M, int32_t const* list, int32_t* pool,
    float const* quant, void* workspace, void* stream)
{
    return status(gsm::cuda::launchKVDemote(*d, B, M, list, pool, quant, workspace, static_cast<cudaStream_t>(stream)));
}

GSM_EXPORT int64_t gsm_cuda_attention_workspace_bytes(GsmDims const* d, int64_t maxRows)
{
    return static_cast<int64_t>(gsm::cuda::sparseAttentionWorkspaceBytes(*d, maxRows));
}

// fp16 0: q, index_q, index_w and out float32; 1: float16 bits (TensorRT's kHALF). Everything else float32/int32.
// logitRows [B, J] and queryMass [B, J, N_max] (owning; both null or neither): each logit row's own attention mass.
GSM_EXPORT int32_t gsm_cuda_sparse_attention(GsmDims const* d, int32_t B, int32_t S, int32_t fp16, void const* q,
    int32_t const* pool, int32_t const* slots, int32_t const* past, int32_t const* newLengths, float const* quant,
    float const* ropeCos, float const* ropeSin, float const* w0, float const* w1, void const* indexQ,
    void const* indexW, void const* indexKeys, int32_t const* sparseWindowDevice, int32_t const* selectedIn,
    int32_t const* sparseTopKDevice, int32_t const* cacheRowsDevice, int32_t poolRows, int32_t const* logitRows,
    int32_t J, void* out, int32_t* selectedOut, float* mass, float* queryMass, void* workspace, int64_t workspaceBytes,
    void* stream)
{
    gsm::cuda::AttnDeviceArgs a{q, pool, slots, past, newLengths, quant, ropeCos, ropeSin, w0, w1, indexQ, indexW,
        indexKeys, sparseWindowDevice, selectedIn, out, selectedOut, mass, sparseTopKDevice,
        gsm::cacheRowsOf(cacheRowsDevice, poolRows, B), logitRows, J, queryMass};
    size_t const ws = static_cast<size_t>(workspaceBytes);
    cudaStream_t const st = static_cast<cudaStream_t>(stream);
    return status(fp16 ? gsm::cuda::launchSparseAttention<__half>(*d, B, S, a, workspace, ws, st)
                       : gsm::cuda::launchSparseAttention<float>(*d, B, S, a, workspace, ws, st));
}

// ---- launch geometry: host-only, no CUDA call (tests/test_cuda_launch_limits.py checks it against the SM limits) ---

// Bytes of one gsm::cuda::LaunchGeometry record, so that a binding can tell it was written for this layout.
GSM_EXPORT int32_t gsm_cuda_launch_record_bytes()
{
    return static_cast<int32_t>(sizeof(gsm::cuda::LaunchGeometry));
}

// Name of the __global__ function of a record's `kernel` (null for an unknown id).
GSM_EXPORT char const* gsm_cuda_kernel_name(int32_t id)
{
    return gsm::cuda::kernelName(id);
}

// Every kernel launch of one layer's nodes, as the launchers above issue them: GsmKVCacheUpdate of B x S new rows
// and GsmKVDemote of M entries (owning layers, d->layerKind 0; M 0: no demotion), GsmSparseAttention of B x S query
// rows with `workspaceBytes` of workspace. Writes the first `capacity` records to `out` and returns how many there
// are; -1 when the attention launcher would refuse the workspace (gsm_cuda_last_error says why).
GSM_EXPORT int32_t gsm_cuda_launch_geometry(GsmDims const* d, int32_t B, int32_t S, int64_t workspaceBytes, int32_t M,
    gsm::cuda::LaunchGeometry* out, int32_t capacity)
{
    std::vector<gsm::cuda::LaunchGeometry> all;
    bool const owning = d->layerKind == 0;
    if (owning)
    {
        all = gsm::cuda::kvCacheUpdateLaunches(B, S);
    }
    if (!gsm::cuda::sparseAttentionLaunches(*d, B, S, static_cast<size_t>(std::max<int64_t>(workspaceBytes, 0)), all))
    {
        gLastError = "the workspace (" + std::to_string(workspaceBytes) + " bytes) cannot hold one query row";
        return -1;
    }
    if (owning)
    {
        for (gsm::cuda::LaunchGeometry const& g : gsm::cuda::kvDemoteLaunches(M))
        {
            all.push_back(g);
        }
    }
    gLastError.clear();
    for (size_t i = 0; i < all.size() && static_cast<int64_t>(i) < capacity; ++i)
    {
        out[i] = all[i];
    }
    return static_cast<int32_t>(all.size());
}

GSM_EXPORT int32_t gsm_cuda_synchronize()
{
    return status(cudaDeviceSynchronize());
}
