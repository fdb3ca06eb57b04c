// GsmPoolAttention's rows (gsmPoolRows.h): the latents dequantised from the pools, the row cache of K rows (lookup,
// eviction, the call's new rows), the pool writes, and the step runCachedAttention runs before the attention.
// Compiled without FMA contraction, as the attention core: a K row made here has the bits section A gives it.
#include <algorithm>
#include <cstring>

#include "../kernels/gsmOrtKernels.h"
#include "gsmRowCache.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

// Sequence b's row of the row cache in this call
struct CacheRow
{
    int32_t* pos;       // tag rows (RowCacheTag): position held (-1 free),
    int32_t* ent;       // the slot entry it was made from,
    int32_t* used;      // the call it was last read in
    float* rows;        // [C, kvD]
    int32_t const* slots; // the sequence's kv_slots
    int64_t C, kvD;
    int32_t past, now;  // the sequence's length before the call, and the call's stamp (past + S)
};

CacheRow cacheRowOf(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b)
{
    PoolSource const& ps = *in.pool;
    CacheRow r;
    r.C = ps.capacity;
    r.kvD = d.nKV * d.D;
    int64_t const row = in.cacheRows[b];
    r.past = in.pastLengths[b];
    r.now = r.past + static_cast<int32_t>(d.S);
    r.pos = ps.cacheTags + row * kTagRows * r.C;
    r.ent = r.pos + r.C;
    r.used = r.pos + 2 * r.C;
    r.rows = ps.cacheRows + row * r.C * r.kvD;
    r.slots = ps.slots + b * d.N;
    return r;
}

// Frees the slots of positions written again since (a rollback, or another sequence in this row: not rows of ours)
// and maps every position still held to its slot in sc.slotOf
void mapSlots(CacheRow const& r, Scratch& sc)
{
    for (int64_t c = 0; c < r.C; ++c)
    {
        if (r.pos[c] >= r.past)
        {
            r.pos[c] = -1;
        }
        if (r.pos[c] >= 0)
        {
            sc.slotOf[static_cast<size_t>(r.pos[c])] = static_cast<int32_t>(c);
        }
    }
}

// Needed positions [i0, i1) of sequence b found in a slot read it from there (made again where the slot table's
// entry changed: a re-tier pass re-encoded the row, or moved it); the others are misses
void findHits(CacheRow const& r, int64_t b, int64_t i0, int64_t i1, Scratch& sc, std::vector<RowJob>& jobs,
    std::vector<int32_t>& misses)
{
    PoolCall& pc = sc.pool;
    for (int64_t i = i0; i < i1; ++i)
    {
        int32_t const p = pc.need[static_cast<size_t>(i)], e = r.slots[p];
        int32_t const c = sc.slotOf[static_cast<size_t>(p)];
        if (c >= 0)
        {
            pc.kRow[static_cast<size_t>(i)] = r.rows + c * r.kvD;
            if (r.ent[c] != e)
            {
                r.ent[c] = e;
                jobs.push_back({i, b, p, e, r.rows + c * r.kvD, -1});
            }
            r.used[c] = r.now;
        }
        else
        {
            misses.push_back(static_cast<int32_t>(i));
        }
    }
}

// Slots for the misses, in the order they get them: free ones, then those least recently read (ties to the lower
// slot, so a run is reproducible) that this call did not read; sc.slotOf back to -1 for every slot
void chooseVictims(CacheRow const& r, size_t misses, Scratch& sc, std::vector<int32_t>& victims,
    std::vector<int32_t>& candidates)
{
    for (int64_t c = 0; c < r.C; ++c)
    {
        if (r.pos[c] < 0)
        {
            victims.push_back(static_cast<int32_t>(c));
        }
        else if (r.used[c] != r.now)
        {
            candidates.push_back(static_cast<int32_t>(c));
        }
        else
        {
            sc.slotOf[static_cast<size_t>(r.pos[c])] = -1;
        }
    }
    size_t const want = misses > victims.size() ? misses - victims.size() : 0;
    if (want > 0)
    {
        int32_t const* used = r.used;
        auto older = [&](int32_t a, int32_t c) { return used[a] != used[c] ? used[a] < used[c] : a < c; };
        // the `take` oldest in order: partial_sort's result (the order is strict), without its heap over every
        // candidate (SmolLM2 at 8K: ~150 of ~1,000, 1 % faster decoding)
        auto const take = static_cast<std::ptrdiff_t>(std::min(want, candidates.size()));
        if (take < static_cast<std::ptrdiff_t>(candidates.size()))
        {
            std::nth_element(candidates.begin(), candidates.begin() + take, candidates.end(), older);
        }
        std::sort(candidates.begin(), candidates.begin() + take, older);
        victims.insert(victims.end(), candidates.begin(), candidates.begin() + take);
    }
    for (int32_t c : candidates)
    {
        sc.slotOf[static_cast<size_t>(r.pos[c])] = -1;
    }
}

