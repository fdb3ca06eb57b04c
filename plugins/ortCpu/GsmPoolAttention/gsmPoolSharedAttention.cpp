// GsmPoolSharedAttention (gsmPoolSharedAttention.h): the positions the source selected, their rows made through this
// layer's projection (K into its row cache), then per (query, head) RoPE of q, logits, softmax and the V sum. Compiled
// without FMA contraction, as the attention core.
#include "gsmPoolSharedAttention.h"

#include <algorithm>
#include <cmath>

#include "../kernels/gsmOrtKernels.h"
#include "gsmRowCache.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

// The positions the call's valid queries selected, per sequence ascending, into sc.pool.need; false (with the
// message) on lengths or rows outside the buffers, a selection past its query or a position without a pool row
bool collectNeed(CachedAttentionDims const& d, SharedAttentionInputs const& sin, Scratch& sc, std::string* error)
{
    PoolSource const& ps = *sin.pool;
    PoolCall& pc = sc.pool;
    int64_t const S = d.S, N = d.N, k = sin.k;
    auto fail = [&](std::string const& m) {
        *error = "GsmPoolSharedAttention: " + m;
        return false;
    };
    static thread_local std::vector<uint8_t> mark;
    for (int64_t b = 0; b < d.B; ++b)
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
    return true;
}

// Per needed position, its latent dequantised once: V = W_v c + b_v into sc.vrows (this call's rows only), and
// where the row cache lacks its K row, K = RoPE(W_k c + b_k) into the slot the lookup chose
bool makeRows(CachedAttentionDims const& d, SharedAttentionInputs const& sin, std::vector<RowJob> const& jobs,
    Kernels const& K, Scratch& sc, ParallelRunner const& par)
{
    PoolSource const& ps = *sin.pool;
    PoolCall const& pc = sc.pool;
    int64_t const N = d.N, D = d.D, nKV = d.nKV, kvD = nKV * D, r = d.rk + d.rv;
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
    return parallelFor(par, n, [&](int64_t i) {
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
}

// Each valid query's K and V rows in selection order (sc.krow, sc.vrow) and their count (sc.nsel; 0: a padding row)
void gatherSelections(CachedAttentionDims const& d, SharedAttentionInputs const& sin, Scratch& sc)
{
    PoolCall const& pc = sc.pool;
    int64_t const S = d.S, k = sin.k, kvD = d.nKV * d.D, Q = d.B * S;
    sc.krow.resize(static_cast<size_t>(Q * k));
    sc.vrow.resize(static_cast<size_t>(Q * k));
    sc.nsel.assign(static_cast<size_t>(Q), 0);
    for (int64_t b = 0; b < d.B; ++b)
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
}

// Per (query, head): RoPE of q, logits over the selection, softmax, weighted V rows; a padding row is zero
bool attend(CachedAttentionDims const& d, SharedAttentionInputs const& sin, Kernels const& K, Scratch& sc,
    float* attnOut, ParallelRunner const& par)
{
    int64_t const S = d.S, nH = d.nH, D = d.D, grp = nH / d.nKV, k = sin.k, Q = d.B * S;
    float const sqrtD = static_cast<float>(std::sqrt(static_cast<double>(D)));
    sc.probs.resize(static_cast<size_t>(Q * nH * k));
    return parallelFor(par, Q * nH, [&](int64_t i) {
        int64_t const q = i / nH, h = i % nH, g = h / grp, nsel = sc.nsel[static_cast<size_t>(q)];
        float* o = attnOut + (q * nH + h) * D;
        if (nsel == 0)
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
}

} // namespace

bool runPoolSharedAttention(CachedAttentionDims const& d, SharedAttentionInputs const& sin, float* attnOut,
    ParallelRunner const& par, std::string* error)
{
    Kernels const& K = cpuKernels();
    static thread_local Scratch callerScratch;
    Scratch& sc = callerScratch;
    releasePrefillScratch(sc, d.S);
    startNeed(sc, d.N, d.B);
    if (!collectNeed(d, sin, sc, error))
    {
        return false;
    }
    // the row-cache lookup reads these of a CachedAttentionInputs
    CachedAttentionInputs in;
    in.pool = sin.pool;
    in.cacheRows = sin.cacheRows;
    in.pastLengths = sin.pastLengths;
    // K rows (a selected position at or past `past` is the call's own, written by the source: a miss, then kept)
    std::vector<RowJob>& jobs = rowCacheJobs(d, in, sc);
    bool ok = makeRows(d, sin, jobs, K, sc, par);
    gatherSelections(d, sin, sc);
    ok = ok && attend(d, sin, K, sc, attnOut, par);
    if (!ok)
    {
        *error = "GsmPoolSharedAttention: the intra-op thread pool failed";
    }
    return ok;
}

} // namespace ortcpu
} // namespace gsm
