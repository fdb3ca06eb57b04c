#include "gsmKVCacheKernels.h"

#include <algorithm>

namespace gsm
{
namespace cuda
{
namespace
{

__device__ __forceinline__ float toFloat(float x)
{
    return x;
}

__device__ __forceinline__ float toFloat(__half x)
{
    return __half2float(x);
}

__device__ __forceinline__ uint8_t* seqPool(GsmDims const& d, int32_t* pool, int32_t b)
{
    return reinterpret_cast<uint8_t*>(pool + static_cast<int64_t>(b) * poolWords(d));
}

// grid (S, B): one block per new row; threads over latent channels and key channels.
template <typename T>
__global__ void kvCacheUpdateKernel(GsmDims d, int32_t S, T const* ck, T const* cv, T const* key, int32_t* pool,
    void* indexKeys, int32_t const* slots, int32_t const* pastLengths, int32_t const* newLengths, CacheRows rows)
{
    int32_t const j = blockIdx.x;
    int32_t const b = blockIdx.y;
    if (j >= newLengths[b] || !rows.valid(b))
    {
        return; // padding rows write nothing; nor does a sequence without a row of the pools
    }
    int32_t const cacheRow = rows.of(b);
    int32_t const p = pastLengths[b] + j;
    if (p < 0 || p >= d.nMax)
    {
        return;
    }
    int32_t const entry = slots[static_cast<int64_t>(b) * d.nMax + p];
    bool const rowOk = slotValid(d, entry) && slotTier(entry) == kTierFP16;
    int64_t const src = static_cast<int64_t>(b) * S + j;
    if (rowOk)
    {
        uint8_t* row = seqPool(d, pool, cacheRow) + rowOffset(d, slotRow(entry));
        int32_t const r = latentRank(d);
        for (int32_t c = threadIdx.x; c < r; c += blockDim.x)
        {
            float const v = c < d.rankK ? toFloat(ck[src * d.rankK + c]) : toFloat(cv[src * d.rankV + (c - d.rankK)]);
            storeFP16(row, c, v);
        }
    }
    uint8_t* kdst = static_cast<uint8_t*>(indexKeys) + indexKeyOffset(d, cacheRow, p);
    for (int32_t c = threadIdx.x; c < d.indexDim; c += blockDim.x)
    {
        float const e = toFloat(key[src * d.indexDim + c]);
        if (int8Keys(d))
        {
            reinterpret_cast<int8_t*>(kdst)[c] = keyCode(e);
        }
        else
        {
            reinterpret_cast<uint16_t*>(kdst)[c] = f32ToF16Bits(e);
        }
    }
}

// Phase 1 of the demotion: decode every source row into float32 staging [M, r].
__global__ void kvDemoteStageKernel(GsmDims d, int32_t B, int32_t const* list, int32_t* pool, float const* quant,
    float* staged)
{
    int32_t const m = blockIdx.x;
    int32_t const b = list[3 * m];
    int32_t const from = list[3 * m + 1];
    int32_t const r = latentRank(d);
    bool const ok = b >= 0 && b < B && slotValid(d, from);
    uint8_t const* row = ok ? seqPool(d, pool, b) + rowOffset(d, slotRow(from)) : nullptr;
    QuantView const qv{quant, r};
    for (int32_t c = threadIdx.x; c < r; c += blockDim.x)
    {
        staged[static_cast<int64_t>(m) * r + c] = ok ? loadLatent(d, row, slotTier(from), qv, c) : 0.f;
    }
}

// Phase 2: encode each staged row into its destination. INT12 and INT4 work on pairs of codes, one thread per
// pair, so no two threads write one byte.
__global__ void kvDemoteWriteKernel(GsmDims d, int32_t B, int32_t const* list, int32_t* pool, float const* quant,
    float const* staged)
{
    int32_t const m = blockIdx.x;
    int32_t const b = list[3 * m];
    int32_t const from = list[3 * m + 1];
    int32_t const to = list[3 * m + 2];
    if (b < 0 || b >= B || !slotValid(d, from) || !slotValid(d, to) || slotTier(to) < slotTier(from))
    {
        return; // malformed entries are skipped (see launchKVCacheUpdate)
    }
    int32_t const r = latentRank(d);
    QuantView const qv{quant, r};
    float const* v = staged + static_cast<int64_t>(m) * r;
    uint8_t* row = seqPool(d, pool, b) + rowOffset(d, slotRow(to));
    int32_t const tier = slotTier(to);
    if (tier == kTierFP16)
    {
        for (int32_t c = threadIdx.x; c < r; c += blockDim.x)
        {
            storeFP16(row, c, v[c]);
        }
    }
    else if (tier == kTierINT12)
    {
        int32_t const pairsK = (d.rankK + 1) / 2;
        int32_t const pairsV = (d.rankV + 1) / 2;
        for (int32_t i = threadIdx.x; i < pairsK + pairsV; i += blockDim.x)
        {
            int32_t const part = i < pairsK ? 0 : 1;
            int32_t const p = part ? i - pairsK : i;
            int32_t const n = part ? d.rankV : d.rankK;
            int32_t const c0 = part ? d.rankK : 0;
            int32_t const a = quantize(v[c0 + 2 * p], qv.s12(c0 + 2 * p), kQmaxINT12);
            int32_t const bq = 2 * p + 1 < n ? quantize(v[c0 + 2 * p + 1], qv.s12(c0 + 2 * p + 1), kQmaxINT12) : 0;
            packINT12Pair(a, bq, int12PairPtr(d, row, part, p));
        }
    }
    else if (tier == kTierINT8)
    {
        for (int32_t c = threadIdx.x; c < r; c += blockDim.x)
        {
            row[c] = static_cast<uint8_t>(static_cast<int8_t>(quantize(v[c], qv.s8(c), kQmaxINT8)));
        }
    }
    else
    {
        int32_t const bytesK = packedINT4Bytes(d.rankK);
        int32_t const bytesV = packedINT4Bytes(d.rankV);
        for (int32_t i = threadIdx.x; i < bytesK + bytesV; i += blockDim.x)
        {
            int32_t const part = i < bytesK ? 0 : 1;
            int32_t const p = part ? i - bytesK : i;
            int32_t const n = part ? d.rankV : d.rankK;
            int32_t const c0 = part ? d.rankK : 0;
            bool const pair = 2 * p + 1 < n; // else the last byte of an odd part: a zero high nibble
            int32_t const a = quantize(v[c0 + 2 * p], qv.s4(c0 + 2 * p), kQmaxINT4);
            int32_t const bq = pair ? quantize(v[c0 + 2 * p + 1], qv.s4(c0 + 2 * p + 1), kQmaxINT4) : 0;
            *int4PairPtr(d, row, part, p) = packINT4Pair(a, bq);
        }
    }
}

constexpr int32_t kUpdateThreads = 128;
constexpr int32_t kDemoteThreads = 128;

// One launch covers nb sequences (gridDim.y = b, so at most kMaxGridDimY of them) of S new rows each.
LaunchList updateLaunches(int32_t S, int64_t nb)
{
    LaunchList l;
    l.add(launchOf(kKernelKVCacheUpdate, S, nb, kUpdateThreads, 0));
    return l;
}

LaunchList demoteLaunches(int64_t M)
{
    LaunchList l;
    l.add(launchOf(kKernelKVDemoteStage, M, 1, kDemoteThreads, 0));
    l.add(launchOf(kKernelKVDemoteWrite, M, 1, kDemoteThreads, 0));
    return l;
}

} // namespace

template <typename T>
cudaError_t launchKVCacheUpdate(GsmDims const& d, int32_t B, int32_t S, T const* ck, T const* cv, T const* key,
    int32_t* pool, void* indexKeys, int32_t const* slots, int32_t const* pastLengths, int32_t const* newLengths,
    CacheRows rows, cudaStream_t stream)
{
    if (B <= 0 || S <= 0)
    {
        return cudaSuccess;
    }
    // Sequences beyond gridDim.y's reach go to further launches, each seeing its first sequence as b = 0 (the
    // kernel indexes the call's buffers by blockIdx.y): those pointers and the row mapping are offset to that
    // sequence; the pools are addressed by cache row.
    for (int64_t b0 = 0; b0 < B; b0 += kMaxGridDimY)
    {
        LaunchGeometry const& g = updateLaunches(S, std::min<int64_t>(kMaxGridDimY, B - b0))[0];
        int64_t const src = b0 * S;      // first new row of sequence b0 in ck / cv / key
        int64_t const pos = b0 * d.nMax; // its first position in kv_slots
        GSM_LAUNCH(kvCacheUpdateKernel<T>, gridOf(g), blockOf(g), smemOf(g), stream, d, S, ck + src * d.rankK,
            cv + src * d.rankV, key + src * d.indexDim, pool, indexKeys, slots + pos, pastLengths + b0,
            newLengths + b0, rows.from(static_cast<int32_t>(b0)));
    }
    return cudaGetLastError();
}

std::vector<LaunchGeometry> kvCacheUpdateLaunches(int32_t B, int32_t S)
{
    std::vector<LaunchGeometry> out;
    if (B > 0 && S > 0)
    {
        appendChunked(out, B, kMaxGridDimY, [&](int64_t nb) { return updateLaunches(S, nb); });
    }
    return out;
}

size_t kvDemoteWorkspaceBytes(GsmDims const& d, int64_t maxEntries)
{
    return static_cast<size_t>(maxEntries) * latentRank(d) * sizeof(float);
}

cudaError_t launchKVDemote(GsmDims const& d, int32_t B, int32_t M, int32_t const* list, int32_t* pool,
    float const* quant, void* workspace, cudaStream_t stream)
{
    if (M <= 0)
    {
        return cudaSuccess;
    }
    float* staged = static_cast<float*>(workspace);
    LaunchList const g = demoteLaunches(M);
    GSM_LAUNCH(kvDemoteStageKernel, gridOf(g[0]), blockOf(g[0]), smemOf(g[0]), stream, d, B, list, pool, quant, staged);
    GSM_LAUNCH(kvDemoteWriteKernel, gridOf(g[1]), blockOf(g[1]), smemOf(g[1]), stream, d, B, list, pool, quant, staged);
    return cudaGetLastError();
}

std::vector<LaunchGeometry> kvDemoteLaunches(int32_t M)
{
    std::vector<LaunchGeometry> out;
    if (M > 0)
    {
        for (LaunchGeometry const& g : demoteLaunches(M))
        {
            out.push_back(g);
        }
    }
    return out;
}

template cudaError_t launchKVCacheUpdate<float>(GsmDims const&, int32_t, int32_t, float const*, float const*,
    float const*, int32_t*, void*, int32_t const*, int32_t const*, int32_t const*, CacheRows, cudaStream_t);
template cudaError_t launchKVCacheUpdate<__half>(GsmDims const&, int32_t, int32_t, __half const*, __half const*,
    __half const*, int32_t*, void*, int32_t const*, int32_t const*, int32_t const*, CacheRows, cudaStream_t);

} // namespace cuda
} // namespace gsm
