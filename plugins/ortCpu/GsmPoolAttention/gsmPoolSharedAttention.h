/*
 * gsmPoolSharedAttention.h: the math of the ONNX Runtime CPU op GsmPoolSharedAttention (README.md here), on raw
 * pointers: a KV-sharing layer (spec 4.2) over its source's pool, after the source's GsmPoolAttention wrote the
 * call's new rows there. It attends over the source's selection with [K; V] = W [c_k; c_v] + bias, K rows from this
 * layer's own row cache (gsmPoolRows.h). Padding rows (j >= new_lengths[b]) are zero.
 */
#pragma once

#include <cstdint>
#include <string>

#include "../GsmCachedAttention/gsmCachedAttention.h"
#include "gsmPoolRows.h"

namespace gsm
{
namespace ortcpu
{

struct SharedAttentionInputs
{
    float const* q = nullptr;              // [B,S,nH*D] (or [B*S, ...])
    int32_t const* selected = nullptr;     // [B,S,k] the source's selection, ascending, -1 padded
    int64_t k = 0;
    float const* projW = nullptr;          // kv_proj weight [2*kvD, rk+rv]
    float const* projB = nullptr;          // kv_proj bias [2*kvD]
    float const* ropeCos = nullptr;        // [N,D]
    float const* ropeSin = nullptr;        // [N,D]
    int32_t const* cacheRows = nullptr;    // [B]
    int32_t const* pastLengths = nullptr;  // [B]
    int32_t const* newLengths = nullptr;   // [B]
    PoolSource const* pool = nullptr;      // the source's pool, this layer's row cache
};

// attnOut [B,S,nH*D] for dims d (nH, nKV, D, B, S, N, R, rk, rv); false with a message naming the input on a value
// the shapes cannot rule out (lengths, rows, a selection past its query, a slot without a row)
bool runPoolSharedAttention(CachedAttentionDims const& d, SharedAttentionInputs const& in, float* attnOut,
    ParallelRunner const& par, std::string* error);

} // namespace ortcpu
} // namespace gsm
