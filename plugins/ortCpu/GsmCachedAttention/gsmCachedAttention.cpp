// GsmCachedAttention: orchestration (validation, phases, selection); the hot loops are ../kernels/gsmOrtKernels.h's.
// Compiled without FMA contraction: RoPE and the softmax then round as the portable graph's separate ops do.
#include "gsmCachedAttention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../kernels/gsmOrtKernels.h"

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
// ONNX TopK's order. Branch-free on the sign, which is a coin toss for an indexer whose head weights differ in sign.
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
constexpr int64_t kQueryBlock = 64; // queries whose attention weights are held at once (section D)
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

// p = softmax(p) over n logits in place: max, exp of the differences, divided by their float32 sum in order
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

// The row cache of sequence b's pool row for this call: every selected cached position gets a K row (a hit, or a
// job that makes it in a slot or, the cache being full of rows this call reads, in the overflow); returns the
// jobs appended. positions [i0, i1) of pc.need are b's.
void rowCacheLookup(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b, int64_t i0, int64_t i1,
    Scratch& sc, std::vector<RowJob>& jobs, int64_t* overflowRows)
{
    PoolSource const& ps = *in.pool;
    PoolCall& pc = sc.pool;
    int64_t const C = ps.capacity, kvD = d.nKV * d.D, row = in.cacheRows[b];
    int32_t const past = in.pastLengths[b], now = past + static_cast<int32_t>(d.S);
    int32_t* pos = ps.cacheTags + row * kTagRows * C;
    int32_t* ent = pos + C;
    int32_t* used = pos + 2 * C;
    float* rows = ps.cacheRows + row * C * kvD;
    int32_t const* slots = ps.slots + b * d.N;
    static thread_local std::vector<int32_t> victims, candidates, misses;
    victims.clear();
    candidates.clear();
    misses.clear();
    for (int64_t c = 0; c < C; ++c)
    {
        if (pos[c] >= past) // written again since (a rollback, or another sequence in this row): not a row of ours
        {
            pos[c] = -1;
        }
        if (pos[c] >= 0)
        {
            sc.slotOf[static_cast<size_t>(pos[c])] = static_cast<int32_t>(c);
        }
    }
    size_t const first = jobs.size();
    for (int64_t i = i0; i < i1; ++i)
    {
        int32_t const p = pc.need[static_cast<size_t>(i)], e = slots[p];
        int32_t const c = sc.slotOf[static_cast<size_t>(p)];
        if (c >= 0)
        {
            pc.kRow[static_cast<size_t>(i)] = rows + c * kvD;
            if (ent[c] != e) // re-encoded by a re-tier pass, or moved: made again from the row held now
            {
                ent[c] = e;
                jobs.push_back({i, b, p, e, rows + c * kvD, -1});
            }
            used[c] = now;
        }
        else
        {
            misses.push_back(static_cast<int32_t>(i));
        }
    }
    for (int64_t c = 0; c < C; ++c)
    {
        if (pos[c] < 0)
        {
            victims.push_back(static_cast<int32_t>(c));
        }
        else if (used[c] != now)
        {
            candidates.push_back(static_cast<int32_t>(c));
        }
        else
        {
            sc.slotOf[static_cast<size_t>(pos[c])] = -1;
        }
    }
    size_t const want = misses.size() > victims.size() ? misses.size() - victims.size() : 0;
    if (want > 0)
    {
        // least recently read first (ties to the lower slot, so a run is reproducible)
        auto older = [&](int32_t a, int32_t c) { return used[a] != used[c] ? used[a] < used[c] : a < c; };
        size_t const take = std::min(want, candidates.size());
        std::partial_sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(take), candidates.end(),
            older);
        victims.insert(victims.end(), candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(take));
    }
    for (int32_t c : candidates)
    {
        sc.slotOf[static_cast<size_t>(pos[c])] = -1;
    }
    for (size_t m = 0; m < misses.size(); ++m)
    {
        int64_t const i = misses[m];
        int32_t const p = pc.need[static_cast<size_t>(i)], e = slots[p];
        if (m < victims.size())
        {
            int32_t const c = victims[m];
            pos[c] = p;
            ent[c] = e;
            used[c] = now;
            pc.kRow[static_cast<size_t>(i)] = rows + c * kvD;
            jobs.push_back({i, b, p, e, rows + c * kvD, -1});
        }
        else
        {
            jobs.push_back({i, b, p, e, nullptr, (*overflowRows)++});
            pc.kRow[static_cast<size_t>(i)] = nullptr; // set once the overflow buffer has its size
        }
    }
    if (ps.misses != nullptr)
    {
        ps.misses[b] = static_cast<int32_t>(jobs.size() - first);
    }
}

