#include "gsmSparseAttentionKernels.h"

#include <algorithm>
#include <cmath>

namespace gsm
{
namespace cuda
{
namespace
{

constexpr int32_t kSelectThreads = 256;
constexpr int32_t kScoreThreads = 128;
constexpr int32_t kAttnThreads = 128;
constexpr int32_t kCountThreads = 128;
constexpr int32_t kMassThreads = 128;
constexpr int32_t kGroupTile = 8;           // query heads accumulated in registers at once
constexpr size_t kChunkBudget = 64u << 20;  // workspace bound: rows are processed in chunks
constexpr size_t kAlign = 256;

__device__ __forceinline__ float toFloat(float x)
{
    return x;
}
__device__ __forceinline__ float toFloat(__half x)
{
    return __half2float(x);
}
template <typename T>
__device__ __forceinline__ T fromFloat(float x);
template <>
__device__ __forceinline__ float fromFloat<float>(float x)
{
    return x;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float x)
{
    return __float2half_rn(x);
}

size_t alignUp(size_t x)
{
    return (x + kAlign - 1) / kAlign * kAlign;
}

struct Layout
{
    size_t scores, counts, logits, acc, total;
};

Layout layoutFor(GsmDims const& d, int64_t rows)
{
    Layout l{};
    size_t const R = static_cast<size_t>(rows);
    size_t const scores = d.layerKind == 0 ? R * d.nMax * sizeof(float) : 0;
    l.scores = 0;
    l.counts = alignUp(scores);
    l.logits = l.counts + alignUp(R * sizeof(int32_t));
    l.acc = l.logits + alignUp(R * d.numHeads * maxSelected(d) * sizeof(float));
    l.total = l.acc + alignUp(R * d.numHeads * latentRank(d) * sizeof(float));
    return l;
}

size_t perRowBytes(GsmDims const& d)
{
    return (d.layerKind == 0 ? static_cast<size_t>(d.nMax) * sizeof(float) : 0) + sizeof(int32_t)
        + static_cast<size_t>(d.numHeads) * (maxSelected(d) + latentRank(d)) * sizeof(float);
}

// Rows of one chunk: 64 MiB of workspace, and never more than gridDim.y can index (indexScoresKernel and
// attendKernel take the chunk's row from blockIdx.y; small models fit 100k+ rows in the budget).
int64_t rowsPerChunk(GsmDims const& d)
{
    return std::min<int64_t>(kMaxGridDimY, std::max<int64_t>(1, static_cast<int64_t>(kChunkBudget / perRowBytes(d))));
}

// The new rows of sequence b this call computes: none when its cache row is not one of the pools' (a kernel
// cannot raise; the CPU reference refuses such a row), so such a sequence reads and writes nothing.
__device__ __forceinline__ int32_t newRows(AttnDeviceArgs const& a, int32_t b)
{
    return a.rows.valid(b) ? a.newLengths[b] : 0;
}

// ---- 1. indexer scores: grid (ceil(N_max / kScoreThreads), rows of the chunk) --------------------
template <typename T>
__global__ void indexScoresKernel(GsmDims d, int32_t S, int32_t r0, AttnDeviceArgs a, float* scores)
{
    GSM_DYNAMIC_SHARED(float, sm);
    float* qh = sm;                              // [nI * dI]
    float* wh = sm + d.indexHeads * d.indexDim;  // [nI]
    int32_t const rr = blockIdx.y;
    int32_t const row = r0 + rr;
    int32_t const b = row / S, j = row % S;
    if (j >= newRows(a, b))
    {
        return;
    }
    int32_t const t = a.pastLengths[b] + j;
    if (static_cast<int32_t>(blockIdx.x * blockDim.x) > t)
    {
        return; // whole block beyond the causal limit
    }
    T const* iq = static_cast<T const*>(a.indexQ) + static_cast<int64_t>(row) * d.indexHeads * d.indexDim;
    T const* iw = static_cast<T const*>(a.indexW) + static_cast<int64_t>(row) * d.indexHeads;
    for (int32_t i = threadIdx.x; i < d.indexHeads * d.indexDim; i += blockDim.x)
    {
        qh[i] = toFloat(iq[i]);
    }
    for (int32_t i = threadIdx.x; i < d.indexHeads; i += blockDim.x)
    {
        wh[i] = toFloat(iw[i]);
    }
    __syncthreads();
    int32_t const s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s > t)
    {
        return;
    }
    uint8_t const* key = static_cast<uint8_t const*>(a.indexKeys) + indexKeyOffset(d, a.rows.of(b), s);
    bool const codes = int8Keys(d); // INT8 codes: the query is scaled by the keys' scale already
    float acc = 0.f;
    for (int32_t i = 0; i < d.indexHeads; ++i)
    {
        float dot = 0.f;
        for (int32_t c = 0; c < d.indexDim; ++c)
        {
            float const e = codes ? static_cast<float>(reinterpret_cast<int8_t const*>(key)[c])
                                  : __half2float(reinterpret_cast<__half const*>(key)[c]);
            dot += qh[i * d.indexDim + c] * e;
        }
        acc += wh[i] * fmaxf(dot, 0.f);
    }
    float const scale = static_cast<float>(sqrt(static_cast<double>(d.indexDim)));
    scores[static_cast<int64_t>(rr) * d.nMax + s] = acc / scale;
}

// Block-wide exclusive scan of one int per thread (blockDim a multiple of 32, <= 1024).
__device__ int32_t blockExclusiveScan(int32_t v, int32_t* total, int32_t* warpSums)
{
    int32_t const lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nWarps = blockDim.x >> 5;
    int32_t x = v;
    for (int32_t o = 1; o < 32; o <<= 1)
    {
        int32_t const y = __shfl_up_sync(0xFFFFFFFFu, x, o, 32);
        if (lane >= o)
        {
            x += y;
        }
    }
    if (lane == 31)
    {
        warpSums[warp] = x;
    }
    __syncthreads();
    if (warp == 0)
    {
        int32_t y = lane < nWarps ? warpSums[lane] : 0;
        for (int32_t o = 1; o < 32; o <<= 1)
        {
            int32_t const z = __shfl_up_sync(0xFFFFFFFFu, y, o, 32);
            if (lane >= o)
            {
                y += z;
            }
        }
        warpSums[lane] = y; // inclusive over warps
    }
    __syncthreads();
    int32_t const before = warp > 0 ? warpSums[warp - 1] : 0;
    *total = warpSums[nWarps - 1];
    __syncthreads(); // warpSums is reused by the next call
    return before + x - v;
}

// ---- 2. selection: one block per row. Radix select of the top-k key (4 passes of 8 bits), then
// an ordered compaction so equal scores go to the lower position (spec 4.1 tie rule). -----------
__global__ void selectKernel(GsmDims d, int32_t S, int32_t r0, AttnDeviceArgs a, float const* scores, int32_t* counts)
{
    __shared__ uint32_t hist[256];
    __shared__ uint32_t sPrefix, sMask;
    __shared__ int32_t sRemain;
    __shared__ int32_t warpSums[32];
    int32_t const rr = blockIdx.x;
    int32_t const row = r0 + rr;
    int32_t const b = row / S, j = row % S;
    int32_t const kSel = maxSelected(d);
    int32_t* out = a.selectedOut + static_cast<int64_t>(row) * kSel;
    int32_t const nValid = newRows(a, b);
    int32_t count = 0;
    if (j < nValid)
    {
        int32_t const t = a.pastLengths[b] + j;
        // The runtime validates sparse_window (the CPU reference rejects it); a kernel cannot raise,
        // so clamp to [1, max_sparse_window] rather than write past K_sel.
        int32_t const w = min(max(*a.sparseWindow, 1), d.maxSparseWindow);
        // Same for the query's budget (grown with the context by sparse_top_k_divisor):
        // clamped to [0, max_top_k] so that the selection never outgrows K_sel = sinks + max_sparse_window
        // + max_top_k.
        int32_t const topK = queryTopK(d, a.sparseTopK != nullptr ? a.sparseTopK[b] : d.maxTopK, t);
        if (selectionIsDense(t, d.sinkTokens, w, topK))
        {
            for (int32_t s = threadIdx.x; s <= t; s += blockDim.x)
            {
                out[s] = s;
            }
            count = t + 1;
        }
        else
        {
            float const* sc = scores + static_cast<int64_t>(rr) * d.nMax;
            int32_t const c0 = d.sinkTokens, c1 = t - w; // candidates [c0, c1]
            for (int32_t s = threadIdx.x; s < d.sinkTokens; s += blockDim.x)
            {
                out[s] = s;
            }
            if (topK > 0)
            {
                if (threadIdx.x == 0)
                {
                    sPrefix = 0u;
                    sMask = 0u;
                    sRemain = topK;
                }
                for (int32_t shift = 24; shift >= 0; shift -= 8)
                {
                    for (int32_t i = threadIdx.x; i < 256; i += blockDim.x)
                    {
                        hist[i] = 0u;
                    }
                    __syncthreads();
                    uint32_t const prefix = sPrefix, mask = sMask;
                    for (int32_t s = c0 + threadIdx.x; s <= c1; s += blockDim.x)
                    {
                        uint32_t const key = orderedKey(sc[s]);
                        if ((key & mask) == prefix)
                        {
                            atomicAdd(&hist[(key >> shift) & 0xFFu], 1u);
                        }
                    }
                    __syncthreads();
                    if (threadIdx.x == 0)
                    {
                        int32_t cum = 0;
                        for (int32_t dg = 255; dg >= 0; --dg)
                        {
                            int32_t const h = static_cast<int32_t>(hist[dg]);
                            if (cum + h >= sRemain)
                            {
                                sPrefix = prefix | (static_cast<uint32_t>(dg) << shift);
                                sMask = mask | (0xFFu << shift);
                                sRemain -= cum;
                                break;
                            }
                            cum += h;
                        }
                    }
                    __syncthreads();
                }
                uint32_t const thr = sPrefix;
                int32_t const needEq = sRemain; // keys equal to thr to take, lowest positions first
                int32_t base = d.sinkTokens, eqSeen = 0;
                for (int32_t cs = c0; cs <= c1; cs += blockDim.x)
                {
                    int32_t const s = cs + threadIdx.x;
                    uint32_t const key = s <= c1 ? orderedKey(sc[s]) : 0u;
                    int32_t const gt = s <= c1 && key > thr;
                    int32_t const eq = s <= c1 && key == thr;
                    int32_t eqTotal = 0, takeTotal = 0;
                    int32_t const eqRank = blockExclusiveScan(eq, &eqTotal, warpSums);
                    int32_t const take = gt || (eq && eqSeen + eqRank < needEq);
                    int32_t const pos = blockExclusiveScan(take, &takeTotal, warpSums);
                    if (take)
                    {
                        out[base + pos] = s;
                    }
                    base += takeTotal;
                    eqSeen += eqTotal;
                }
            }
            for (int32_t s = c1 + 1 + threadIdx.x; s <= t; s += blockDim.x)
            {
                out[d.sinkTokens + topK + (s - c1 - 1)] = s;
            }
            count = d.sinkTokens + topK + w;
        }
    }
    for (int32_t k = count + threadIdx.x; k < kSel; k += blockDim.x)
    {
        out[k] = -1;
    }
    if (threadIdx.x == 0)
    {
        counts[rr] = count;
    }
}

// Sharing layers: count the valid entries of the source's selection.
__global__ void countSelectedKernel(GsmDims d, int32_t S, int32_t r0, int32_t nRows, AttnDeviceArgs a, int32_t* counts)
{
    int32_t const rr = blockIdx.x * blockDim.x + threadIdx.x;
    if (rr >= nRows)
    {
        return;
    }
    int32_t const row = r0 + rr;
    int32_t const b = row / S, j = row % S;
    int32_t const kSel = maxSelected(d);
    int32_t const* sel = a.selectedIn + static_cast<int64_t>(row) * kSel;
    int32_t const t = a.pastLengths[b] + j;
    int32_t c = 0;
    if (j < newRows(a, b))
    {
        while (c < kSel && sel[c] >= 0 && sel[c] <= t)
        {
            ++c;
        }
    }
    counts[rr] = c;
}

// ---- 3. attention: grid (nKV, rows of the chunk); one block per (row, key head) serves the
// group of query heads that read that key head. K is reconstructed per selected row (RoPE after
// reconstruction forbids absorbing U_k into q); V is absorbed: out = U_v (sum_s p_s c_v,s). ------
template <typename T>
__global__ void attendKernel(GsmDims d, int32_t S, int32_t r0, AttnDeviceArgs a, int32_t const* selBase,
    int32_t const* counts, float* logitsWs, float* accWs)
{
    GSM_DYNAMIC_SHARED(float, sm);
    int32_t const D = d.headDim, half = D / 2;
    int32_t const group = d.numHeads / d.numKvHeads;
    int32_t const r = latentRank(d);
    int32_t const kvD = kvDim(d);
    bool const owning = d.layerKind == 0;
    float* qs = sm;                  // [group, D] rotated queries
    float* c = qs + group * D;       // [r] one dequantised latent row
    float* kpre = c + r;             // [D]
    float* krot = kpre + D;          // [D]
    float* psum = krot + D;          // [group]
    int32_t const h = blockIdx.x;
    int32_t const rr = blockIdx.y;
    int32_t const row = r0 + rr;
    int32_t const b = row / S, j = row % S;
    T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(row) * d.numHeads + h * group) * D;
    if (j >= newRows(a, b))
    {
        for (int32_t i = threadIdx.x; i < group * D; i += blockDim.x)
        {
            out[i] = fromFloat<T>(0.f);
        }
        return;
    }
    int32_t const t = a.pastLengths[b] + j;
    int32_t const kSel = maxSelected(d);
    int32_t const count = counts[rr];
    int32_t const* sel = selBase + static_cast<int64_t>(row) * kSel;
    int32_t const* slots = a.slots + static_cast<int64_t>(b) * d.nMax;
    uint8_t const* pool = reinterpret_cast<uint8_t const*>(a.pool + static_cast<int64_t>(a.rows.of(b)) * poolWords(d));
    QuantView const qv{a.quant, r};
    float const invScale = 1.f / static_cast<float>(sqrt(static_cast<double>(D)));
    T const* q = static_cast<T const*>(a.q) + (static_cast<int64_t>(row) * d.numHeads + h * group) * D;
    float const* cosT = a.ropeCos + static_cast<int64_t>(t) * D;
    float const* sinT = a.ropeSin + static_cast<int64_t>(t) * D;
    for (int32_t i = threadIdx.x; i < group * D; i += blockDim.x)
    {
        int32_t const g = i / D, e = i % D;
        float const x = toFloat(q[i]);
        float const rot = e < half ? -toFloat(q[g * D + e + half]) : toFloat(q[g * D + e - half]);
        qs[i] = __fadd_rn(__fmul_rn(x, cosT[e]), __fmul_rn(rot, sinT[e]));
    }
    __syncthreads();
    float* lg = logitsWs + (static_cast<int64_t>(rr) * d.numHeads + h * group) * kSel; // [group, kSel]
    int32_t const lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nWarps = blockDim.x >> 5;
    int32_t const nK = owning ? d.rankK : r; // latent channels K reads
    for (int32_t k = 0; k < count; ++k)
    {
        int32_t const s = sel[k];
        int32_t const entry = slots[s];
        bool const ok = slotValid(d, entry);
        uint8_t const* rowp = ok ? pool + rowOffset(d, slotRow(entry)) : nullptr;
        for (int32_t i = threadIdx.x; i < nK; i += blockDim.x)
        {
            c[i] = ok ? loadLatent(d, rowp, slotTier(entry), qv, i) : 0.f;
        }
        __syncthreads();
        for (int32_t e = threadIdx.x; e < D; e += blockDim.x)
        {
            int32_t const o = h * D + e;
            float acc = 0.f;
            float const* wrow = a.w0 + static_cast<int64_t>(o) * nK;
            for (int32_t i = 0; i < nK; ++i)
            {
                acc += wrow[i] * c[i];
            }
            kpre[e] = owning ? acc : acc + a.w1[o];
        }
        __syncthreads();
        float const* cosS = a.ropeCos + static_cast<int64_t>(s) * D;
        float const* sinS = a.ropeSin + static_cast<int64_t>(s) * D;
        for (int32_t e = threadIdx.x; e < D; e += blockDim.x)
        {
            float const rot = e < half ? -kpre[e + half] : kpre[e - half];
            krot[e] = __fadd_rn(__fmul_rn(kpre[e], cosS[e]), __fmul_rn(rot, sinS[e]));
        }
        __syncthreads();
        for (int32_t g = warp; g < group; g += nWarps)
        {
            float part = 0.f;
            for (int32_t e = lane; e < D; e += 32)
            {
                part += qs[g * D + e] * krot[e];
            }
            for (int32_t o = 16; o > 0; o >>= 1)
            {
                part += __shfl_xor_sync(0xFFFFFFFFu, part, o, 32);
            }
            if (lane == 0)
            {
                lg[g * kSel + k] = part * invScale;
            }
        }
        __syncthreads();
    }
    // softmax per query head (one warp per head)
    for (int32_t g = warp; g < group; g += nWarps)
    {
        float mx = -INFINITY;
        for (int32_t k = lane; k < count; k += 32)
        {
            mx = fmaxf(mx, lg[g * kSel + k]);
        }
        for (int32_t o = 16; o > 0; o >>= 1)
        {
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o, 32));
        }
        float sum = 0.f;
        for (int32_t k = lane; k < count; k += 32)
        {
            float const e = expf(lg[g * kSel + k] - mx);
            lg[g * kSel + k] = e;
            sum += e;
        }
        for (int32_t o = 16; o > 0; o >>= 1)
        {
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o, 32);
        }
        float ps = 0.f;
        for (int32_t k = lane; k < count; k += 32)
        {
            float const p = lg[g * kSel + k] / sum;
            lg[g * kSel + k] = p;
            ps += p;
        }
        for (int32_t o = 16; o > 0; o >>= 1)
        {
            ps += __shfl_xor_sync(0xFFFFFFFFu, ps, o, 32);
        }
        if (lane == 0)
        {
            psum[g] = ps;
        }
    }
    __syncthreads();
    // latent-space accumulation acc[g][i] = sum_k p[g,k] c_k[cOff + i]
    int32_t const nV = owning ? d.rankV : r;
    int32_t const cOff = owning ? d.rankK : 0;
    float* acc = accWs + (static_cast<int64_t>(rr) * d.numHeads + h * group) * r; // [group, r]
    for (int32_t i = threadIdx.x; i < nV; i += blockDim.x)
    {
        for (int32_t g0 = 0; g0 < group; g0 += kGroupTile)
        {
            float regs[kGroupTile];
#pragma unroll
            for (int32_t gg = 0; gg < kGroupTile; ++gg)
            {
                regs[gg] = 0.f;
            }
            for (int32_t k = 0; k < count; ++k)
            {
                int32_t const entry = slots[sel[k]];
                float const v = slotValid(d, entry)
                    ? loadLatent(d, pool + rowOffset(d, slotRow(entry)), slotTier(entry), qv, cOff + i)
                    : 0.f;
#pragma unroll
                for (int32_t gg = 0; gg < kGroupTile; ++gg)
                {
                    if (g0 + gg < group)
                    {
                        regs[gg] += lg[(g0 + gg) * kSel + k] * v;
                    }
                }
            }
            for (int32_t gg = 0; gg < kGroupTile && g0 + gg < group; ++gg)
            {
                acc[(g0 + gg) * r + i] = regs[gg];
            }
        }
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < group * D; i += blockDim.x)
    {
        int32_t const g = i / D, e = i % D;
        int32_t const o = owning ? h * D + e : kvD + h * D + e;
        float const* wrow = (owning ? a.w1 : a.w0) + static_cast<int64_t>(o) * nV;
        float v = 0.f;
        for (int32_t k = 0; k < nV; ++k)
        {
            v += wrow[k] * acc[g * r + k];
        }
        if (!owning)
        {
            v += a.w1[o] * psum[g]; // sum_s p_s (W c_s + bias) = W (sum p c) + bias * sum p
        }
        out[i] = fromFloat<T>(v);
    }
}

