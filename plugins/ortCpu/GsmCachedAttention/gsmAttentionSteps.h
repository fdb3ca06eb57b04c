/*
 * gsmAttentionSteps.h: the attention core's internals that the pool ops' translation units share
 * (../GsmPoolAttention/gsmPoolRows.cpp, gsmPoolSharedAttention.cpp): a call's scratch, RoPE and the softmax (one
 * definition each, in gsmCachedAttention.cpp, so every op rounds them alike) and the pool steps runCachedAttention
 * runs for GsmPoolAttention. Not an interface: the ops' callers use gsmCachedAttention.h and gsmPoolRows.h.
 */
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../GsmPoolAttention/gsmPoolRows.h"
#include "gsmCachedAttention.h"

namespace gsm
{
namespace ortcpu
{

// A call's buffers, kept by the calling thread from call to call (see releasePrefillScratch)
struct Scratch
{
    std::vector<float> qr, scores, probs, ctx, vrows;
    std::vector<double> pd;
    std::vector<int64_t> scoreOff, blockStart;
    std::vector<int32_t> nsel, slot;
    std::vector<float const*> krow, vrow;
    std::vector<int64_t> uniq; // (b * Lmax + p) of the distinct rows of a prefill call
    std::vector<float const*> uniqLatent; // their V latents
    PoolCall pool;             // GsmPoolAttention: the rows of the cached positions the call selects
    std::vector<int32_t> needIdx; // position -> index into pool.need of the sequence at hand (-1 elsewhere)
    std::vector<int32_t> slotOf;  // position -> row-cache slot of the sequence at hand (-1 elsewhere)
};

// Gives a prefill's scratch back at the first call of one token (gsmCachedAttention.cpp says why)
void releasePrefillScratch(Scratch& sc, int64_t S);

// p = softmax(p) over n logits in place: max, exp of the differences, divided by their float32 sum in order
void softmax(float* p, int64_t n);

// RoPE of one head's D values at the position whose cos / sin rows are c, s (rotate-half)
void rope(float const* x, float const* c, float const* s, int64_t D, float* out);

// An empty list of needed positions for B sequences, and position maps for N positions (all -1 between calls).
inline void startNeed(Scratch& sc, int64_t N, int64_t B)
{
    if (sc.needIdx.size() < static_cast<size_t>(N))
    {
        sc.needIdx.assign(static_cast<size_t>(N), -1);
        sc.slotOf.assign(static_cast<size_t>(N), -1);
    }
    sc.pool.need.clear();
    sc.pool.needOff.assign(static_cast<size_t>(B + 1), 0);
}

// sc.needIdx over sequence b's needed positions: each one's index into sc.pool.need (`on`), or -1 again (the map's
// state between calls).
inline void mapNeed(Scratch& sc, int64_t b, bool on)
{
    PoolCall const& pc = sc.pool;
    for (int64_t i = pc.needOff[b]; i < pc.needOff[b + 1]; ++i)
    {
        sc.needIdx[static_cast<size_t>(pc.need[static_cast<size_t>(i)])] = on ? static_cast<int32_t>(i) : -1;
    }
}

// -- the pool steps (../GsmPoolAttention/gsmPoolRows.cpp) -----------------------------------------------------------

// GsmPoolAttention, before the attention: the cached positions each sequence's queries select (need), their K rows
// from the row cache or made from the pool (U_k c_k, RoPE), and with `vLatents` their V latents dequantised from the
// pool into sc.pool.vLatent (a call that rebuilds V rows dequantises each distinct one as it makes it: loadVLatentAt)
bool resolvePoolRows(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t k,
    CachedAttentionOutputs const& out, Scratch& sc, ParallelRunner const& par, bool vLatents, std::string* error);

// The dequantised V latent [rv] of sequence b's cached position p, from its pool row
void loadVLatentAt(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b, int64_t p, float* out);

// The call's new K rows (section A) into the row cache of each sequence, newest first, in slots this call did not
// read: the next step's window reads them.
void rowCacheInsertNew(CachedAttentionDims const& d, CachedAttentionInputs const& in, float const* newKRows);

// The call's new latent rows (FP16, the values GsmSideSplit rounded) and indexer keys into the pools, as
// GsmKVCacheUpdate writes them; prepareCachedAttention checked every entry.
void poolWriteNew(CachedAttentionDims const& d, CachedAttentionInputs const& in);

} // namespace ortcpu
} // namespace gsm