// An empty list of needed positions for B sequences, and position maps for N positions (all -1 between calls).
void startNeed(Scratch& sc, int64_t N, int64_t B)
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
void mapNeed(Scratch& sc, int64_t b, bool on)
{
    PoolCall const& pc = sc.pool;
    for (int64_t i = pc.needOff[b]; i < pc.needOff[b + 1]; ++i)
    {
        sc.needIdx[static_cast<size_t>(pc.need[static_cast<size_t>(i)])] = on ? static_cast<int32_t>(i) : -1;
    }
}

// Every sequence's lookup (sc.pool.need, grouped by sequence): sc.pool.kRow points at each needed row's K row (a
// slot of the row cache, or the overflow) and the returned jobs say which of them to make. The list is the calling thread's,
// returned by reference: in the workers' lambdas a thread_local name would be the worker's own (empty) instance.
std::vector<RowJob>& rowCacheJobs(CachedAttentionDims const& d, CachedAttentionInputs const& in, Scratch& sc)
{
    PoolCall& pc = sc.pool;
    int64_t const kvD = d.nKV * d.D;
    static thread_local std::vector<RowJob> callerJobs;
    std::vector<RowJob>& jobs = callerJobs;
    jobs.clear();
    pc.kRow.assign(pc.need.size(), nullptr);
    int64_t overflowRows = 0;
    for (int64_t b = 0; b < d.B; ++b)
    {
        rowCacheLookup(d, in, b, pc.needOff[b], pc.needOff[b + 1], sc, jobs, &overflowRows);
    }
    pc.overflow.resize(static_cast<size_t>(overflowRows * kvD));
    for (RowJob& j : jobs)
    {
        if (j.overflow >= 0)
        {
            j.dst = pc.overflow.data() + j.overflow * kvD;
        }
    }
    // the overflow rows' pointers, in need order (rowCacheLookup left them null)
    for (size_t i = 0, o = 0; i < pc.kRow.size(); ++i)
    {
        if (pc.kRow[i] == nullptr)
        {
            pc.kRow[i] = pc.overflow.data() + static_cast<int64_t>(o++) * kvD;
        }
    }
    return jobs;
}

// The call's new K rows (section A) into the row cache of each sequence, newest first, in slots this call did not
// read: the next step's window reads them.
void rowCacheInsertNew(CachedAttentionDims const& d, CachedAttentionInputs const& in, float const* newKRows)
{
    PoolSource const& ps = *in.pool;
    int64_t const C = ps.capacity, kvD = d.nKV * d.D;
    static thread_local std::vector<int32_t> vacant;
    for (int64_t b = 0; b < d.B; ++b)
    {
        int64_t const row = in.cacheRows[b];
        int32_t const past = in.pastLengths[b], now = past + static_cast<int32_t>(d.S);
        int32_t* pos = ps.cacheTags + row * kTagRows * C;
        int32_t* ent = pos + C;
        int32_t* used = pos + 2 * C;
        vacant.clear();
        for (int64_t c = 0; c < C; ++c)
        {
            if (pos[c] < 0 || used[c] != now)
            {
                vacant.push_back(static_cast<int32_t>(c));
            }
        }
        auto older = [&](int32_t a, int32_t c) {
            bool const fa = pos[a] < 0, fc = pos[c] < 0;
            return fa != fc ? fa : (used[a] != used[c] ? used[a] < used[c] : a < c);
        };
        int64_t const n = std::min<int64_t>(in.newLengths[b], static_cast<int64_t>(vacant.size()));
        std::partial_sort(vacant.begin(), vacant.begin() + n, vacant.end(), older);
        for (int64_t m = 0; m < n; ++m)
        {
            int64_t const j = in.newLengths[b] - 1 - m;
            int32_t const c = vacant[static_cast<size_t>(m)];
            pos[c] = past + static_cast<int32_t>(j);
            ent[c] = ps.slots[b * d.N + past + j];
            used[c] = now;
            std::memcpy(ps.cacheRows + (row * C + c) * kvD, newKRows + (b * d.S + j) * kvD,
                sizeof(float) * static_cast<size_t>(kvD));
        }
    }
}

