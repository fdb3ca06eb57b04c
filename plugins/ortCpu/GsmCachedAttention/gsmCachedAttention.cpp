// GsmCachedAttention's core (gsmCachedAttention.h), also GsmPoolAttention's: validation, then the call's sections in
// order (A new rows and RoPE, B index scores, C selection, D attention and the V sum, E attention mass); the hot loops
// are ../kernels/gsmOrtKernels.h's. Compiled without FMA contraction: RoPE and the softmax then round as the portable
// graph's separate ops do.
#include "gsmCachedAttention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../kernels/gsmOrtKernels.h"
#include "gsmAttentionSteps.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

// Index scoring of a query is split into blocks of this many positions, so that the intra-op threads share a
// decode step's one query (B*S = 1).
constexpr int64_t kScoreBlock = 512;
// A decode step's float64 V-latent sum is split over the latent columns in chunks of this many (a multiple of
// the kernel's 12).
constexpr int64_t kCtxChunk = 48;
// Calls of at most this many queries per sequence (a decode step, a speculative verification) attend over the V
// latents as a decode step does, so each query's output is the bits of the same query decoded alone: a verified
// draft then continues exactly as one-token steps would have. Larger prefill chunks rebuild V once per kept row.
constexpr int64_t kLatentSumQueries = 16;

// A score as an unsigned integer in the same order (larger first), -0 equal to +0 and NaN below every other score:
// ONNX TopK's order; the keys of ../../common/gsm_math.h orderedKey (the plugins' selection), written branch-free
// here: GCC compiles orderedKey's sign and zero tests to branches, and the sign is a coin toss for an indexer whose
// head weights differ in sign.
inline uint32_t scoreKey(float s)
{
    if (std::isnan(s))
    {
        s = -std::numeric_limits<float>::max(); // unordered: ranked below every other score
    }
    s += 0.f; // -0 + +0 = +0: ties with +0, as a float comparison has it
    uint32_t u;
    std::memcpy(&u, &s, sizeof u);
    return u ^ (static_cast<uint32_t>(-static_cast<int32_t>(u >> 31)) | 0x80000000u);
}

// (score descending, position ascending) as one integer, larger first: ONNX TopK's order and tie rule
inline uint64_t rankKey(uint32_t scoreKey, int64_t p)
{
    return (static_cast<uint64_t>(scoreKey) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(p));
}

inline int32_t rankPosition(uint64_t key)
{
    return static_cast<int32_t>(~static_cast<uint32_t>(key));
}

// The positions of the m largest rank keys among n >= m scores of positions p0 .. p0 + n - 1, unordered, into picks.
// A radix select: a pass counts the score keys' top bits, which fixes every position above the bucket that holds the
// m-th and every one below it; that bucket is refined on the next bits the same way while it is large (scores of one
// layer share their sign, exponent and first mantissa bits: the first bucket alone held a quarter of 8K positions),
// and only the last one's keys are ordered (nth_element over all n positions mispredicts about half its branches).
// queries whose attention weights are held at once (section D); 32 rather than 64: 2 MiB less at the end of an 8K
// prompt (layer 0's 1,057 kept rows x 9 heads a query), the prefill as fast (bench/memory_breakdown.py)
constexpr int64_t kQueryBlock = 32;
constexpr int kRadixBits = 11;
constexpr size_t kSmallBucket = 64; // below this, nth_element on the bucket beats another counting pass