// Each miss takes the next victim slot while there is one, else an overflow row (the cache full of rows this call
// reads)
void placeMisses(CacheRow const& r, int64_t b, std::vector<int32_t> const& misses,
    std::vector<int32_t> const& victims, Scratch& sc, std::vector<RowJob>& jobs, int64_t* overflowRows)
{
    PoolCall& pc = sc.pool;
    for (size_t m = 0; m < misses.size(); ++m)
    {
        int64_t const i = misses[m];
        int32_t const p = pc.need[static_cast<size_t>(i)], e = r.slots[p];
        if (m < victims.size())
        {
            int32_t const c = victims[m];
            r.pos[c] = p;
            r.ent[c] = e;
            r.used[c] = r.now;
            pc.kRow[static_cast<size_t>(i)] = r.rows + c * r.kvD;
            jobs.push_back({i, b, p, e, r.rows + c * r.kvD, -1});
        }
        else
        {
            jobs.push_back({i, b, p, e, nullptr, (*overflowRows)++});
            pc.kRow[static_cast<size_t>(i)] = nullptr; // set once the overflow buffer has its size
        }
    }
}

// The row cache of sequence b's pool row for this call: every selected cached position gets a K row (a hit, or a
// job that makes it in a slot or, the cache being full of rows this call reads, in the overflow); appends the
// jobs. positions [i0, i1) of pc.need are b's.
void rowCacheLookup(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b, int64_t i0, int64_t i1,
    Scratch& sc, std::vector<RowJob>& jobs, int64_t* overflowRows)
{
    CacheRow const r = cacheRowOf(d, in, b);
    static thread_local std::vector<int32_t> victims, candidates, misses;
    victims.clear();
    candidates.clear();
    misses.clear();
    mapSlots(r, sc);
    size_t const first = jobs.size();
    findHits(r, b, i0, i1, sc, jobs, misses);
    chooseVictims(r, misses.size(), sc, victims, candidates);
    placeMisses(r, b, misses, victims, sc, jobs, overflowRows);
    if (in.pool->misses != nullptr)
    {
        in.pool->misses[b] = static_cast<int32_t>(jobs.size() - first);
    }
}

// The cached positions sequence b's queries select, ascending, appended to sc.pool.need; false (with the message) where
// the slot table holds no row for one
bool collectNeed(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t k,
    CachedAttentionOutputs const& out, int64_t b, Scratch& sc, std::string* error)
{
    PoolSource const& ps = *in.pool;
    PoolCall& pc = sc.pool;
    int64_t const S = d.S, past = in.pastLengths[b];
    size_t const start = pc.need.size();
    static thread_local std::vector<uint8_t> mark;
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
        int32_t const e = ps.slots[b * d.N + pc.need[i]];
        if (!slotValid(ps.dims, e))
        {
            *error = "GsmPoolAttention: kv_slots[" + std::to_string(b) + ", " + std::to_string(pc.need[i]) + "] = "
                + std::to_string(e) + " is not a row of the pool (a cached position needs one)";
            return false;
        }
    }
    pc.needOff[static_cast<size_t>(b + 1)] = static_cast<int64_t>(pc.need.size());
    return true;
}

// Blocks of the pool step's one pass over the intra-op threads (each hand-off costs a wake-up per thread)
constexpr int64_t kJobBlock = 16; // K rows made together: latents dequantised, U_k times four at a time, RoPE
constexpr int64_t kVBlock = 64;   // V latents dequantised

// The V latents of need entries [i0, i1)
void loadVLatents(CachedAttentionDims const& d, CachedAttentionInputs const& in, PoolCall& pc, int64_t i0, int64_t i1)
{
    int64_t b = std::upper_bound(pc.needOff.begin(), pc.needOff.end(), i0) - pc.needOff.begin() - 1;
    for (int64_t i = i0; i < i1; ++i)
    {
        while (pc.needOff[static_cast<size_t>(b) + 1] <= i) // the sequence of need entry i
        {
            ++b;
        }
        loadVLatentAt(d, in, b, pc.need[static_cast<size_t>(i)], pc.vLatent.data() + i * d.rv);
    }
}