// ---- 4. masses (owning): one block per row, over the softmax weights attendKernel left in the workspace. A pick's
// mass is summed over the query heads in head order (the reference's order) by one thread, so a row's mass is the
// same bits whatever else the call holds: added into attn_mass (atomics: a prefill chunk's rows meet at shared
// positions in no fixed order; a one-token step's single row adds each to 0), and stored as query_mass for every logit
// row naming this row (the one-token step's attn_mass, bit for bit). -----------------------------------------------
__global__ void massKernel(GsmDims d, int32_t S, int32_t r0, AttnDeviceArgs a, float const* logitsWs,
    int32_t const* counts)
{
    int32_t const rr = blockIdx.x;
    int32_t const row = r0 + rr;
    int32_t const b = row / S, j = row % S;
    if (j >= newRows(a, b))
    {
        return;
    }
    int32_t const kSel = maxSelected(d);
    int32_t const count = counts[rr];
    int32_t const J = a.queryMass != nullptr ? a.logitRowCount : 0;
    int32_t const* sel = a.selectedOut + static_cast<int64_t>(row) * kSel;
    float const* p = logitsWs + static_cast<int64_t>(rr) * d.numHeads * kSel; // [nH, kSel]
    for (int32_t k = threadIdx.x; k < count; k += blockDim.x)
    {
        float m = 0.f;
        for (int32_t h = 0; h < d.numHeads; ++h)
        {
            m += p[h * kSel + k];
        }
        if (a.mass != nullptr)
        {
            atomicAdd(a.mass + static_cast<int64_t>(b) * d.nMax + sel[k], m);
        }
        for (int32_t i = 0; i < J; ++i)
        {
            if (a.logitRows[static_cast<int64_t>(b) * J + i] == j)
            {
                a.queryMass[(static_cast<int64_t>(b) * J + i) * d.nMax + sel[k]] = m;
            }
        }
    }
}