void topPositions(float const* s, int64_t p0, int64_t n, int64_t m, std::vector<int32_t>& picks)
{
    static thread_local uint32_t hist[1 << kRadixBits];
    static thread_local std::vector<uint32_t> sk;
    static thread_local std::vector<uint64_t> boundary;
    std::memset(hist, 0, sizeof hist);
    sk.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
    {
        uint32_t const u = scoreKey(s[p0 + i]);
        sk[static_cast<size_t>(i)] = u;
        ++hist[u >> (32 - kRadixBits)];
    }
    int64_t above = 0; // keys in buckets above b
    uint32_t b = (1u << kRadixBits) - 1;
    for (; b > 0 && above + hist[b] < m; --b)
    {
        above += hist[b];
    }
    boundary.clear();
    for (int64_t i = 0; i < n; ++i)
    {
        uint32_t const top = sk[static_cast<size_t>(i)] >> (32 - kRadixBits);
        if (top > b)
        {
            picks.push_back(static_cast<int32_t>(p0 + i));
        }
        else if (top == b)
        {
            boundary.push_back(rankKey(sk[static_cast<size_t>(i)], p0 + i));
        }
    }
    int64_t need = m - above; // 1 .. boundary.size()
    // the boundary's keys agree on the score key's bits above `shift`: count the next digit among them
    for (int shift = 32 - kRadixBits; shift > 0 && need < static_cast<int64_t>(boundary.size())
         && boundary.size() > kSmallBucket;)
    {
        int const bits = std::min(kRadixBits, shift);
        shift -= bits;
        uint32_t const mask = (1u << bits) - 1;
        std::memset(hist, 0, sizeof(uint32_t) << bits);
        for (uint64_t const key : boundary)
        {
            ++hist[(key >> (32 + shift)) & mask];
        }
        int64_t over = 0;
        uint32_t d = mask;
        for (; d > 0 && over + hist[d] < need; --d)
        {
            over += hist[d];
        }
        size_t kept = 0;
        for (uint64_t const key : boundary)
        {
            uint32_t const digit = (key >> (32 + shift)) & mask;
            if (digit > d)
            {
                picks.push_back(rankPosition(key));
            }
            else if (digit == d)
            {
                boundary[kept++] = key;
            }
        }
        boundary.resize(kept);
        need -= over;
    }
    if (need < static_cast<int64_t>(boundary.size()))
    {
        std::nth_element(boundary.begin(), boundary.begin() + (need - 1), boundary.end(), std::greater<uint64_t>());
    }
    for (int64_t i = 0; i < need; ++i)
    {
        picks.push_back(rankPosition(boundary[static_cast<size_t>(i)]));
    }
}

// y = U[row0 .. row0 + m) x over U's r columns, U float32 or float16 bits (in.halfUp)
void upMatvec(Kernels const& K, CachedAttentionInputs const& in, void const* U, int64_t row0, float const* x,
    int64_t m, int64_t r, float* y)
{
    if (in.halfUp)
    {
        K.matvecHalf(static_cast<uint16_t const*>(U) + row0 * r, x, m, r, y);
    }
    else
    {
        K.matvec(static_cast<float const*>(U) + row0 * r, x, m, r, y);
    }
}

// One call of the core: what every section reads
struct AttentionCall
{
    CachedAttentionDims const& d;
    CachedAttentionInputs const& in;
    CachedAttentionOutputs const& out;
    int64_t k, L;                // widths of selected and attn_mass (prepareCachedAttention)
    Kernels const& K;
    Scratch& sc;                 // the calling thread's (runCachedAttention says why it is passed by reference)
    ParallelRunner const& par;
    ParallelRunner const& small; // a decode step's smallest sections: the calling thread (Q = 1), else par
    // V from cached rows (U_v c made once per row, new ones in section A) instead of the latents: a decode step's
    // weighted sum is then nH*K*D float32 multiply-adds instead of nH*K*rv float64 ones and nH*D*rv for U_v
    bool vRows;
    bool latentSum; // a decode-like call over latents: float64 latent sum, then U_v (kLatentSumQueries)
    bool uniqueV;   // a prefill over latents: V = U_v c once per distinct kept row
};

// -- A: the call's K rows (U_k c, RoPE) and the queries' RoPE, per (row, key head) ---------------------------------
bool newRowsAndQueryRope(AttentionCall const& c)
{
    CachedAttentionInputs const& in = c.in;
    CachedAttentionOutputs const& out = c.out;
    Kernels const& K = c.K;
    Scratch& sc = c.sc;
    int64_t const S = c.d.S, Q = c.d.B * S, nH = c.d.nH, nKV = c.d.nKV, D = c.d.D, grp = nH / nKV, kvD = nKV * D;
    int64_t const rk = c.d.rk, rv = c.d.rv;
    bool const vRows = c.vRows;
    auto qpos = [&](int64_t q) { return static_cast<int64_t>(in.pastLengths[q / S]) + q % S; };
    sc.qr.resize(static_cast<size_t>(Q * nH * D));
    return parallelFor(c.small, Q * nKV, [&](int64_t i) {
        int64_t const q = i / nKV, g = i % nKV, pos = qpos(q);
        float const* c = in.ropeCos + pos * D;
        float const* s = in.ropeSin + pos * D;
        float tmp[512];
        std::vector<float> big;
        float* t = tmp;
        if (D > 512)
        {
            big.resize(static_cast<size_t>(D));
            t = big.data();
        }
        upMatvec(K, in, in.kUp, g * D, in.newLatentK + q * rk, D, rk, t);
        rope(t, c, s, D, out.newKRows + q * kvD + g * D);
        if (vRows)
        {
            upMatvec(K, in, in.vUp, g * D, in.newLatentV + q * rv, D, rv, out.newVRows + q * kvD + g * D);
        }
        for (int64_t h = g * grp; h < (g + 1) * grp; ++h)
        {
            rope(in.q + (q * nH + h) * D, c, s, D, sc.qr.data() + (q * nH + h) * D);
        }
    });
}

