/*
 * CPU reference of GsmSparseAttention (docs/engine_io.md 4.2): indexer scores, sink + window + top-k
 * selection, gather and dequantisation of the selected latent rows, K/V reconstruction (U of an
 * owning layer or kv_projector of a sharing layer), RoPE, GQA softmax attention and the attention
 * mass per position, and per logit row its query's own mass. Each sequence selects with its own sparse_top_k, each
 * query with that budget grown to (t + 1) / sparse_top_k_divisor when the node has a divisor. Every query row is
 * computed alone (its selection, K/V rows made per position, its softmax and sums), so a row of a call of several
 * tokens gives the bits of a one-token step at that position. float32 activations; multi-threaded over query rows.
 */
#pragma once

#include "../common/gsm_layout.h"

#include <cstdint>
#include <string>

namespace gsm
{
namespace ref
{

struct AttnInputs
{
    float const* q;             // [B, S, nH*D] before RoPE
    int32_t const* pool;        // [R, poolWords]: sequence b's pool is row rows.of(b)
    int32_t const* slots;       // [B, N_max]
    int32_t const* pastLengths; // [B]
    int32_t const* newLengths;  // [B]
    float const* quant;         // [5, r]: s12, s8, comp8, s4, comp4
    float const* ropeCos;       // [N_max, D]
    float const* ropeSin;       // [N_max, D]
    float const* w0;            // owning: k_up [kvD, r_k]; sharing: kv_proj_weight [2kvD, r]
    float const* w1;            // owning: v_up [kvD, r_v]; sharing: kv_proj_bias [2kvD]
    float const* indexQ;        // owning: [B, S, nI*dI]
    float const* indexW;        // owning: [B, S, nI]
    void const* indexKeys;      // owning: [R, N_max, indexKeyBytes] FP16 bits or INT8 codes, rows as the pool's
    int32_t sparseWindow;       // owning: run-time window
    int32_t const* selectedIn;  // sharing: [B, S, K_sel]
    int32_t const* sparseTopK;  // owning: [B] budget of each sequence, 0..max_top_k (nullptr: max_top_k for all)
    CacheRows rows;             // cache_rows; {nullptr, B, 0}: row b
    int32_t const* logitRows;   // owning: [B, J] rows (0..S-1) whose queries' own mass queryMass gets (or nullptr)
    int32_t logitRowCount;      // J
};

struct AttnOutputs
{
    float* out;        // [B, S, nH*D]
    int32_t* selected; // owning: [B, S, K_sel] (nullptr allowed for sharing)
    float* mass;       // owning: [B, N_max] (nullptr allowed)
    float* scores;     // optional diagnostics: [B, S, N_max] index scores, NaN where not computed
    float* queryMass;  // owning: [B, J, N_max] the mass query logitRows[b, i] alone gave each position, summed over
                       // heads (a one-token step's `mass`); 0 for a padding row (nullptr allowed; needs logitRows)
};

// Returns false with *err set on invalid lengths, window, sparse_top_k, cache rows, logit rows or slot entries.
// nThreads <= 0: all cores.
bool sparseAttention(GsmDims const& d, int32_t B, int32_t S, AttnInputs const& in, AttnOutputs const& out,
    int32_t nThreads, std::string* err);

} // namespace ref
} // namespace gsm