size_t attendSmemBytes(GsmDims const& d)
{
    int32_t const group = d.numHeads / d.numKvHeads;
    return static_cast<size_t>(group * d.headDim + latentRank(d) + 2 * d.headDim + group) * sizeof(float);
}

size_t indexScoresSmemBytes(GsmDims const& d)
{
    return static_cast<size_t>(d.indexHeads * d.indexDim + d.indexHeads) * sizeof(float);
}

// Rows a call over `rows` rows processes per chunk: rowsPerChunk, halved until `workspaceBytes` holds the chunk's
// layout; 0 when not even one row fits.
int64_t chunkRows(GsmDims const& d, int64_t rows, size_t workspaceBytes)
{
    int64_t chunk = std::min<int64_t>(rows, rowsPerChunk(d));
    while (chunk > 1 && layoutFor(d, chunk).total > workspaceBytes)
    {
        chunk = chunk / 2;
    }
    return layoutFor(d, chunk).total > workspaceBytes ? 0 : chunk;
}

// The launches of one chunk of n rows, in launch order (owning: scores, selection, attention, masses; sharing: the
// count of the source's selection, attention). The launcher and sparseAttentionLaunches both take the geometry from here.
LaunchList chunkLaunches(GsmDims const& d, int64_t n)
{
    LaunchList l;
    if (d.layerKind == 0)
    {
        l.add(launchOf(kKernelIndexScores, (d.nMax + kScoreThreads - 1) / kScoreThreads, n, kScoreThreads,
            static_cast<int64_t>(indexScoresSmemBytes(d))));
        l.add(launchOf(kKernelSelect, n, 1, kSelectThreads, 0));
    }
    else
    {
        l.add(launchOf(kKernelCountSelected, (n + kCountThreads - 1) / kCountThreads, 1, kCountThreads, 0));
    }
    l.add(launchOf(kKernelAttend, d.numKvHeads, n, kAttnThreads, static_cast<int64_t>(attendSmemBytes(d))));
    if (d.layerKind == 0)
    {
        l.add(launchOf(kKernelMass, n, 1, kMassThreads, 0));
    }
    return l;
}