// -- B: index scores of every causal position of each query, by position, in blocks; only for the queries whose
//       budget leaves the indexer a choice (section C's tests): a streaming layer (top-k 0), a query within sinks +
//       window, and one whose budget covers every position (spec 4.1: then Sel(t) is every s <= t, as in a short
//       context) skip the scan of every cached key
bool indexScores(AttentionCall const& c)
{
    CachedAttentionDims const& d = c.d;
    CachedAttentionInputs const& in = c.in;
    Kernels const& K = c.K;
    Scratch& sc = c.sc;
    ParallelRunner const& par = c.par;
    int64_t const k = c.k, S = d.S, Q = d.B * S, nI = d.nI, dI = d.dI, N = d.N, W = in.window;
    int64_t const keyStride = in.keyStride > 0 ? in.keyStride : dI;
    // the graph's constant: np.float32(math.sqrt(dI)), divided by last
    float const sqrtDI = static_cast<float>(std::sqrt(static_cast<double>(dI)));
    auto qb = [&](int64_t q) { return q / S; };
    auto qpos = [&](int64_t q) { return static_cast<int64_t>(in.pastLengths[q / S]) + q % S; };
    auto needsScores = [&](int64_t q) {
        int64_t const t = qpos(q), lo = std::min(d.sinks, t + 1), ws = std::max(t - W + 1, lo);
        int64_t const kcap = std::min(d.sinks + W + queryTopK(d, in, qb(q), t), k);
        return kcap > lo + (t + 1 - ws) && kcap < t + 1;
    };
    sc.scoreOff.resize(static_cast<size_t>(Q + 1));
    sc.blockStart.resize(static_cast<size_t>(Q + 1));
    sc.scoreOff[0] = sc.blockStart[0] = 0;
    for (int64_t q = 0; q < Q; ++q)
    {
        int64_t const cols = needsScores(q) ? qpos(q) + 1 : 0;
        sc.scoreOff[q + 1] = sc.scoreOff[q] + cols;
        sc.blockStart[q + 1] = sc.blockStart[q] + (cols + kScoreBlock - 1) / kScoreBlock;
    }
    sc.scores.resize(static_cast<size_t>(sc.scoreOff[Q]));
    return parallelFor(par, sc.blockStart[Q], [&](int64_t i) {
        int64_t const q = std::upper_bound(sc.blockStart.begin(), sc.blockStart.end(), i) - sc.blockStart.begin() - 1;
        int64_t const b = qb(q), past = in.pastLengths[b], row = in.cacheRows[b];
        int64_t const p0 = (i - sc.blockStart[q]) * kScoreBlock, p1 = std::min(p0 + kScoreBlock, qpos(q) + 1);
        float const* iq = in.indexQ + q * nI * dI;
        float const* w = in.indexW + q * nI;
        float* o = sc.scores.data() + sc.scoreOff[q];
        int64_t const c1 = std::min(p1, past);
        // keys of positions p..p+n-1 from `keys` (elements offset `at`, rows `stride` apart); the scoring kernels
        // read rows dI apart, so rows of another stride (the pools' INT8 keys, padded to words) go one by one
        auto score = [&](void const* keys, int64_t at, int64_t stride, int64_t n, float* dst)
        {
            int64_t const per = stride == dI ? n : 1;
            for (int64_t i = 0; i < n; i += per)
            {
                if (in.int8Keys)
                {
                    K.scoresInt8(iq, w, nI, dI, sqrtDI, static_cast<int8_t const*>(keys) + (at + i) * stride, per,
                        dst + i);
                }
                else
                {
                    K.scores(iq, w, nI, dI, sqrtDI, static_cast<uint16_t const*>(keys) + (at + i) * stride, per,
                        dst + i);
                }
            }
        };
        if (p0 < c1)
        {
            score(in.indexKeys, row * N + p0, keyStride, c1 - p0, o + p0);
        }
        int64_t const n0 = std::max(p0, past);
        if (n0 < p1)
        {
            score(in.newIndexKeys, b * S + (n0 - past), dI, p1 - n0, o + n0);
        }
    });

}