// K rows of jobs[j0 .. j0 + m), m <= kJobBlock: U_k (float32 ukf) times their K latents, then RoPE into each job's row
void makeKRows(CachedAttentionDims const& d, CachedAttentionInputs const& in, Kernels const& K, float const* ukf,
    RowJob const* jobs, int64_t m)
{
    PoolSource const& ps = *in.pool;
    int64_t const D = d.D, nKV = d.nKV, kvD = nKV * D, rk = d.rk;
    static thread_local std::vector<float> ck, kr;
    ck.resize(static_cast<size_t>(kJobBlock * rk));
    kr.resize(static_cast<size_t>(kJobBlock * kvD));
    float const* xs[kJobBlock];
    float* ys[kJobBlock];
    for (int64_t i = 0; i < m; ++i)
    {
        loadLatents(ps.dims, ps.pool + in.cacheRows[jobs[i].b] * ps.poolBytes, jobs[i].entry, ps.quant, 0,
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
        RowJob const& j = jobs[i];
        for (int64_t g = 0; g < nKV; ++g)
        {
            rope(ys[i] + g * D, in.ropeCos + j.position * D, in.ropeSin + j.position * D, D, j.dst + g * D);
        }
    }
}

} // namespace

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

void loadVLatentAt(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b, int64_t p, float* out)
{
    PoolSource const& ps = *in.pool;
    loadLatents(ps.dims, ps.pool + in.cacheRows[b] * ps.poolBytes, ps.slots[b * d.N + p], ps.quant,
        static_cast<int32_t>(d.rk), static_cast<int32_t>(d.rv), out);
}

bool resolvePoolRows(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t k,
    CachedAttentionOutputs const& out, Scratch& sc, ParallelRunner const& par, bool vLatents, std::string* error)
{
    PoolCall& pc = sc.pool;
    int64_t const kvD = d.nKV * d.D, rk = d.rk;
    startNeed(sc, d.N, d.B);
    for (int64_t b = 0; b < d.B; ++b)
    {
        if (!collectNeed(d, in, k, out, b, sc, error))
        {
            return false;
        }
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
    // one pass over the intra-op threads: blocks of K rows to make, then blocks of V latents to dequantise
    int64_t const nJobs = static_cast<int64_t>(jobs.size());
    int64_t const n = vLatents ? static_cast<int64_t>(pc.need.size()) : 0;
    pc.vLatent.resize(static_cast<size_t>(n * d.rv));
    int64_t const kTasks = (nJobs + kJobBlock - 1) / kJobBlock, vTasks = (n + kVBlock - 1) / kVBlock;
    bool ok = parallelFor(par, kTasks + vTasks, [&](int64_t t) {
        if (t >= kTasks)
        {
            int64_t const i0 = (t - kTasks) * kVBlock;
            loadVLatents(d, in, pc, i0, std::min(n, i0 + kVBlock));
            return;
        }
        int64_t const j0 = t * kJobBlock;
        makeKRows(d, in, K, ukf, jobs.data() + j0, std::min(kJobBlock, nJobs - j0));
    });
    if (!ok)
    {
        *error = "GsmPoolAttention: the intra-op thread pool failed";
    }
    return ok;
}

void rowCacheInsertNew(CachedAttentionDims const& d, CachedAttentionInputs const& in, float const* newKRows)
{
    static thread_local std::vector<int32_t> vacant;
    for (int64_t b = 0; b < d.B; ++b)
    {
        CacheRow const r = cacheRowOf(d, in, b);
        vacant.clear();
        for (int64_t c = 0; c < r.C; ++c)
        {
            if (r.pos[c] < 0 || r.used[c] != r.now)
            {
                vacant.push_back(static_cast<int32_t>(c));
            }
        }
        int32_t const* pos = r.pos;
        int32_t const* used = r.used;
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
            r.pos[c] = r.past + static_cast<int32_t>(j);
            r.ent[c] = r.slots[r.past + j];
            r.used[c] = r.now;
            std::memcpy(r.rows + c * r.kvD, newKRows + (b * d.S + j) * r.kvD, sizeof(float) * static_cast<size_t>(r.kvD));
        }
    }
}

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

} // namespace ortcpu
} // namespace gsm
