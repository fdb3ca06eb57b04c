/*
 * CUDA kernels of GsmSparseAttention (docs/engine_io.md 4.2). One code path serves decode (S = 1)
 * and prefill / chunked prefill (S > 1): every query row gets its own selection and gathers only
 * its selected latent rows, computed by the same blocks whatever else the call holds, so a row of a
 * verification is the one-token step's. Rows are processed in chunks so the workspace stays bounded.
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

// Device pointers of one GsmSparseAttention call. T (float or __half) is the activation type of
// q, index_q, index_w and out; weights, tables and quant are float32.
struct AttnDeviceArgs
{
    void const* q;
    int32_t const* pool;
    int32_t const* slots;
    int32_t const* pastLengths;
    int32_t const* newLengths;
    float const* quant;
    float const* ropeCos;
    float const* ropeSin;
    float const* w0;
    float const* w1;
    void const* indexQ;             // owning
    void const* indexW;             // owning
    void const* indexKeys;          // owning: FP16 bits or INT8 codes (GsmDims.indexKeyBits)
    int32_t const* sparseWindow;    // owning, device scalar
    int32_t const* selectedIn;      // sharing
    void* out;
    int32_t* selectedOut;           // owning
    float* mass;                    // owning (may be null)
    int32_t const* sparseTopK;      // owning, device [B]: each sequence's budget, clamped to 0..max_top_k
                                    // (null: max_top_k for every sequence, the pre-rev-4 behaviour); a query
                                    // grows it with GsmDims.sparseTopKDivisor (queryTopK)
    CacheRows rows;                 // cache_rows (device [B]) into the [R, ...] pools / keys
    int32_t const* logitRows;       // owning, device [B, J]: rows whose queries' own mass queryMass gets
    int32_t logitRowCount;          // J
    float* queryMass;               // owning, device [B, J, N_max] (may be null): each logit row's own mass, the
                                    // bits a one-token step at that row returns as `mass`; 0 for a padding row
};

// Workspace for calls of up to maxRows = B*S query rows.
size_t sparseAttentionWorkspaceBytes(GsmDims const& d, int64_t maxRows);

// The kernel launches launchSparseAttention(d, B, S, ..., workspaceBytes) issues, appended to `out` (one record per
// distinct geometry); false when it would refuse the workspace (cudaErrorInvalidValue).
bool sparseAttentionLaunches(
    GsmDims const& d, int32_t B, int32_t S, size_t workspaceBytes, std::vector<LaunchGeometry>& out);

template <typename T>
cudaError_t launchSparseAttention(GsmDims const& d, int32_t B, int32_t S, AttnDeviceArgs const& a, void* workspace,
    size_t workspaceBytes, cudaStream_t stream);

} // namespace cuda
} // namespace gsm