// topPositions on a long context, where it was most of a decode step's selection time (SmolLM2 at 8K: ~50 us of a
// layer's ~320): a strided sample of ~1,024 score keys places a threshold a margin below the m-th largest, one pass
// keeps the positions whose key reaches it (in position order) and only those are ranked, so the picks come out
// ascending with no sort. False, with picks untouched, under 2,048 candidates or where the threshold kept fewer than
// m (topPositions then decides): the same positions either way, as any exact top m by rank key is.
bool topPositionsBySample(float const* s, int64_t p0, int64_t n, int64_t m, std::vector<int32_t>& picks)
{
    constexpr int64_t kSamples = 1024;
    int64_t const stride = n / kSamples;
    if (stride < 2)
    {
        return false;
    }
    static thread_local std::vector<uint32_t> sample;
    static thread_local std::vector<uint64_t> kept, ranked;
    int64_t const ns = n / stride;
    sample.resize(static_cast<size_t>(ns));
    for (int64_t i = 0; i < ns; ++i)
    {
        sample[static_cast<size_t>(i)] = scoreKey(s[p0 + i * stride]);
    }
    // the m-th largest falls near rank r of the sample; 1.2 r + 4 sqrt(r) + 8 leaves it above the threshold all but
    // never, and keeps ~2 m positions
    double const r = static_cast<double>(m) * static_cast<double>(ns) / static_cast<double>(n);
    auto const at = std::min<int64_t>(ns - 1, static_cast<int64_t>(1.2 * r + 4 * std::sqrt(r) + 8));
    std::nth_element(sample.begin(), sample.begin() + at, sample.end(), std::greater<uint32_t>());
    uint32_t const threshold = sample[static_cast<size_t>(at)];
    kept.resize(static_cast<size_t>(n));
    uint64_t* c = kept.data();
    int64_t nc = 0;
    for (int64_t j = 0; j < n; ++j)
    {
        uint32_t const u = scoreKey(s[p0 + j]);
        c[nc] = rankKey(u, p0 + j); // written always, counted when kept: no branch to mispredict
        nc += u >= threshold;
    }
    if (nc < m)
    {
        return false;
    }
    ranked.assign(c, c + nc);
    std::nth_element(ranked.begin(), ranked.begin() + (m - 1), ranked.end(), std::greater<uint64_t>());
    uint64_t const last = ranked[static_cast<size_t>(m - 1)];
    for (int64_t j = 0; j < nc; ++j)
    {
        if (c[j] >= last)
        {
            picks.push_back(rankPosition(c[j]));
        }
    }
    return true;
}

// The m positions of [lo, ws) the indexer ranks highest (scores s by position), ascending: every candidate when m
// covers them (no scores were made: section B); a score of -inf or NaN (ranked last) is picked only when too few
// others are left, and is not kept
void indexerPicks(float const* s, int64_t lo, int64_t ws, int64_t m, std::vector<int32_t>& picks)
{
    picks.clear();
    if (m == ws - lo)
    {
        for (int64_t p = lo; p < ws; ++p)
        {
            picks.push_back(static_cast<int32_t>(p));
        }
    }
    else if (m > 0)
    {
        bool const ascending = topPositionsBySample(s, lo, ws - lo, m, picks);
        if (!ascending)
        {
            topPositions(s, lo, ws - lo, m, picks);
        }
        picks.erase(std::remove_if(picks.begin(), picks.end(),
                        [&](int32_t p) { return !(s[p] > -std::numeric_limits<float>::infinity()); }),
            picks.end());
        if (!ascending)
        {
            std::sort(picks.begin(), picks.end());
        }
    }
}

// Query q's selection: the sinks and the window (ranked +inf, all within the budget), then the top (score desc,
// position asc) of the others; positions ascending, -1 padded to k
void selectQuery(AttentionCall const& c, int64_t q)
{
    CachedAttentionDims const& d = c.d;
    CachedAttentionInputs const& in = c.in;
    Scratch& sc = c.sc;
    int64_t const k = c.k, S = d.S, W = in.window;
    static thread_local std::vector<int32_t> picks;
    int64_t const b = q / S, t = static_cast<int64_t>(in.pastLengths[b]) + q % S;
    int64_t const budget = d.sinks + W + queryTopK(d, in, b, t);
    int64_t const kcap = std::min(budget, k);
    int64_t const lo = std::min(d.sinks, t + 1);  // sinks: [0, lo)
    int64_t const ws = std::max(t - W + 1, lo);   // window: [ws, t]; candidates [lo, ws)
    int32_t* sel = c.out.selected + q * k;
    int64_t n = 0;
    int64_t const nf = lo + (t + 1 - ws);
    if (kcap <= nf)
    {
        for (int64_t p = 0; p < lo && n < kcap; ++p)
        {
            sel[n++] = static_cast<int32_t>(p);
        }
        for (int64_t p = ws; p <= t && n < kcap; ++p)
        {
            sel[n++] = static_cast<int32_t>(p);
        }
    }
    else
    {
        float const* s = sc.scores.data() + sc.scoreOff[q];
        int64_t const m = std::min(kcap - nf, ws - lo);
        indexerPicks(s, lo, ws, m, picks);
        for (int64_t p = 0; p < lo; ++p)
        {
            sel[n++] = static_cast<int32_t>(p);
        }
        for (int32_t p : picks)
        {
            sel[n++] = p;
        }
        for (int64_t p = ws; p <= t; ++p)
        {
            sel[n++] = static_cast<int32_t>(p);
        }
    }
    sc.nsel[static_cast<size_t>(q)] = static_cast<int32_t>(n);
    for (int64_t i = n; i < k; ++i)
    {
        sel[i] = -1;
    }
}