// The call's new latent rows (FP16, the values GsmSideSplit rounded) and indexer keys into the pools, as
// GsmKVCacheUpdate writes them; prepareCachedAttention checked every entry.
void poolWriteNew(CachedAttentionDims const& d, CachedAttentionInputs const& in)
{
    PoolSource const& ps = *in.pool;
    int64_t const keyBytes = in.int8Keys ? 1 : 2;
    for (int64_t b = 0; b < d.B; ++b)
    {
        int64_t const row = in.cacheRows[b], past = in.pastLengths[b];
        for (int64_t j = 0; j < in.newLengths[b]; ++j)
        {
            int64_t const q = b * d.S + j, p = past + j;
            uint8_t* dst = ps.pool + row * ps.poolBytes + rowOffset(ps.dims, slotRow(ps.slots[b * d.N + p]));
            for (int64_t c = 0; c < d.rk; ++c)
            {
                storeFP16(dst, static_cast<int32_t>(c), in.newLatentK[q * d.rk + c]);
            }
            for (int64_t c = 0; c < d.rv; ++c)
            {
                storeFP16(dst, static_cast<int32_t>(d.rk + c), in.newLatentV[q * d.rv + c]);
            }
            std::memcpy(static_cast<uint8_t*>(ps.indexKeys) + (row * d.N + p) * in.keyStride * keyBytes,
                static_cast<uint8_t const*>(in.newIndexKeys) + q * d.dI * keyBytes,
                static_cast<size_t>(d.dI * keyBytes));
        }
    }
}

// GsmPoolAttention, before the attention: the cached positions each sequence's queries select (need), their K rows
// from the row cache or made from the pool (U_k c_k, RoPE), and their V latents dequantised from the pool.
bool resolvePoolRows(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t k,
    CachedAttentionOutputs const& out, Scratch& sc, ParallelRunner const& par, std::string* error)
{
    PoolSource const& ps = *in.pool;
    PoolCall& pc = sc.pool;
    int64_t const B = d.B, S = d.S, N = d.N, D = d.D, nKV = d.nKV, kvD = nKV * D, rk = d.rk, rv = d.rv;
    startNeed(sc, N, B);
    static thread_local std::vector<uint8_t> mark;
    for (int64_t b = 0; b < B; ++b)
    {
        int64_t const past = in.pastLengths[b];
        size_t const start = pc.need.size();
        if (S == 1) // one query: its selection is ascending
        {
            int32_t const* sel = out.selected + b * k;
            for (int64_t s = 0; s < sc.nsel[b] && sel[s] < past; ++s)
            {
                pc.need.push_back(sel[s]);
            }
        }
        else
        {
            mark.assign(static_cast<size_t>(past), 0);
            for (int64_t q = b * S; q < (b + 1) * S; ++q)
            {
                int32_t const* sel = out.selected + q * k;
                for (int64_t s = 0; s < sc.nsel[q] && sel[s] < past; ++s)
                {
                    mark[static_cast<size_t>(sel[s])] = 1;
                }
            }
            for (int64_t p = 0; p < past; ++p)
            {
                if (mark[static_cast<size_t>(p)])
                {
                    pc.need.push_back(static_cast<int32_t>(p));
                }
            }
        }
        for (size_t i = start; i < pc.need.size(); ++i)
        {
            int32_t const e = ps.slots[b * N + pc.need[i]];
            if (!slotValid(ps.dims, e))
            {
                *error = "GsmPoolAttention: kv_slots[" + std::to_string(b) + ", " + std::to_string(pc.need[i])
                    + "] = " + std::to_string(e) + " is not a row of the pool (a cached position needs one)";
                return false;
            }
        }
        pc.needOff[static_cast<size_t>(b + 1)] = static_cast<int64_t>(pc.need.size());
    }
    std::vector<RowJob>& jobs = rowCacheJobs(d, in, sc);
    Kernels const& K = cpuKernels();
    // float16 U_k widened once for the call's rows (matvecHalf widens it per row; the sums are the same, bit for bit)
    static thread_local std::vector<float> callerUk;
    std::vector<float>& uk = callerUk;
    float const* ukf = static_cast<float const*>(in.kUp);
    if (in.halfUp && !jobs.empty())
    {
        uk.resize(static_cast<size_t>(kvD * rk));
        K.halfToFloat(static_cast<uint16_t const*>(in.kUp), kvD * rk, uk.data());
        ukf = uk.data();
    }
    // one pass over the intra-op threads (each hand-off costs a wake-up per thread): blocks of K rows to make (their
    // latents dequantised, U_k times four of them at a time, then RoPE) and blocks of V latents to dequantise
    constexpr int64_t kJobBlock = 16;
    constexpr int64_t kVBlock = 64;
    int64_t const nJobs = static_cast<int64_t>(jobs.size());
    int64_t const n = static_cast<int64_t>(pc.need.size());
    pc.vLatent.resize(static_cast<size_t>(n * rv));
    int64_t const kTasks = (nJobs + kJobBlock - 1) / kJobBlock, vTasks = (n + kVBlock - 1) / kVBlock;
    auto task = [&](int64_t t) {
        if (t >= kTasks)
        {
            int64_t const i0 = (t - kTasks) * kVBlock, i1 = std::min(n, i0 + kVBlock);
            int64_t b = std::upper_bound(pc.needOff.begin(), pc.needOff.end(), i0) - pc.needOff.begin() - 1;
            for (int64_t i = i0; i < i1; ++i)
            {
                while (pc.needOff[static_cast<size_t>(b) + 1] <= i) // the sequence of need entry i
                {
                    ++b;
                }
                int32_t const e = ps.slots[b * N + pc.need[static_cast<size_t>(i)]];
                loadLatents(ps.dims, ps.pool + in.cacheRows[b] * ps.poolBytes, e, ps.quant, static_cast<int32_t>(rk),
                    static_cast<int32_t>(rv), pc.vLatent.data() + i * rv);
            }
            return;
        }
        int64_t const j0 = t * kJobBlock, m = std::min(kJobBlock, nJobs - j0);
        static thread_local std::vector<float> ck, kr;
        ck.resize(static_cast<size_t>(kJobBlock * rk));
        kr.resize(static_cast<size_t>(kJobBlock * kvD));
        float const* xs[kJobBlock];
        float* ys[kJobBlock];
        for (int64_t i = 0; i < m; ++i)
        {
            RowJob const& j = jobs[static_cast<size_t>(j0 + i)];
            loadLatents(ps.dims, ps.pool + in.cacheRows[j.b] * ps.poolBytes, j.entry, ps.quant, 0,
                static_cast<int32_t>(rk), ck.data() + i * rk);
            xs[i] = ck.data() + i * rk;
            ys[i] = kr.data() + i * kvD;
        }
        if (D % 4 == 0)
        {
            K.matvecs(ukf, kvD, rk, xs, m, ys);
        }
        else // section A makes a head's rows in blocks of four from its first row: the same blocks here
        {
            float* yg[kJobBlock];
            for (int64_t g = 0; g < nKV; ++g)
            {
                for (int64_t i = 0; i < m; ++i)
                {
                    yg[i] = ys[i] + g * D;
                }
                K.matvecs(ukf + g * D * rk, D, rk, xs, m, yg);
            }
        }
        for (int64_t i = 0; i < m; ++i)
        {
            RowJob const& j = jobs[static_cast<size_t>(j0 + i)];
            for (int64_t g = 0; g < nKV; ++g)
            {
                rope(ys[i] + g * D, in.ropeCos + j.position * D, in.ropeSin + j.position * D, D, j.dst + g * D);
            }
        }
    };
    bool ok = parallelFor(par, kTasks + vTasks, task);
    if (!ok)
    {
        *error = "GsmPoolAttention: the intra-op thread pool failed";
    }
    return ok;
}

} // namespace