// Lifts the 48 KiB default for a launch that needs more dynamic shared memory (the SM's opt-in maximum is checked
// statically, tests/test_cuda_launch_limits.py).
template <typename T>
cudaError_t allowDynamicSmem(LaunchGeometry const& g)
{
    if (!g.optIn)
    {
        return cudaSuccess;
    }
    int const bytes = static_cast<int>(g.dynamicSmemBytes);
    switch (g.kernel)
    {
    case kKernelAttend:
        return cudaFuncSetAttribute(attendKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    case kKernelIndexScores:
        return cudaFuncSetAttribute(indexScoresKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    default: return cudaErrorInvalidValue; // no other kernel takes dynamic shared memory
    }
}

} // namespace

size_t sparseAttentionWorkspaceBytes(GsmDims const& d, int64_t maxRows)
{
    return layoutFor(d, std::min<int64_t>(std::max<int64_t>(maxRows, 1), rowsPerChunk(d))).total;
}

bool sparseAttentionLaunches(
    GsmDims const& d, int32_t B, int32_t S, size_t workspaceBytes, std::vector<LaunchGeometry>& out)
{
    int64_t const rows = static_cast<int64_t>(B) * S;
    if (rows <= 0)
    {
        return true;
    }
    int64_t const chunk = chunkRows(d, rows, workspaceBytes);
    if (chunk == 0)
    {
        return false;
    }
    appendChunked(out, rows, chunk, [&](int64_t n) { return chunkLaunches(d, n); });
    return true;
}

template <typename T>
cudaError_t launchSparseAttention(GsmDims const& d, int32_t B, int32_t S, AttnDeviceArgs const& a, void* workspace,
    size_t workspaceBytes, cudaStream_t stream)
{
    int64_t const rows = static_cast<int64_t>(B) * S;
    if (rows <= 0)
    {
        return cudaSuccess;
    }
    int64_t const chunk = chunkRows(d, rows, workspaceBytes);
    if (chunk == 0)
    {
        return cudaErrorInvalidValue;
    }
    Layout const l = layoutFor(d, chunk);
    char* ws = static_cast<char*>(workspace);
    float* scores = reinterpret_cast<float*>(ws + l.scores);
    int32_t* counts = reinterpret_cast<int32_t*>(ws + l.counts);
    float* logits = reinterpret_cast<float*>(ws + l.logits);
    float* acc = reinterpret_cast<float*>(ws + l.acc);
    bool const owning = d.layerKind == 0;
    if (owning && a.mass != nullptr)
    {
        cudaMemsetAsync(a.mass, 0, static_cast<size_t>(B) * d.nMax * sizeof(float), stream);
    }
    if (owning && a.queryMass != nullptr)
    {
        cudaMemsetAsync(a.queryMass, 0, static_cast<size_t>(B) * a.logitRowCount * d.nMax * sizeof(float), stream);
    }
    for (LaunchGeometry const& g : chunkLaunches(d, chunk)) // shared memory does not depend on the chunk's rows
    {
        cudaError_t const e = allowDynamicSmem<T>(g);
        if (e != cudaSuccess)
        {
            return e;
        }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += chunk)
    {
        int32_t const n = static_cast<int32_t>(std::min<int64_t>(chunk, rows - r0));
        int32_t const r = static_cast<int32_t>(r0);
        LaunchList const g = chunkLaunches(d, n);
        if (owning)
        {
            GSM_LAUNCH(indexScoresKernel<T>, gridOf(g[0]), blockOf(g[0]), smemOf(g[0]), stream, d, S, r, a, scores);
            GSM_LAUNCH(selectKernel, gridOf(g[1]), blockOf(g[1]), smemOf(g[1]), stream, d, S, r, a, scores, counts);
        }
        else
        {
            GSM_LAUNCH(countSelectedKernel, gridOf(g[0]), blockOf(g[0]), smemOf(g[0]), stream, d, S, r, n, a, counts);
        }
        LaunchGeometry const& ga = g[owning ? 2 : 1];
        int32_t const* sel = owning ? a.selectedOut : a.selectedIn;
        GSM_LAUNCH(attendKernel<T>, gridOf(ga), blockOf(ga), smemOf(ga), stream, d, S, r, a, sel, counts, logits, acc);
        if (owning)
        {
            GSM_LAUNCH(massKernel, gridOf(g[3]), blockOf(g[3]), smemOf(g[3]), stream, d, S, r, a, logits, counts);
        }
    }
    return cudaGetLastError();
}

template cudaError_t launchSparseAttention<float>(
    GsmDims const&, int32_t, int32_t, AttnDeviceArgs const&, void*, size_t, cudaStream_t);
template cudaError_t launchSparseAttention<__half>(
    GsmDims const&, int32_t, int32_t, AttnDeviceArgs const&, void*, size_t, cudaStream_t);

} // namespace cuda
} // namespace gsm