// -- C: the selection of every query
bool selectPositions(AttentionCall const& c)
{
    c.sc.nsel.resize(static_cast<size_t>(c.d.B * c.d.S));
    return parallelFor(c.par, c.d.B * c.d.S, [&](int64_t q) { selectQuery(c, q); });
}

// Where a kept position p of sequence b reads its K row and its V (latent, or row); on the pools through
// sc.needIdx, which mapNeed sets for one sequence at a time
inline void rowsOf(AttentionCall const& c, int64_t b, int64_t p, float const** kr, float const** vr)
{
    CachedAttentionInputs const& in = c.in;
    CachedAttentionOutputs const& out = c.out;
    Scratch const& sc = c.sc;
    int64_t const S = c.d.S, N = c.d.N, kvD = c.d.nKV * c.d.D, rv = c.d.rv;
    int64_t const past = in.pastLengths[b], row = in.cacheRows[b], at = b * S + p - past;
    bool const cached = p < past;
    if (in.pool != nullptr)
    {
        int64_t const i = cached ? sc.needIdx[static_cast<size_t>(p)] : -1;
        *kr = cached ? sc.pool.kRow[static_cast<size_t>(i)] : out.newKRows + at * kvD;
        // a call that rebuilds V rows loads no latents here (distinctVRows reads them from the pool)
        *vr = !cached ? in.newLatentV + at * rv : sc.pool.vLatent.empty() ? nullptr : sc.pool.vLatent.data() + i * rv;
        return;
    }
    *kr = cached ? in.kRows + (row * N + p) * kvD : out.newKRows + at * kvD;
    *vr = c.vRows ? (cached ? in.vRows + (row * N + p) * kvD : out.newVRows + at * kvD)
                  : (cached ? in.latentV + (row * N + p) * rv : in.newLatentV + at * rv);
}

// fn(q, b) for the queries q0 .. q1 - 1, each sequence's positions mapped while its queries run
template <class Fn>
void forQueries(AttentionCall const& c, int64_t q0, int64_t q1, Fn&& fn)
{
    int64_t const S = c.d.S;
    for (int64_t q = q0; q < q1;)
    {
        int64_t const b = q / S, qe = std::min(q1, (b + 1) * S);
        if (c.in.pool != nullptr)
        {
            mapNeed(c.sc, b, true);
        }
        for (; q < qe; ++q)
        {
            fn(q, b);
        }
        if (c.in.pool != nullptr)
        {
            mapNeed(c.sc, b, false);
        }
    }
}

// -- D, a prefill over latents: the distinct kept rows of each sequence (a chunk's queries share most of them), U_v c
//       each, into sc.vrows; sc.slot maps (b, position) to its row there
bool distinctVRows(AttentionCall const& c)
{
    Scratch& sc = c.sc;
    int64_t const Q = c.d.B * c.d.S, lmax = c.L, k = c.k, kvD = c.d.nKV * c.d.D, rv = c.d.rv;
    sc.slot.assign(static_cast<size_t>(c.d.B * lmax), -1);
    sc.uniq.clear();
    sc.uniqLatent.clear();
    forQueries(c, 0, Q, [&](int64_t q, int64_t b) {
        int32_t const* sel = c.out.selected + q * k;
        for (int64_t s = 0; s < sc.nsel[q]; ++s)
        {
            int32_t& sl = sc.slot[static_cast<size_t>(b * lmax + sel[s])];
            if (sl < 0)
            {
                float const* kr = nullptr;
                float const* vr = nullptr;
                if (c.in.pool == nullptr || sel[s] >= c.in.pastLengths[b])
                {
                    rowsOf(c, b, sel[s], &kr, &vr);
                }
                sl = static_cast<int32_t>(sc.uniq.size());
                sc.uniq.push_back(b * lmax + sel[s]);
                sc.uniqLatent.push_back(vr); // null: a cached position of the pools, dequantised below
            }
        }
    });
    int64_t const U = static_cast<int64_t>(sc.uniq.size());
    sc.vrows.resize(static_cast<size_t>(U * kvD));
    return parallelFor(c.par, U, [&](int64_t u) {
        float const* lat = sc.uniqLatent[static_cast<size_t>(u)];
        static thread_local std::vector<float> pooled;
        if (lat == nullptr) // the latent straight from the pool: no copy of every distinct row's latent at once
        {
            int64_t const at = sc.uniq[static_cast<size_t>(u)];
            pooled.resize(static_cast<size_t>(rv));
            loadVLatentAt(c.d, c.in, at / lmax, at % lmax, pooled.data());
            lat = pooled.data();
        }
        upMatvec(c.K, c.in, c.in.vUp, 0, lat, kvD, rv, sc.vrows.data() + u * kvD);
    });
}

