#include "gsmSparseAttentionRef.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

namespace gsm
{
namespace ref
{
namespace
{

// Static partition of [0, n) over threads: cheap, deterministic, and results never depend on it
// (every output element is written by exactly one task).
void parallelFor(int64_t n, int32_t nThreads, std::function<void(int64_t)> const& fn)
{
    int32_t const hw = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
    int64_t const t = std::min<int64_t>(n, nThreads > 0 ? nThreads : hw);
    if (t <= 1)
    {
        for (int64_t i = 0; i < n; ++i)
        {
            fn(i);
        }
        return;
    }
    std::vector<std::thread> pool;
    std::atomic<int64_t> next{0};
    for (int64_t w = 0; w < t; ++w)
    {
        pool.emplace_back([&] {
            for (int64_t i = next++; i < n; i = next++)
            {
                fn(i);
            }
        });
    }
    for (auto& th : pool)
    {
        th.join();
    }
}

struct ErrorSink
{
    std::mutex mu;
    std::atomic<bool> failed{false};
    std::string msg;
    void set(std::string const& m)
    {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed.exchange(true))
        {
            msg = m;
        }
    }
};

// RoPE (HF rotate-half) of one head vector in place: x*cos + rotate_half(x)*sin, as three
// separately rounded float32 operations like the golden's tensor expression.
void ropeInPlace(float* x, float const* cs, float const* sn, int32_t D)
{
    int32_t const h = D / 2;
    std::vector<float> tmp(x, x + D);
    for (int32_t i = 0; i < D; ++i)
    {
        float const rot = i < h ? -tmp[i + h] : tmp[i - h];
        float const a = tmp[i] * cs[i];
        float const b = rot * sn[i];
        x[i] = a + b;
    }
}

class Runner
{
public:
    Runner(GsmDims const& d, int32_t B, int32_t S, AttnInputs const& in, AttnOutputs const& out)
        : d_(d), B_(B), S_(S), in_(in), out_(out), kvD_(kvDim(d)), r_(latentRank(d)), kSel_(maxSelected(d))
    {
    }

    bool run(int32_t nThreads, std::string* err);

private:
    // Dequantised latent row of position s of sequence b: r values (k then v).
    bool loadRow(int32_t b, int32_t s, float* c) const;
    // K (rotated) and V of position s: kvD values each.
    bool reconstruct(int32_t b, int32_t s, float* K, float* V) const;
    // Selection budget of sequence b (validated in run()).
    int32_t seqTopKOf(int32_t b) const
    {
        return in_.sparseTopK != nullptr ? in_.sparseTopK[b] : d_.maxTopK;
    }
    // Top-k of sequence b's query at position t: its budget, grown with the context (sparse_top_k_divisor).
    int32_t topKOf(int32_t b, int32_t t) const
    {
        return queryTopK(d_, seqTopKOf(b), t);
    }
    void select(int32_t b, int32_t j, int32_t* sel, int32_t& count, float* scoresRow) const;
    void attendRow(int32_t b, int32_t j, int32_t count, float const* K, float const* V, int64_t const* rowOf,
        float* rowMass) const;
    // The steps of run(): each returns false with *err set.
    bool checkCall(std::string* err) const;
    bool selectRows(int32_t* sel, std::vector<int32_t>& counts, int32_t nThreads);
    bool makeRows(int32_t const* sel, std::vector<int32_t> const& counts, std::vector<std::vector<float>>& Kb,
        std::vector<std::vector<float>>& Vb, std::vector<std::vector<int64_t>>& rowOf, int32_t nThreads);
    void addMasses(int32_t const* sel, std::vector<int32_t> const& counts, std::vector<float> const& rowMass) const;

