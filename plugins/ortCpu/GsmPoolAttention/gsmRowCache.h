/*
 * gsmRowCache.h: the row cache's lookup, shared by the two pool ops' translation units (gsmPoolRows.cpp,
 * gsmPoolSharedAttention.cpp). Not an interface: gsmPoolRows.h describes the cache.
 */
#pragma once

#include <cstdint>
#include <vector>

#include "../GsmCachedAttention/gsmAttentionSteps.h"

namespace gsm
{
namespace ortcpu
{

// A K row reconstructed from a pool row: U_k c_k, then RoPE at its position, per key head (as section A makes
// the call's new rows, so a row made from the same FP16 latent has the same bits).
struct RowJob
{
    int64_t need; // its index into PoolCall::need
    int64_t b;
    int32_t position, entry;
    float* dst;
    int64_t overflow; // >= 0: dst is overflow row `overflow` (set once the overflow buffer has its size)
};

// Every sequence's lookup (sc.pool.need, grouped by sequence): sc.pool.kRow points at each needed row's K row (a
// slot of the row cache, or the overflow) and the returned jobs say which of them to make. The list is the calling
// thread's, returned by reference: in the workers' lambdas a thread_local name would be the worker's own (empty)
// instance.
std::vector<RowJob>& rowCacheJobs(CachedAttentionDims const& d, CachedAttentionInputs const& in, Scratch& sc);

} // namespace ortcpu
} // namespace gsm