// -- D, per block of queries q0 .. q1 - 1: the K row and the V (row, or latent) of each kept position, in selection
//       order, into sc.krow and sc.vrow
void gatherBlockRows(AttentionCall const& c, int64_t q0, int64_t q1)
{
    Scratch& sc = c.sc;
    int64_t const k = c.k, lmax = c.L, kvD = c.d.nKV * c.d.D;
    bool const uniqueV = c.uniqueV;
    forQueries(c, q0, q1, [&](int64_t q, int64_t b) {
        int32_t const* sel = c.out.selected + q * k;
        for (int64_t s = 0; s < sc.nsel[q]; ++s)
        {
            float const* kr = nullptr;
            float const* vr = nullptr;
            rowsOf(c, b, sel[s], &kr, &vr);
            sc.krow[(q - q0) * k + s] = kr;
            sc.vrow[(q - q0) * k + s] =
                uniqueV ? sc.vrows.data() + sc.slot[static_cast<size_t>(b * lmax + sel[s])] * kvD : vr;
        }
    });
}

// -- D, per (query, head) of the nq queries from q0: logits, softmax and, over V rows, the weighted sum (one hand-off
//       to the pool); over latents the weights go to sc.pd for latentSumV
bool attendHeads(AttentionCall const& c, int64_t q0, int64_t nq)
{
    Kernels const& K = c.K;
    Scratch& sc = c.sc;
    int64_t const k = c.k, nH = c.d.nH, D = c.d.D, grp = nH / c.d.nKV;
    bool const latentSum = c.latentSum;
    // the graph's constant: np.float32(math.sqrt(D)), divided by last
    float const sqrtD = static_cast<float>(std::sqrt(static_cast<double>(D)));
    return parallelFor(c.par, nq * nH, [&](int64_t i) {
        int64_t const ql = i / nH, q = q0 + ql, h = i % nH, g = h / grp, n = sc.nsel[q];
        float* pr = sc.probs.data() + (ql * nH + h) * k;
        K.logits(sc.qr.data() + (q * nH + h) * D, sc.krow.data() + ql * k, g * D, n, D, sqrtD, pr);
        softmax(pr, n);
        for (int64_t s = 0; latentSum && s < n; ++s)
        {
            sc.pd[(ql * k + s) * nH + h] = static_cast<double>(pr[s]);
        }
        if (!latentSum)
        {
            K.weightedRows(pr, sc.vrow.data() + ql * k, g * D, n, D, c.out.attnOut + (q * nH + h) * D);
        }
    });
}

// -- D over latents, for the nq queries from q0: ctx = sum_s p_s c_s in float64, split over latent columns; then U_v
//       per head
bool latentSumV(AttentionCall const& c, int64_t q0, int64_t nq)
{
    Kernels const& K = c.K;
    Scratch& sc = c.sc;
    int64_t const k = c.k, nH = c.d.nH, D = c.d.D, grp = nH / c.d.nKV, rv = c.d.rv;
    int64_t const chunks = (rv + kCtxChunk - 1) / kCtxChunk;
    bool ok = parallelFor(c.par, nq * chunks, [&](int64_t i) {
        int64_t const ql = i / chunks, i0 = (i % chunks) * kCtxChunk, i1 = std::min(i0 + kCtxChunk, rv);
        K.ctxDecode(sc.pd.data() + ql * k * nH, nH, sc.vrow.data() + ql * k, sc.nsel[q0 + ql], i0, i1,
            sc.ctx.data() + ql * nH * rv, rv);
    });
    return ok && parallelFor(c.small, nq * nH, [&](int64_t i) {
        int64_t const ql = i / nH, q = q0 + ql, h = i % nH, g = h / grp;
        upMatvec(K, c.in, c.in.vUp, g * D, sc.ctx.data() + (ql * nH + h) * rv, D, rv,
            c.out.attnOut + (q * nH + h) * D);
    });
}

