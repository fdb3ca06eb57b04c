#include "gsmKVCacheRef.h"

#include <cstring>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_set>
#include <vector>

namespace gsm
{
namespace ref
{
namespace
{

uint8_t* seqPool(GsmDims const& d, int32_t* pool, int32_t b)
{
    return reinterpret_cast<uint8_t*>(pool + static_cast<int64_t>(b) * poolWords(d));
}

uint8_t const* seqPool(GsmDims const& d, int32_t const* pool, int32_t b)
{
    return reinterpret_cast<uint8_t const*>(pool + static_cast<int64_t>(b) * poolWords(d));
}

bool fail(std::string* err, std::string const& msg)
{
    if (err)
    {
        *err = msg;
    }
    return false;
}

// The codes of the packed tiers (INT12, INT4) come in pairs: channels 2p and 2p + 1 of each part (c_k's, then
// c_v's, packed separately), an odd part's last pair padded with a zero code. `store(part, p, a, b)` writes one.
template <typename Scale, typename Store>
void encodePairs(GsmDims const& d, float const* v, Scale scale, int32_t qmax, Store store)
{
    for (int32_t part = 0; part < 2; ++part)
    {
        int32_t const n = part ? d.rankV : d.rankK;
        int32_t const c0 = part ? d.rankK : 0;
        for (int32_t p = 0; 2 * p < n; ++p)
        {
            int32_t const a = quantize(v[c0 + 2 * p], scale(c0 + 2 * p), qmax);
            int32_t const b = 2 * p + 1 < n ? quantize(v[c0 + 2 * p + 1], scale(c0 + 2 * p + 1), qmax) : 0;
            store(part, p, a, b);
        }
    }
}

// Encode the r dequantised values `v` as a row of `tier` at `row`.
void encodeRow(GsmDims const& d, uint8_t* row, int32_t tier, float const* v, QuantView const& qv)
{
    int32_t const r = latentRank(d);
    if (tier == kTierFP16)
    {
        for (int32_t c = 0; c < r; ++c)
        {
            storeFP16(row, c, v[c]);
        }
    }
    else if (tier == kTierINT12)
    {
        encodePairs(
            d, v, [&](int32_t c) { return qv.s12(c); }, kQmaxINT12,
            [&](int32_t part, int32_t p, int32_t a, int32_t b) { packINT12Pair(a, b, int12PairPtr(d, row, part, p)); });
    }
    else if (tier == kTierINT8)
    {
        for (int32_t c = 0; c < r; ++c)
        {
            row[c] = static_cast<uint8_t>(static_cast<int8_t>(quantize(v[c], qv.s8(c), kQmaxINT8)));
        }
    }
    else
    {
        encodePairs(
            d, v, [&](int32_t c) { return qv.s4(c); }, kQmaxINT4,
            [&](int32_t part, int32_t p, int32_t a, int32_t b) { *int4PairPtr(d, row, part, p) = packINT4Pair(a, b); });
    }
}

} // namespace

bool kvCacheUpdate(GsmDims const& d, int32_t B, int32_t S, float const* ck, float const* cv, float const* key,
    int32_t* pool, void* indexKeys, int32_t const* slots, int32_t const* pastLengths,
    int32_t const* newLengths, CacheRows rows, std::string* err)
{
    for (int32_t b = 0; b < B; ++b)
    {
        if (!rows.valid(b))
        {
            return fail(err, "GsmKVCacheUpdate: cache_rows[" + std::to_string(b) + "] = " + std::to_string(rows.of(b))
                    + " is not a row of the pools (0.." + std::to_string(rows.count - 1) + ")");
        }
        int32_t const row = rows.of(b);
        int32_t const past = pastLengths[b];
        int32_t const nNew = newLengths[b];
        if (past < 0 || nNew < 0 || nNew > S || static_cast<int64_t>(past) + nNew > d.nMax)
        {
            return fail(err, "GsmKVCacheUpdate: sequence " + std::to_string(b) + " has past_lengths " + std::to_string(past)
                    + ", new_lengths " + std::to_string(nNew) + " (need 0 <= new <= S = " + std::to_string(S)
                    + " and past + new <= n_max = " + std::to_string(d.nMax) + ")");
        }
        for (int32_t j = 0; j < nNew; ++j)
        {
            int32_t const p = past + j;
            int32_t const entry = slots[static_cast<int64_t>(b) * d.nMax + p];
            if (!slotValid(d, entry) || slotTier(entry) != kTierFP16)
            {
                return fail(err, "GsmKVCacheUpdate: kv_slots[" + std::to_string(b) + ", " + std::to_string(p) + "] = "
                        + std::to_string(entry) + " is not an FP16 row (the runtime allocates one per new position)");
            }
            uint8_t* dst = seqPool(d, pool, row) + rowOffset(d, slotRow(entry));
            int64_t const src = static_cast<int64_t>(b) * S + j;
            for (int32_t c = 0; c < d.rankK; ++c)
            {
                storeFP16(dst, c, ck[src * d.rankK + c]);
            }
            for (int32_t c = 0; c < d.rankV; ++c)
            {
                storeFP16(dst, d.rankK + c, cv[src * d.rankV + c]);
            }
            uint8_t* kdst = static_cast<uint8_t*>(indexKeys) + indexKeyOffset(d, row, p);
            for (int32_t c = 0; c < d.indexDim; ++c)
            {
                float const e = key[src * d.indexDim + c];
                if (int8Keys(d))
                {
                    reinterpret_cast<int8_t*>(kdst)[c] = keyCode(e);
                }
                else
                {
                    uint16_t const h = f32ToF16Bits(e);
                    std::memcpy(kdst + 2 * c, &h, 2);
                }
            }
        }
    }
    return true;
}

bool kvDemote(GsmDims const& d, int32_t B, int32_t M, int32_t const* list, int32_t* pool, float const* quant,
    std::string* err)
{
    int32_t const r = latentRank(d);
    QuantView const qv{quant, r};
    std::vector<float> staged(static_cast<size_t>(M) * r);
    std::unordered_set<int64_t> dests;
    // Phase 1: validate and read every source (the CUDA kernel stages the same way).
    for (int32_t m = 0; m < M; ++m)
    {
        int32_t const b = list[3 * m];
        int32_t const from = list[3 * m + 1];
        int32_t const to = list[3 * m + 2];
        std::string const where = "GsmKVDemote: entry " + std::to_string(m) + " (b " + std::to_string(b) + ", "
            + std::to_string(from) + " -> " + std::to_string(to) + ")";
        if (b < 0 || b >= B)
        {
            return fail(err, where + ": batch index out of range");
        }
        if (!slotValid(d, from) || !slotValid(d, to))
        {
            return fail(err, where + ": slot entry malformed or its row's region is narrower than its tier");
        }
        if (slotTier(to) < slotTier(from))
        {
            return fail(err, where + ": promotion (a row never regains precision, spec 5)");
        }
        if (!dests.insert(static_cast<int64_t>(b) * (1LL << 24) + slotRow(to)).second)
        {
            return fail(err, where + ": destination row used twice");
        }
        uint8_t const* row = seqPool(d, pool, b) + rowOffset(d, slotRow(from));
        for (int32_t c = 0; c < r; ++c)
        {
            staged[static_cast<size_t>(m) * r + c] = loadLatent(d, row, slotTier(from), qv, c);
        }
    }
    // Phase 2: encode into the destinations.
    for (int32_t m = 0; m < M; ++m)
    {
        int32_t const b = list[3 * m];
        int32_t const to = list[3 * m + 2];
        encodeRow(d, seqPool(d, pool, b) + rowOffset(d, slotRow(to)), slotTier(to), &staged[static_cast<size_t>(m) * r], qv);
    }
    return true;
}

bool readLatents(GsmDims const& d, int32_t B, int32_t const* pool, int32_t const* slots, float const* quant,
    float* ck, float* cv, std::string* err)
{
    int32_t const r = latentRank(d);
    QuantView const qv{quant, r};
    float const nan = std::numeric_limits<float>::quiet_NaN();
    for (int32_t b = 0; b < B; ++b)
    {
        for (int32_t p = 0; p < d.nMax; ++p)
        {
            int64_t const at = static_cast<int64_t>(b) * d.nMax + p;
            int32_t const entry = slots[at];
            float* k = ck + at * d.rankK;
            float* v = cv + at * d.rankV;
            if (entry == kSlotEmpty)
            {
                std::fill(k, k + d.rankK, nan);
                std::fill(v, v + d.rankV, nan);
                continue;
            }
            if (!slotValid(d, entry))
            {
                return fail(err, "read_latents: kv_slots[" + std::to_string(b) + ", " + std::to_string(p)
                        + "] = " + std::to_string(entry) + " is malformed");
            }
            uint8_t const* row = seqPool(d, pool, b) + rowOffset(d, slotRow(entry));
            for (int32_t c = 0; c < d.rankK; ++c)
            {
                k[c] = loadLatent(d, row, slotTier(entry), qv, c);
            }
            for (int32_t c = 0; c < d.rankV; ++c)
            {
                v[c] = loadLatent(d, row, slotTier(entry), qv, d.rankK + c);
            }
        }
    }
    return true;
}

void hotnessUpdate(int32_t n, float* hotness, float const* mass, double decay)
{
    // torch: python-float * float32 tensor rounds the scalar to float32 first.
    float const a = static_cast<float>(decay);
    float const b = static_cast<float>(1.0 - decay);
    for (int32_t i = 0; i < n; ++i)
    {
        float const x = a * hotness[i];
        float const y = b * mass[i];
        hotness[i] = x + y;
    }
}

void rankedTiers(int32_t n, float const* hotness, int32_t const* tokens, int32_t nHot, int32_t const* hotIds,
    int32_t sinkTokens, int32_t fp16Window, double f0, double f1, double f2, double f3, int32_t* out)
{
    std::fill(out, out + n, kTierFP16);
    std::unordered_set<int32_t> hot(hotIds, hotIds + nHot);
    std::vector<int32_t> eligible;
    int32_t const end = std::max(sinkTokens, n - fp16Window);
    for (int32_t s = sinkTokens; s < end; ++s)
    {
        if (!hot.count(tokens[s]))
        {
            eligible.push_back(s);
        }
    }
    if (eligible.empty())
    {
        return;
    }
    // hotness descending, ties to the lower position (the golden's stable sort)
    std::stable_sort(eligible.begin(), eligible.end(),
        [&](int32_t a, int32_t b) { return hotness[a] > hotness[b]; });
    double const N = static_cast<double>(eligible.size());
    // gsm.tiers.tier_counts, operation for operation (Python floats are doubles, math.floor rounds down).
    int64_t const all = static_cast<int64_t>(eligible.size());
    int64_t const n16 = static_cast<int64_t>(std::floor(f0 * N + 1e-9));
    int64_t const n12 = static_cast<int64_t>(std::floor((f0 + f1) * N + 1e-9)) - n16;
    // Without an INT4 fraction the rest is INT8, whatever float noise does to f0 + f1 + f2.
    int64_t const end8 = f3 == 0.0 ? all : std::min(all, static_cast<int64_t>(std::floor((f0 + f1 + f2) * N + 1e-9)));
    for (int64_t rank = 0; rank < all; ++rank)
    {
        out[eligible[rank]] = rank < n16 ? kTierFP16
            : (rank < n16 + n12 ? kTierINT12 : (rank < end8 ? kTierINT8 : kTierINT4));
    }
}

} // namespace ref
} // namespace gsm