void loadLatents(GsmDims const& d, uint8_t const* poolRow, int32_t entry, float const* quant, int32_t c0, int32_t n,
    float* out)
{
    QuantView const qv{quant, latentRank(d)};
    uint8_t const* row = poolRow + rowOffset(d, slotRow(entry));
    int32_t const tier = slotTier(entry);
    // one loop per tier (loadLatent's per-value branches, hoisted): the same values, bit for bit
    if (tier == kTierFP16)
    {
        uint16_t h[256];
        for (int32_t i0 = 0; i0 < n; i0 += 256)
        {
            int32_t const m = n - i0 < 256 ? n - i0 : 256;
            std::memcpy(h, row + 2 * static_cast<size_t>(c0 + i0), 2 * static_cast<size_t>(m)); // little-endian
            cpuKernels().halfToFloat(h, m, out + i0);
        }
        return;
    }
    if (tier == kTierINT8)
    {
        int8_t const* q = reinterpret_cast<int8_t const*>(row) + c0;
        float const* s8 = quant + latentRank(d) + c0;
        float const* comp8 = quant + 2 * static_cast<int64_t>(latentRank(d)) + c0;
        cpuKernels().dequantInt8(q, s8, comp8, n, out); // dequantINT8 per value
        return;
    }
    if (tier == kTierINT4 && (c0 == 0 || c0 == d.rankK) && n <= (c0 == 0 ? d.rankK : d.rankV))
    {
        // one part (k or v) from its first code: the nibbles of each byte, low first, sign-extended
        uint8_t const* packed = row + (c0 == 0 ? 0 : packedINT4Bytes(d.rankK));
        float const* s4 = quant + 3 * static_cast<int64_t>(latentRank(d)) + c0;
        float const* comp4 = quant + 4 * static_cast<int64_t>(latentRank(d)) + c0;
        cpuKernels().dequantInt4(packed, s4, comp4, n, out); // dequantINT4 per value
        return;
    }
    for (int32_t i = 0; i < n; ++i)
    {
        out[i] = loadLatent(d, row, tier, qv, c0 + i);
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
    Kernels const& K = cpuKernels();
    // the calling thread's scratch, kept between calls; named through a local reference because the worker
    // lambdas would otherwise resolve a thread_local name to their own thread's instance
    static thread_local Scratch callerScratch;
    Scratch& sc = callerScratch;
    releasePrefillScratch(sc, d.S);
    int64_t const B = d.B, S = d.S, Q = B * S, nH = d.nH, nKV = d.nKV, D = d.D, grp = nH / nKV, kvD = nKV * D;
    int64_t const nI = d.nI, dI = d.dI, rk = d.rk, rv = d.rv, N = d.N, W = in.window;
    // the graph's constants: np.float32(math.sqrt(n)), divided by last
    float const sqrtD = static_cast<float>(std::sqrt(static_cast<double>(D)));
    float const sqrtDI = static_cast<float>(std::sqrt(static_cast<double>(dI)));
    bool ok = true;
    // V from cached rows (U_v c made once per row, new ones in section A) instead of the latents: a decode step's
    // weighted sum is then nH*K*D float32 multiply-adds instead of nH*K*rv float64 ones and nH*D*rv for U_v
    bool const vRows = in.vRows != nullptr && in.pool == nullptr;
    int64_t const keyStride = in.keyStride > 0 ? in.keyStride : dI;

    std::memset(out.attnMass, 0, sizeof(float) * static_cast<size_t>(B * L));
    if (out.queryMass != nullptr)
    {
        std::memset(out.queryMass, 0, sizeof(float) * static_cast<size_t>(B * in.J * L));
    }
    if (Q == 0)
    {
        return true;
    }
    auto qb = [&](int64_t q) { return q / S; };
    auto qpos = [&](int64_t q) { return static_cast<int64_t>(in.pastLengths[q / S]) + q % S; };

    // a decode step's smallest sections (a few mat-vecs) run on the calling thread: a hand-off to parked intra-op
    // threads costs more than they do
    ParallelRunner const serial;
    ParallelRunner const& small = Q == 1 ? serial : par;

    // -- A: the call's K rows (U_k c, RoPE) and the queries' RoPE, per (row, key head) -------------------------
    sc.qr.resize(static_cast<size_t>(Q * nH * D));
    ok = ok && parallelFor(small, Q * nKV, [&](int64_t i) {
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

    // -- B: index scores of every causal position of each query, by position, in blocks; only for the queries
    //       whose budget leaves the indexer a choice (section C's tests): a streaming layer (top-k 0), a query
    //       within sinks + window, and one whose budget covers every position (spec 4.1: then Sel(t) is every
    //       s <= t, as in a short context) skip the scan of every cached key ----------------------------------
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
    ok = ok && parallelFor(par, sc.blockStart[Q], [&](int64_t i) {
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

    // -- C: selection per query: the sinks and the window (ranked +inf, all within the budget), then the
    //       top (score desc, position asc) of the others; positions ascending, -1 padded to k -----------------
    sc.nsel.resize(static_cast<size_t>(Q));
    ok = ok && parallelFor(par, Q, [&](int64_t q) {
        static thread_local std::vector<int32_t> picks;
        int64_t const b = qb(q), t = qpos(q);
        int64_t const budget = d.sinks + W + queryTopK(d, in, b, t);
        int64_t const kcap = std::min(budget, k);
        int64_t const lo = std::min(d.sinks, t + 1);  // sinks: [0, lo)
        int64_t const ws = std::max(t - W + 1, lo);   // window: [ws, t]; candidates [lo, ws)
        int32_t* sel = out.selected + q * k;
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
            picks.clear();
            if (m == ws - lo)  // every candidate (no scores were made: section B)
            {
                for (int64_t p = lo; p < ws; ++p)
                {
                    picks.push_back(static_cast<int32_t>(p));
                }
            }
            else if (m > 0)
            {
                topPositions(s, lo, ws - lo, m, picks);
                // a score of -inf or NaN (ranked last) is picked only when too few others are left, and is not kept
                picks.erase(std::remove_if(picks.begin(), picks.end(),
                                [&](int32_t p) { return !(s[p] > -std::numeric_limits<float>::infinity()); }),
                    picks.end());
                std::sort(picks.begin(), picks.end());
            }
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
    });
    if (!ok)
    {
        *error = "GsmCachedAttention: the intra-op thread pool failed";
        return false;
    }

    // -- D: attention over the kept positions, and E: attention mass of the valid rows, per position ------------
    //       The weights and row pointers are made for kQueryBlock queries at a time: a prefill chunk's, all at
    //       once, were its largest buffers (512 queries x 9 heads x the 1,057 kept rows of SmolLM2's first layer:
    //       19 MB of weights); per query and head the same sums in the same order, the masses added in query order.
    if (in.pool != nullptr && !resolvePoolRows(d, in, k, out, sc, par, error))
    {
        return false;
    }
    bool const latentSum = S <= kLatentSumQueries && !vRows;
    bool const uniqueV = !latentSum && !vRows; // a prefill over latents: V = U_v c once per distinct kept row
    // where a kept position p of sequence b reads its K row and its V (latent, or row); on the pools through
    // sc.needIdx, which mapNeed sets for one sequence at a time
    auto rowsOf = [&](int64_t b, int64_t p, float const** kr, float const** vr) {
        int64_t const past = in.pastLengths[b], row = in.cacheRows[b], at = b * S + p - past;
        bool const cached = p < past;
        if (in.pool != nullptr)
        {
            int64_t const i = cached ? sc.needIdx[static_cast<size_t>(p)] : -1;
            *kr = cached ? sc.pool.kRow[static_cast<size_t>(i)] : out.newKRows + at * kvD;
            *vr = cached ? sc.pool.vLatent.data() + i * rv : in.newLatentV + at * rv;
            return;
        }
        *kr = cached ? in.kRows + (row * N + p) * kvD : out.newKRows + at * kvD;
        *vr = vRows ? (cached ? in.vRows + (row * N + p) * kvD : out.newVRows + at * kvD)
                    : (cached ? in.latentV + (row * N + p) * rv : in.newLatentV + at * rv);
    };
    // fn(q, b) for the queries q0 .. q1 - 1, each sequence's positions mapped while its queries run
    auto forQueries = [&](int64_t q0, int64_t q1, auto&& fn) {
        for (int64_t q = q0; q < q1;)
        {
            int64_t const b = qb(q), qe = std::min(q1, (b + 1) * S);
            if (in.pool != nullptr)
            {
                mapNeed(sc, b, true);
            }
            for (; q < qe; ++q)
            {
                fn(q, b);
            }
            if (in.pool != nullptr)
            {
                mapNeed(sc, b, false);
            }
        }
    };
    int64_t const lmax = L;
    if (uniqueV) // the distinct kept rows of each sequence (a chunk's queries share most of them), U_v c each
    {
        sc.slot.assign(static_cast<size_t>(B * lmax), -1);
        sc.uniq.clear();
        sc.uniqLatent.clear();
        forQueries(0, Q, [&](int64_t q, int64_t b) {
            int32_t const* sel = out.selected + q * k;
            for (int64_t s = 0; s < sc.nsel[q]; ++s)
            {
                int32_t& sl = sc.slot[static_cast<size_t>(b * lmax + sel[s])];
                if (sl < 0)
                {
                    float const* kr = nullptr;
                    float const* vr = nullptr;
                    rowsOf(b, sel[s], &kr, &vr);
                    sl = static_cast<int32_t>(sc.uniq.size());
                    sc.uniq.push_back(b * lmax + sel[s]);
                    sc.uniqLatent.push_back(vr);
                }
            }
        });
        int64_t const U = static_cast<int64_t>(sc.uniq.size());
        sc.vrows.resize(static_cast<size_t>(U * kvD));
        ok = ok && parallelFor(par, U, [&](int64_t u) {
            upMatvec(K, in, in.vUp, 0, sc.uniqLatent[static_cast<size_t>(u)], kvD, rv, sc.vrows.data() + u * kvD);
        });
    }
    int64_t const QB = std::min<int64_t>(Q, kQueryBlock);
    sc.krow.resize(static_cast<size_t>(QB * k));
    sc.vrow.resize(static_cast<size_t>(QB * k));
    sc.probs.resize(static_cast<size_t>(QB * nH * k));
    if (latentSum)
    {
        sc.pd.resize(static_cast<size_t>(QB * k * nH));
        sc.ctx.resize(static_cast<size_t>(QB * nH * rv));
    }
    for (int64_t q0 = 0; q0 < Q && ok; q0 += QB)
    {
        int64_t const q1 = std::min(Q, q0 + QB), nq = q1 - q0;
        forQueries(q0, q1, [&](int64_t q, int64_t b) {
            int32_t const* sel = out.selected + q * k;
            for (int64_t s = 0; s < sc.nsel[q]; ++s)
            {
                float const* kr = nullptr;
                float const* vr = nullptr;
                rowsOf(b, sel[s], &kr, &vr);
                sc.krow[(q - q0) * k + s] = kr;
                sc.vrow[(q - q0) * k + s] =
                    uniqueV ? sc.vrows.data() + sc.slot[static_cast<size_t>(b * lmax + sel[s])] * kvD : vr;
            }
        });
        // per (query, head): logits, softmax and, over V rows, the weighted sum (one hand-off to the pool)
        ok = ok && parallelFor(par, nq * nH, [&](int64_t i) {
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
                K.weightedRows(pr, sc.vrow.data() + ql * k, g * D, n, D, out.attnOut + (q * nH + h) * D);
            }
        });
        if (latentSum)
        {
            // ctx = sum_s p_s c_s in float64 over the latents, split over latent columns; then U_v per head
            int64_t const chunks = (rv + kCtxChunk - 1) / kCtxChunk;
            ok = ok && parallelFor(par, nq * chunks, [&](int64_t i) {
                int64_t const ql = i / chunks, i0 = (i % chunks) * kCtxChunk, i1 = std::min(i0 + kCtxChunk, rv);
                K.ctxDecode(sc.pd.data() + ql * k * nH, nH, sc.vrow.data() + ql * k, sc.nsel[q0 + ql], i0, i1,
                    sc.ctx.data() + ql * nH * rv, rv);
            });
            ok = ok && parallelFor(small, nq * nH, [&](int64_t i) {
                int64_t const ql = i / nH, q = q0 + ql, h = i % nH, g = h / grp;
                upMatvec(K, in, in.vUp, g * D, sc.ctx.data() + (ql * nH + h) * rv, D, rv,
                    out.attnOut + (q * nH + h) * D);
            });
        }
        for (int64_t q = q0; q < q1; ++q) // E, for the valid rows (j < newLengths[b]) in query order
        {
            int64_t const b = qb(q);
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

bool runPoolSharedAttention(CachedAttentionDims const& d, SharedAttentionInputs const& sin, float* attnOut,
    ParallelRunner const& par, std::string* error)
{
    Kernels const& K = cpuKernels();
    static thread_local Scratch callerScratch;
    Scratch& sc = callerScratch;
    releasePrefillScratch(sc, d.S);
    PoolSource const& ps = *sin.pool;
    int64_t const B = d.B, S = d.S, N = d.N, nH = d.nH, nKV = d.nKV, D = d.D, grp = nH / nKV, kvD = nKV * D;
    int64_t const r = d.rk + d.rv, k = sin.k;
    float const sqrtD = static_cast<float>(std::sqrt(static_cast<double>(D)));
    auto fail = [&](std::string const& m) {
        *error = "GsmPoolSharedAttention: " + m;
        return false;
    };
    // the row-cache lookup reads these of a CachedAttentionInputs
    CachedAttentionInputs in;
    in.pool = sin.pool;
    in.cacheRows = sin.cacheRows;
    in.pastLengths = sin.pastLengths;
    PoolCall& pc = sc.pool;
    startNeed(sc, N, B);
    static thread_local std::vector<uint8_t> mark;
    for (int64_t b = 0; b < B; ++b)
    {
        int64_t const past = sin.pastLengths[b], n = sin.newLengths[b], row = sin.cacheRows[b];
        std::string const at = "[" + std::to_string(b) + "] = ";
        if (past < 0 || past + S > N || n < 0 || n > S)
        {
            return fail("past_lengths" + at + std::to_string(past) + ", new_lengths" + at + std::to_string(n)
                + ": need 0 <= past, past + S <= N_max = " + std::to_string(N) + ", 0 <= new <= S = "
                + std::to_string(S));
        }
        if (row < 0 || row >= d.R)
        {
            return fail("cache_rows" + at + std::to_string(row) + " is outside [0, R = " + std::to_string(d.R) + ")");
        }
        mark.assign(static_cast<size_t>(past + n), 0);
        for (int64_t j = 0; j < n; ++j)
        {
            int32_t const* sel = sin.selected + (b * S + j) * k;
            for (int64_t s = 0; s < k && sel[s] >= 0; ++s)
            {
                if (sel[s] > past + j)
                {
                    return fail("selected[" + std::to_string(b) + ", " + std::to_string(j) + "] holds position "
                        + std::to_string(sel[s]) + ", past the query's own " + std::to_string(past + j));
                }
                mark[static_cast<size_t>(sel[s])] = 1;
            }
        }
        for (int64_t p = 0; p < past + n; ++p)
        {
            if (mark[static_cast<size_t>(p)])
            {
                int32_t const e = ps.slots[b * N + p];
                if (!slotValid(ps.dims, e))
                {
                    return fail("kv_slots[" + std::to_string(b) + ", " + std::to_string(p) + "] = " + std::to_string(e)
                        + " is not a row of the pool (a selected position needs one)");
                }
                pc.need.push_back(static_cast<int32_t>(p));
            }
        }
        pc.needOff[static_cast<size_t>(b + 1)] = static_cast<int64_t>(pc.need.size());
    }
    // K rows (a selected position at or past `past` is the call's own, written by the source: a miss, then kept)
    std::vector<RowJob>& jobs = rowCacheJobs(d, in, sc);
    // per needed position, its latent dequantised once: V = W_v c + b_v (this call's rows only), and where the row
    // cache lacks its K row, K = RoPE(W_k c + b_k) into the slot the lookup chose
    int64_t const n = static_cast<int64_t>(pc.need.size());
    sc.vrows.resize(static_cast<size_t>(n * kvD));
    static thread_local std::vector<int64_t> callerJobOf;
    std::vector<int64_t>& jobOf = callerJobOf;
    jobOf.assign(static_cast<size_t>(n), -1);
    for (size_t j = 0; j < jobs.size(); ++j)
    {
        jobOf[static_cast<size_t>(jobs[j].need)] = static_cast<int64_t>(j);
    }
    auto project = [&](float const* c, int64_t half, float* dst) {
        K.matvec(sin.projW + half * kvD * r, c, kvD, r, dst);
        for (int64_t i = 0; i < kvD; ++i)
        {
            dst[i] += sin.projB[half * kvD + i];
        }
    };
    bool ok = parallelFor(par, n, [&](int64_t i) {
        int64_t const b = std::upper_bound(pc.needOff.begin(), pc.needOff.end(), i) - pc.needOff.begin() - 1;
        int32_t const p = pc.need[static_cast<size_t>(i)];
        static thread_local std::vector<float> c, t;
        c.resize(static_cast<size_t>(r));
        loadLatents(ps.dims, ps.pool + sin.cacheRows[b] * ps.poolBytes, ps.slots[b * N + p], ps.quant, 0,
            static_cast<int32_t>(r), c.data());
        project(c.data(), 1, sc.vrows.data() + i * kvD);
        int64_t const j = jobOf[static_cast<size_t>(i)];
        if (j >= 0)
        {
            t.resize(static_cast<size_t>(kvD));
            project(c.data(), 0, t.data());
            float* dst = jobs[static_cast<size_t>(j)].dst;
            for (int64_t g = 0; g < nKV; ++g)
            {
                rope(t.data() + g * D, sin.ropeCos + p * D, sin.ropeSin + p * D, D, dst + g * D);
            }
        }
    });
    // per (query, head): RoPE of q, logits over the selection, softmax, weighted V rows
    int64_t const Q = B * S;
    sc.krow.resize(static_cast<size_t>(Q * k));
    sc.vrow.resize(static_cast<size_t>(Q * k));
    sc.nsel.assign(static_cast<size_t>(Q), 0);
    for (int64_t b = 0; b < B; ++b)
    {
        mapNeed(sc, b, true);
        for (int64_t j = 0; j < sin.newLengths[b]; ++j)
        {
            int64_t const q = b * S + j;
            int32_t const* sel = sin.selected + q * k;
            int64_t s = 0;
            for (; s < k && sel[s] >= 0; ++s)
            {
                int32_t const i = sc.needIdx[static_cast<size_t>(sel[s])];
                sc.krow[q * k + s] = pc.kRow[static_cast<size_t>(i)];
                sc.vrow[q * k + s] = sc.vrows.data() + i * kvD;
            }
            sc.nsel[static_cast<size_t>(q)] = static_cast<int32_t>(s);
        }
        mapNeed(sc, b, false);
    }
    sc.probs.resize(static_cast<size_t>(Q * nH * k));
    ok = ok && parallelFor(par, Q * nH, [&](int64_t i) {
        int64_t const q = i / nH, h = i % nH, g = h / grp, nsel = sc.nsel[static_cast<size_t>(q)];
        float* o = attnOut + (q * nH + h) * D;
        if (nsel == 0) // a padding row
        {
            std::fill(o, o + D, 0.f);
            return;
        }
        int64_t const t = sin.pastLengths[q / S] + q % S;
        static thread_local std::vector<float> qh;
        qh.resize(static_cast<size_t>(D));
        rope(sin.q + (q * nH + h) * D, sin.ropeCos + t * D, sin.ropeSin + t * D, D, qh.data());
        float* pr = sc.probs.data() + (q * nH + h) * k;
        K.logits(qh.data(), sc.krow.data() + q * k, g * D, nsel, D, sqrtD, pr);
        softmax(pr, nsel);
        K.weightedRows(pr, sc.vrow.data() + q * k, g * D, nsel, D, o);
    });
    if (!ok)
    {
        return fail("the intra-op thread pool failed");
    }
    return true;
}

} // namespace ortcpu
} // namespace gsm