// -- E, for the queries q0 .. q1 - 1: the attention mass of the valid rows (j < newLengths[b]) per position, added in
//       query order, and query_mass of the rows logit_rows names
void addMass(AttentionCall const& c, int64_t q0, int64_t q1)
{
    CachedAttentionInputs const& in = c.in;
    CachedAttentionOutputs const& out = c.out;
    Scratch const& sc = c.sc;
    int64_t const S = c.d.S, nH = c.d.nH, k = c.k, L = c.L;
    for (int64_t q = q0; q < q1; ++q)
    {
        int64_t const b = q / S;
        if (q - b * S >= in.newLengths[b])
        {
            continue;
        }
        int32_t const* sel = out.selected + q * k;
        for (int64_t s = 0; s < sc.nsel[q]; ++s)
        {
            float m = 0.f;
            for (int64_t h = 0; h < nH; ++h)
            {
                m += sc.probs[((q - q0) * nH + h) * k + s];
            }
            out.attnMass[b * L + sel[s]] += m;
            for (int64_t i = 0; out.queryMass != nullptr && i < in.J; ++i)
            {
                if (in.massRows[b * in.J + i] == q - b * S)
                {
                    out.queryMass[(b * in.J + i) * L + sel[s]] = m;
                }
            }
        }
    }
}

// -- D and E, kQueryBlock queries at a time: a prefill chunk's weights and row pointers all at once were its largest
//       buffers (512 queries x 9 heads x the 1,057 kept rows of SmolLM2's first layer: 19 MB of weights); per query
//       and head the same sums in the same order, the masses added in query order
bool attendByBlocks(AttentionCall const& c)
{
    Scratch& sc = c.sc;
    int64_t const Q = c.d.B * c.d.S, k = c.k, nH = c.d.nH;
    int64_t const QB = std::min<int64_t>(Q, kQueryBlock);
    sc.krow.resize(static_cast<size_t>(QB * k));
    sc.vrow.resize(static_cast<size_t>(QB * k));
    sc.probs.resize(static_cast<size_t>(QB * nH * k));
    if (c.latentSum)
    {
        sc.pd.resize(static_cast<size_t>(QB * k * nH));
        sc.ctx.resize(static_cast<size_t>(QB * nH * c.d.rv));
    }
    bool ok = true;
    for (int64_t q0 = 0; q0 < Q && ok; q0 += QB)
    {
        int64_t const q1 = std::min(Q, q0 + QB), nq = q1 - q0;
        gatherBlockRows(c, q0, q1);
        ok = attendHeads(c, q0, nq);
        if (c.latentSum)
        {
            ok = ok && latentSumV(c, q0, nq);
        }
        addMass(c, q0, q1);
    }
    return ok;
}

} // namespace

void softmax(float* p, int64_t n)
{
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < n; ++s)
    {
        mx = std::max(mx, p[s]);
    }
    float sum = 0.f;
    for (int64_t s = 0; s < n; ++s)
    {
        p[s] = std::exp(p[s] - mx);
        sum += p[s];
    }
    for (int64_t s = 0; s < n; ++s)
    {
        p[s] /= sum;
    }
}

// rotate-half, each product rounded: the portable graph's Mul, Mul, Sub / Add
void rope(float const* x, float const* c, float const* s, int64_t D, float* out)
{
    int64_t const h = D / 2;
    for (int64_t i = 0; i < h; ++i)
    {
        float const a = x[i] * c[i];
        float const b = x[i + h] * s[i];
        float const a2 = x[i + h] * c[i + h];
        float const b2 = x[i] * s[i + h];
        out[i] = a - b;
        out[i + h] = a2 + b2;
    }
}

// A prefill call's scratch (index scores, weights and row pointers of every query, the rows its selections need: tens
// of MB late in a long prompt) is kept from call to call while calls of many tokens follow each other (every layer
// of every chunk: giving it back after each call made an 8K prefill 20 % slower) and given back by the first call of
// one token (a decode step needs a few hundred KB): without this the process kept the largest chunk's scratch for
// as long as it decoded (SmolLM2 after an 8K prompt: ~30 MiB).
void releasePrefillScratch(Scratch& sc, int64_t S)
{
    constexpr size_t kDecodeFloats = size_t{1} << 18; // more than a decode step's scores (1 MB)
    if (S == 1 && sc.scores.capacity() + sc.probs.capacity() > kDecodeFloats)
    {
        sc = Scratch{};
    }
}

int64_t queryTopK(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b, int64_t t)
{
    int64_t const k = in.topK[b];
    return d.topKDivisor > 0 ? std::max(k, (t + 1) / d.topKDivisor) : k;
}

