/*
 * gsmPoolRows.h: where GsmPoolAttention finds the rows it attends over. The cache is the plugins' own
 * (docs/engine_io.md section 3: per-layer byte pools of FP16 / INT12 / INT8 / INT4 latent rows addressed through
 * the slot table, indexer keys by position), the bytes the CUDA kernels and the C++ reference read. K needs its
 * rows (RoPE comes after U_k), so a bounded per-sequence row cache keeps the reconstructed K rows of recently
 * selected positions; V is linear in the latent, so the selected V latents are dequantised per call and weighted
 * before U_v (no V rows are kept).
 *
 * Row cache of one layer, one buffer pair per pool row (the runtime allocates them beside the pools; the op
 * updates them in place): `rows` [R, C, kvD] float32 and `tags` [R, 3, C] int32, tag rows (position, slot entry
 * the row was made from, the call it was last used in). A slot is valid while its position is below the
 * sequence's length and the slot table still holds the same entry for it: a re-tier pass re-encodes a row under
 * a new entry (its tier changes; a move changes its row), a rollback or a new sequence rewrites positions at or
 * past the length, so neither can read a stale row. Capacity C is a constant of the plan, not of the context.
 */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../../common/gsm_layout.h"

namespace gsm
{
namespace ortcpu
{

enum RowCacheTag : int32_t
{
    kTagPosition = 0, // -1: free
    kTagEntry = 1,    // the kv_slots entry the row was made from
    kTagUsed = 2,     // the call (past_lengths + S) it was last read in: the least recent is evicted first
    kTagRows = 3
};

struct PoolSource
{
    GsmDims dims{};                       // rank_k, rank_v, n_max, rows_* (the pool layout; heads unused here)
    uint8_t* pool = nullptr;              // kv_pool [R, poolBytes]: rows read, the call's new rows written (FP16)
    int64_t poolBytes = 0;                // bytes of one pool row (4 * P32)
    int32_t const* slots = nullptr;       // kv_slots [B, N_max] of the call's sequences
    float const* quant = nullptr;         // [5, r]: s12, s8, comp8, s4, comp4
    void* indexKeys = nullptr;            // index_keys [R, N_max, keyStride] (written: the call's new keys)
    float* cacheRows = nullptr;           // row cache [R, C, kvD]
    int32_t* cacheTags = nullptr;         // [R, kTagRows, C]
    int64_t capacity = 0;                 // C
    int32_t* misses = nullptr;            // [B] rows reconstructed for each sequence (optional)
};

// Per call: which K rows and V latents the attention reads for the cached positions of each sequence.
struct PoolCall
{
    // sequence b's cached positions the call selects, ascending: need[needOff[b] .. needOff[b + 1])
    std::vector<int32_t> need;
    std::vector<int64_t> needOff;
    std::vector<float const*> kRow;      // by need entry: the K row (in the row cache or in `overflow`)
    std::vector<float> vLatent;           // by need entry: the dequantised V latent [rv]
    std::vector<float> overflow;          // K rows a full row cache could not keep this call
};

// A dequantised latent (channels c0 .. c0 + n of the row held at slot entry `entry`), bit for bit the golden's.
void loadLatents(GsmDims const& d, uint8_t const* poolRow, int32_t entry, float const* quant, int32_t c0, int32_t n,
    float* out);

} // namespace ortcpu
} // namespace gsm