    GsmDims d_;
    int32_t B_, S_;
    AttnInputs in_;
    AttnOutputs out_;
    int32_t kvD_, r_, kSel_;
    mutable ErrorSink errs_; // written from worker threads, also inside const helpers
};

bool Runner::loadRow(int32_t b, int32_t s, float* c) const
{
    int32_t const entry = in_.slots[static_cast<int64_t>(b) * d_.nMax + s];
    if (!slotValid(d_, entry))
    {
        errs_.set("GsmSparseAttention: kv_slots[" + std::to_string(b) + ", " + std::to_string(s)
            + "] = " + std::to_string(entry) + " is not a valid row of a cached position");
        return false;
    }
    uint8_t const* base = reinterpret_cast<uint8_t const*>(in_.pool + static_cast<int64_t>(in_.rows.of(b)) * poolWords(d_));
    uint8_t const* row = base + rowOffset(d_, slotRow(entry));
    QuantView const qv{in_.quant, r_};
    for (int32_t i = 0; i < r_; ++i)
    {
        c[i] = loadLatent(d_, row, slotTier(entry), qv, i);
    }
    return true;
}

bool Runner::reconstruct(int32_t b, int32_t s, float* K, float* V) const
{
    std::vector<float> c(r_);
    if (!loadRow(b, s, c.data()))
    {
        return false;
    }
    if (d_.layerKind == 0)
    {
        for (int32_t o = 0; o < kvD_; ++o)
        {
            float accK = 0.f;
            for (int32_t i = 0; i < d_.rankK; ++i)
            {
                accK += in_.w0[static_cast<int64_t>(o) * d_.rankK + i] * c[i];
            }
            float accV = 0.f;
            for (int32_t i = 0; i < d_.rankV; ++i)
            {
                accV += in_.w1[static_cast<int64_t>(o) * d_.rankV + i] * c[d_.rankK + i];
            }
            K[o] = accK;
            V[o] = accV;
        }
    }
    else
    {
        // [Kpre; V] = W [c_k; c_v] + bias (spec 4.2): matmul, then the bias add.
        for (int32_t o = 0; o < 2 * kvD_; ++o)
        {
            float acc = 0.f;
            for (int32_t i = 0; i < r_; ++i)
            {
                acc += in_.w0[static_cast<int64_t>(o) * r_ + i] * c[i];
            }
            float const v = acc + in_.w1[o];
            (o < kvD_ ? K[o] : V[o - kvD_]) = v;
        }
    }
    float const* cs = in_.ropeCos + static_cast<int64_t>(s) * d_.headDim;
    float const* sn = in_.ropeSin + static_cast<int64_t>(s) * d_.headDim;
    for (int32_t h = 0; h < d_.numKvHeads; ++h)
    {
        ropeInPlace(K + h * d_.headDim, cs, sn, d_.headDim);
    }
    return true;
}

void Runner::select(int32_t b, int32_t j, int32_t* sel, int32_t& count, float* scoresRow) const
{
    int32_t const t = in_.pastLengths[b] + j;
    int32_t const w = in_.sparseWindow;
    int32_t const topK = topKOf(b, t);
    count = 0;
    if (selectionIsDense(t, d_.sinkTokens, w, topK))
    {
        for (int32_t s = 0; s <= t; ++s)
        {
            sel[count++] = s;
        }
        if (scoresRow == nullptr)
        {
            return; // dense selection needs no scores
        }
    }
    // I(t,s) = sum_i w_i ReLU(q_i . e_s) / sqrt(dI) over s <= t (spec 4.1)
    int64_t const row = static_cast<int64_t>(b) * S_ + j;
    float const* qh = in_.indexQ + row * d_.indexHeads * d_.indexDim;
    float const* wh = in_.indexW + row * d_.indexHeads;
    float const scale = static_cast<float>(std::sqrt(static_cast<double>(d_.indexDim)));
    std::vector<float> e(d_.indexDim);
    std::vector<float> score(t + 1);
    for (int32_t s = 0; s <= t; ++s)
    {
        uint8_t const* key = static_cast<uint8_t const*>(in_.indexKeys) + indexKeyOffset(d_, in_.rows.of(b), s);
        for (int32_t c = 0; c < d_.indexDim; ++c)
        {
            if (int8Keys(d_))
            {
                e[c] = static_cast<float>(reinterpret_cast<int8_t const*>(key)[c]); // q is scaled by the key scale
            }
            else
            {
                uint16_t h;
                std::memcpy(&h, key + 2 * c, 2);
                e[c] = f16BitsToF32(h);
            }
        }
        float acc = 0.f;
        for (int32_t i = 0; i < d_.indexHeads; ++i)
        {
            float dot = 0.f;
            for (int32_t c = 0; c < d_.indexDim; ++c)
            {
                dot += qh[i * d_.indexDim + c] * e[c];
            }
            acc += wh[i] * (dot > 0.f ? dot : 0.f);
        }
        score[s] = acc / scale;
        if (scoresRow)
        {
            scoresRow[s] = score[s];
        }
    }
    if (count > 0)
    {
        return; // dense, scores were only wanted as diagnostics
    }
    // sinks, then the top-k of the candidates in ascending position, then the window
    int32_t const candEnd = t - w; // candidates: [sinks, t - w]
    for (int32_t s = 0; s < d_.sinkTokens; ++s)
    {
        sel[count++] = s;
    }
    if (topK > 0)
    {
        std::vector<int32_t> cand;
        for (int32_t s = d_.sinkTokens; s <= candEnd; ++s)
        {
            cand.push_back(s);
        }
        auto before = [&](int32_t a, int32_t c) { return selectsBefore(score[a], a, score[c], c); };
        std::nth_element(cand.begin(), cand.begin() + (topK - 1), cand.end(), before);
        std::sort(cand.begin(), cand.begin() + topK);
        for (int32_t k = 0; k < topK; ++k)
        {
            sel[count++] = cand[k];
        }
    }
    for (int32_t s = candEnd + 1; s <= t; ++s)
    {
        sel[count++] = s;
    }
}

void Runner::attendRow(int32_t b, int32_t j, int32_t count, float const* K, float const* V, int64_t const* rowOf,
    float* rowMass) const
{
    int32_t const t = in_.pastLengths[b] + j;
    int32_t const D = d_.headDim;
    int32_t const group = d_.numHeads / d_.numKvHeads;
    int64_t const row = static_cast<int64_t>(b) * S_ + j;
    float const* cs = in_.ropeCos + static_cast<int64_t>(t) * D;
    float const* sn = in_.ropeSin + static_cast<int64_t>(t) * D;
    float const scale = static_cast<float>(std::sqrt(static_cast<double>(D)));
    std::vector<float> q(D), logit(count);
    std::fill(rowMass, rowMass + count, 0.f);
    for (int32_t h = 0; h < d_.numHeads; ++h)
    {
        float const* qsrc = in_.q + (row * d_.numHeads + h) * D;
        std::copy(qsrc, qsrc + D, q.begin());
        ropeInPlace(q.data(), cs, sn, D);
        int32_t const kvh = h / group;
        float mx = -std::numeric_limits<float>::infinity();
        for (int32_t k = 0; k < count; ++k)
        {
            float const* Ks = K + rowOf[k] * kvD_ + kvh * D;
            float dot = 0.f;
            for (int32_t i = 0; i < D; ++i)
            {
                dot += q[i] * Ks[i];
            }
            logit[k] = dot / scale;
            mx = std::max(mx, logit[k]);
        }
        float sum = 0.f;
        for (int32_t k = 0; k < count; ++k)
        {
            logit[k] = std::exp(logit[k] - mx);
            sum += logit[k];
        }
        float* o = out_.out + (row * d_.numHeads + h) * D;
        std::fill(o, o + D, 0.f);
        for (int32_t k = 0; k < count; ++k)
        {
            float const p = logit[k] / sum;
            rowMass[k] += p;
            float const* Vs = V + rowOf[k] * kvD_ + kvh * D;
            for (int32_t i = 0; i < D; ++i)
            {
                o[i] += p * Vs[i];
            }
        }
    }
}

bool Runner::checkCall(std::string* err) const
{
    auto fail = [&](std::string const& m) {
        if (err)
        {
            *err = m;
        }
        return false;
    };
    if (d_.numKvHeads <= 0 || d_.numHeads % d_.numKvHeads != 0 || d_.headDim <= 0 || d_.headDim % 2 != 0)
    {
        return fail("GsmSparseAttention: need num_heads % num_kv_heads == 0 and an even head_dim");
    }
    if (d_.layerKind == 0 && (in_.sparseWindow < 1 || in_.sparseWindow > d_.maxSparseWindow))
    {
        return fail("GsmSparseAttention: sparse_window " + std::to_string(in_.sparseWindow) + " outside 1..max_sparse_window = "
            + std::to_string(d_.maxSparseWindow));
    }
    if (d_.sparseTopKDivisor < 0)
    {
        return fail("GsmSparseAttention: sparse_top_k_divisor " + std::to_string(d_.sparseTopKDivisor) + " is negative");
    }
    for (int32_t b = 0; d_.layerKind == 0 && b < B_; ++b)
    {
        // a kernel clamps instead (it cannot raise); the reference names the value, as for sparse_window
        int32_t const k = seqTopKOf(b);
        if (k < 0 || k > d_.maxTopK)
        {
            return fail("GsmSparseAttention: sparse_top_k[" + std::to_string(b) + "] = " + std::to_string(k)
                + " outside 0..max_top_k = " + std::to_string(d_.maxTopK));
        }
    }
    for (int32_t b = 0; b < B_; ++b)
    {
        if (!in_.rows.valid(b))
        {
            return fail("GsmSparseAttention: cache_rows[" + std::to_string(b) + "] = " + std::to_string(in_.rows.of(b))
                + " is not a row of the pools (0.." + std::to_string(in_.rows.count - 1) + ")");
        }
        int32_t const past = in_.pastLengths[b], nNew = in_.newLengths[b];
        if (past < 0 || nNew < 0 || nNew > S_ || static_cast<int64_t>(past) + nNew > d_.nMax)
        {
            return fail("GsmSparseAttention: sequence " + std::to_string(b) + " has past_lengths " + std::to_string(past)
                + ", new_lengths " + std::to_string(nNew) + " (need 0 <= new <= S and past + new <= n_max)");
        }
    }
    if (out_.queryMass == nullptr)
    {
        return true;
    }
    if (d_.layerKind != 0 || in_.logitRows == nullptr || in_.logitRowCount < 1)
    {
        return fail("GsmSparseAttention: query_mass needs an owning layer and logit_rows [B, J >= 1]");
    }
    int64_t const J = in_.logitRowCount;
    for (int64_t i = 0; i < static_cast<int64_t>(B_) * J; ++i)
    {
        if (in_.logitRows[i] < 0 || in_.logitRows[i] >= S_)
        {
            return fail("GsmSparseAttention: logit_rows[" + std::to_string(i / J) + ", " + std::to_string(i % J)
                + "] = " + std::to_string(in_.logitRows[i]) + " is outside 0..S-1 = " + std::to_string(S_ - 1));
        }
    }
    return true;
}

// 1. each valid row's Sel(t) (owning) or the source's (sharing), -1 padded; counts[row] entries
bool Runner::selectRows(int32_t* sel, std::vector<int32_t>& counts, int32_t nThreads)
{
    if (out_.scores)
    {
        std::fill(out_.scores, out_.scores + static_cast<int64_t>(B_) * S_ * d_.nMax, std::numeric_limits<float>::quiet_NaN());
    }
    parallelFor(static_cast<int64_t>(B_) * S_, nThreads, [&](int64_t rI) {
        int32_t const b = static_cast<int32_t>(rI / S_), j = static_cast<int32_t>(rI % S_);
        int32_t* s = sel + rI * kSel_;
        std::fill(s, s + kSel_, -1);
        if (j >= in_.newLengths[b])
        {
            return;
        }
        if (d_.layerKind == 0)
        {
            select(b, j, s, counts[rI], out_.scores ? out_.scores + rI * d_.nMax : nullptr);
            return;
        }
        int32_t const* src = in_.selectedIn + rI * kSel_;
        int32_t const t = in_.pastLengths[b] + j;
        int32_t c = 0;
        for (int32_t k = 0; k < kSel_ && src[k] >= 0; ++k)
        {
            if (src[k] > t)
            {
                errs_.set("GsmSparseAttention (sharing): selected[" + std::to_string(b) + ", " + std::to_string(j)
                    + "] names position " + std::to_string(src[k]) + " after the query");
                return;
            }
            s[c++] = src[k];
        }
        if (c == 0)
        {
            errs_.set("GsmSparseAttention (sharing): selected[" + std::to_string(b) + ", " + std::to_string(j)
                + "] is empty for a valid query row");
        }
        counts[rI] = c;
    });
    return !errs_.failed;
}

// 2. K/V of the positions the call's rows of sequence b select, each made once per sequence (a prefill chunk's rows
// share most of theirs, a verification's nearly all): a position's rows are the same bits whoever selected it, so
// every query reads what a one-token step at its position reads. rowOf[row][k]: where its k-th pick's rows are.
bool Runner::makeRows(int32_t const* sel, std::vector<int32_t> const& counts, std::vector<std::vector<float>>& Kb,
    std::vector<std::vector<float>>& Vb, std::vector<std::vector<int64_t>>& rowOf, int32_t nThreads)
{
    for (int32_t b = 0; b < B_; ++b)
    {
        std::vector<int64_t> at(static_cast<size_t>(in_.pastLengths[b]) + in_.newLengths[b], -1);
        std::vector<int32_t> positions;
        for (int32_t j = 0; j < in_.newLengths[b]; ++j)
        {
            int64_t const rI = static_cast<int64_t>(b) * S_ + j;
            rowOf[rI].resize(counts[rI]);
            for (int32_t k = 0; k < counts[rI]; ++k)
            {
                int32_t const s = sel[rI * kSel_ + k];
                if (at[s] < 0)
                {
                    at[s] = static_cast<int64_t>(positions.size());
                    positions.push_back(s);
                }
                rowOf[rI][k] = at[s];
            }
        }
        Kb[b].assign(positions.size() * kvD_, 0.f);
        Vb[b].assign(positions.size() * kvD_, 0.f);
        parallelFor(static_cast<int64_t>(positions.size()), nThreads,
            [&](int64_t i) { reconstruct(b, positions[i], &Kb[b][i * kvD_], &Vb[b][i * kvD_]); });
    }
    return !errs_.failed;
}

// 4. attn_mass: the rows' masses added in row order, so the result does not depend on the thread count; query_mass:
// each logit row's own (0 + m: a one-token step's attn_mass bits)
void Runner::addMasses(int32_t const* sel, std::vector<int32_t> const& counts, std::vector<float> const& rowMass) const
{
    if (out_.mass)
    {
        std::fill(out_.mass, out_.mass + static_cast<int64_t>(B_) * d_.nMax, 0.f);
        for (int64_t rI = 0; rI < static_cast<int64_t>(B_) * S_; ++rI)
        {
            int32_t const b = static_cast<int32_t>(rI / S_);
            for (int32_t k = 0; k < counts[rI]; ++k)
            {
                out_.mass[static_cast<int64_t>(b) * d_.nMax + sel[rI * kSel_ + k]] += rowMass[rI * kSel_ + k];
            }
        }
    }
    if (out_.queryMass == nullptr)
    {
        return;
    }
    int64_t const J = in_.logitRowCount;
    std::fill(out_.queryMass, out_.queryMass + static_cast<int64_t>(B_) * J * d_.nMax, 0.f);
    for (int64_t i = 0; i < static_cast<int64_t>(B_) * J; ++i)
    {
        int32_t const b = static_cast<int32_t>(i / J), j = in_.logitRows[i];
        if (j >= in_.newLengths[b])
        {
            continue; // a padding row: no query
        }
        int64_t const rI = static_cast<int64_t>(b) * S_ + j;
        float* qm = out_.queryMass + i * d_.nMax;
        for (int32_t k = 0; k < counts[rI]; ++k)
        {
            qm[sel[rI * kSel_ + k]] += rowMass[rI * kSel_ + k];
        }
    }
}

bool Runner::run(int32_t nThreads, std::string* err)
{
    auto fail = [&](std::string const& m) {
        if (err)
        {
            *err = m;
        }
        return false;
    };
    if (!checkCall(err))
    {
        return false;
    }
    int64_t const rows = static_cast<int64_t>(B_) * S_;
    std::vector<int32_t> selLocal;
    int32_t* sel = out_.selected;
    if (sel == nullptr)
    {
        selLocal.resize(rows * kSel_);
        sel = selLocal.data();
    }
    std::vector<int32_t> counts(rows, 0);
    std::vector<std::vector<float>> Kb(B_), Vb(B_);
    std::vector<std::vector<int64_t>> rowOf(rows);
    if (!selectRows(sel, counts, nThreads) || !makeRows(sel, counts, Kb, Vb, rowOf, nThreads))
    {
        return fail(errs_.msg);
    }
    // 3. attention per valid row
    std::vector<float> rowMass(rows * kSel_, 0.f);
    parallelFor(rows, nThreads, [&](int64_t rI) {
        int32_t const b = static_cast<int32_t>(rI / S_), j = static_cast<int32_t>(rI % S_);
        float* o = out_.out + rI * d_.numHeads * d_.headDim;
        if (j >= in_.newLengths[b])
        {
            std::fill(o, o + d_.numHeads * d_.headDim, 0.f);
            return;
        }
        attendRow(b, j, counts[rI], Kb[b].data(), Vb[b].data(), rowOf[rI].data(), &rowMass[rI * kSel_]);
    });
    addMasses(sel, counts, rowMass);
    return true;
}

} // namespace

bool sparseAttention(GsmDims const& d, int32_t B, int32_t S, AttnInputs const& in, AttnOutputs const& out,
    int32_t nThreads, std::string* err)
{
    Runner runner(d, B, S, in, out);
    return runner.run(nThreads, err);
}

} // namespace ref
} // namespace gsm