bool prepareCachedAttention(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t* k, int64_t* L,
    std::string* error)
{
    auto fail = [&](std::string const& m) {
        *error = (in.pool != nullptr ? "GsmPoolAttention: " : "GsmCachedAttention: ") + m;
        return false;
    };
    if (in.window < 0)
    {
        return fail("sparse_window = " + std::to_string(in.window) + " is negative");
    }
    if (d.topKDivisor < 0)
    {
        return fail("attribute sparse_top_k_divisor = " + std::to_string(d.topKDivisor) + " is negative");
    }
    int64_t tc = 0, maxBudget = 0;
    for (int64_t b = 0; b < d.B; ++b)
    {
        std::string const at = "[" + std::to_string(b) + "] = ";
        int64_t const past = in.pastLengths[b];
        if (past < 0)
        {
            return fail("past_lengths" + at + std::to_string(past) + " is negative");
        }
        if (past + d.S > d.N)
        {
            return fail("past_lengths" + at + std::to_string(past) + " + S = " + std::to_string(d.S)
                + " exceeds the cache's N_max " + std::to_string(d.N));
        }
        if (in.newLengths[b] < 0 || in.newLengths[b] > d.S)
        {
            return fail("new_lengths" + at + std::to_string(in.newLengths[b]) + " is outside [0, S = "
                + std::to_string(d.S) + "]");
        }
        if (in.cacheRows[b] < 0 || in.cacheRows[b] >= d.R)
        {
            return fail("cache_rows" + at + std::to_string(in.cacheRows[b]) + " is outside [0, R = "
                + std::to_string(d.R) + ") (the cache buffers' rows)");
        }
        if (in.topK[b] < 0)
        {
            return fail("sparse_top_k" + at + std::to_string(in.topK[b]) + " is negative");
        }
        if (in.pool != nullptr)
        {
            // the call's new rows go to FP16 rows the runtime allocated (engine_io 4.1: tier 0)
            for (int64_t j = 0; j < in.newLengths[b]; ++j)
            {
                int32_t const e = in.pool->slots[b * d.N + past + j];
                if (!slotValid(in.pool->dims, e) || slotTier(e) != kTierFP16)
                {
                    return fail("kv_slots" + std::string("[") + std::to_string(b) + ", " + std::to_string(past + j)
                        + "] = " + std::to_string(e) + " is not an FP16 row of the pool (a new position needs one)");
                }
            }
        }
        tc = std::max(tc, past);
        int64_t const last = past + std::max<int64_t>(d.S - 1, 0);
        maxBudget = std::max(maxBudget, d.sinks + static_cast<int64_t>(in.window) + queryTopK(d, in, b, last));
    }
    *L = tc + d.S;
    *k = d.B == 0 ? 0 : std::min(maxBudget, *L);
    return true;
}

bool runCachedAttention(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t k, int64_t L,
    CachedAttentionOutputs const& out, ParallelRunner const& par, std::string* error)
{
    // the calling thread's scratch, kept between calls; named through a local reference because the worker
    // lambdas would otherwise resolve a thread_local name to their own thread's instance
    static thread_local Scratch callerScratch;
    Scratch& sc = callerScratch;
    releasePrefillScratch(sc, d.S);
    int64_t const Q = d.B * d.S;
    std::memset(out.attnMass, 0, sizeof(float) * static_cast<size_t>(d.B * L));
    if (out.queryMass != nullptr)
    {
        std::memset(out.queryMass, 0, sizeof(float) * static_cast<size_t>(d.B * in.J * L));
    }
    if (Q == 0)
    {
        return true;
    }
    // a decode step's smallest sections (a few mat-vecs) run on the calling thread: a hand-off to parked intra-op
    // threads costs more than they do
    ParallelRunner const serial;
    bool const vRows = in.vRows != nullptr && in.pool == nullptr;
    bool const latentSum = d.S <= kLatentSumQueries && !vRows;
    AttentionCall const c{d, in, out, k, L, cpuKernels(), sc, par, Q == 1 ? serial : par, vRows, latentSum,
        !latentSum && !vRows};
    bool ok = newRowsAndQueryRope(c) && indexScores(c) && selectPositions(c);
    if (ok && in.pool != nullptr && !resolvePoolRows(d, in, k, out, sc, par, !c.uniqueV, error))
    {
        return false;
    }
    ok = ok && (!c.uniqueV || distinctVRows(c)) && attendByBlocks(c);
    if (!ok)
    {
        *error = "GsmCachedAttention: the intra-op thread pool failed";
        return false;
    }
    if (in.pool != nullptr)
    {
        rowCacheInsertNew(d, in, out.newKRows);
        poolWriteNew(d, in);
    }
    return true;
}

} // namespace ortcpu
} // namespace gsm
