/*
 * C ABI of the CPU reference (libgsm_plugins_ref.so), loaded by gsm_edge_plugins through ctypes.
 * A plain C ABI keeps the Python side free of a binding library and lets any host runtime (the
 * ONNX Runtime backend, C++ runtimes) call the same functions. Every function returns 0 on
 * success and 1 on a contract violation, whose message gsm_ref_last_error() returns.
 */
#include "../gsmKVCache/gsmKVCacheRef.h"
#include "../gsmSparseAttention/gsmSparseAttentionRef.h"
#include "gsm_layout.h"

#include <string>

#define GSM_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{
thread_local std::string gLastError;

int32_t status(bool ok, std::string const& err)
{
    gLastError = ok ? std::string() : err;
    return ok ? 0 : 1;
}
} // namespace

using gsm::GsmDims;

GSM_EXPORT char const* gsm_ref_last_error()
{
    return gLastError.c_str();
}

// Bumped whenever a signature below or docs/engine_io.md's layout changes.
GSM_EXPORT int32_t gsm_ref_abi_version()
{
    // 3: kv_update / sparse_attention take cacheRows + the pools' rows; 4: the INT4 tier
    // (GsmDims.rowsINT4, [5, r] quant tables, four tier fractions, dequantize by tier, INT4 packing probes);
    // 5: INT8 indexer keys (GsmDims.indexKeyBits, index keys as bytes of either layout); 6: GsmDims.sparseTopKDivisor;
    // 7: sparse_attention takes logit_rows [B, J] and returns query_mass [B, J, N_max]
    return 7;
}

GSM_EXPORT int64_t gsm_ref_pool_words(GsmDims const* d)
{
    return gsm::poolWords(*d);
}

GSM_EXPORT int64_t gsm_ref_row_offset(GsmDims const* d, int32_t g)
{
    return gsm::rowOffset(*d, g);
}

GSM_EXPORT int32_t gsm_ref_kv_update(GsmDims const* d, int32_t B, int32_t S, float const* ck, float const* cv,
    float const* key, int32_t* pool, void* indexKeys, int32_t const* slots, int32_t const* past,
    int32_t const* newLengths, int32_t const* cacheRows, int32_t poolRows)
{
    std::string err;
    bool const ok = gsm::ref::kvCacheUpdate(
        *d, B, S, ck, cv, key, pool, indexKeys, slots, past, newLengths, gsm::cacheRowsOf(cacheRows, poolRows, B), &err);
    return status(ok, err);
}

GSM_EXPORT int32_t gsm_ref_kv_demote(
    GsmDims const* d, int32_t B, int32_t M, int32_t const* list, int32_t* pool, float const* quant)
{
    std::string err;
    bool const ok = gsm::ref::kvDemote(*d, B, M, list, pool, quant, &err);
    return status(ok, err);
}

GSM_EXPORT int32_t gsm_ref_read_latents(GsmDims const* d, int32_t B, int32_t const* pool, int32_t const* slots,
    float const* quant, float* ck, float* cv)
{
    std::string err;
    bool const ok = gsm::ref::readLatents(*d, B, pool, slots, quant, ck, cv, &err);
    return status(ok, err);
}

GSM_EXPORT int32_t gsm_ref_sparse_attention(GsmDims const* d, int32_t B, int32_t S, float const* q,
    int32_t const* pool, int32_t const* slots, int32_t const* past, int32_t const* newLengths, float const* quant,
    float const* ropeCos, float const* ropeSin, float const* w0, float const* w1, float const* indexQ,
    float const* indexW, void const* indexKeys, int32_t sparseWindow, int32_t const* selectedIn,
    int32_t const* sparseTopK, int32_t const* cacheRows, int32_t poolRows, int32_t const* logitRows, int32_t J,
    float* out, int32_t* selectedOut, float* mass, float* scores, float* queryMass, int32_t nThreads)
{
    gsm::ref::AttnInputs in{q, pool, slots, past, newLengths, quant, ropeCos, ropeSin, w0, w1, indexQ, indexW,
        indexKeys, sparseWindow, selectedIn, sparseTopK, gsm::cacheRowsOf(cacheRows, poolRows, B), logitRows, J};
    gsm::ref::AttnOutputs o{out, selectedOut, mass, scores, queryMass};
    std::string err;
    bool const ok = gsm::ref::sparseAttention(*d, B, S, in, o, nThreads, &err);
    return status(ok, err);
}

GSM_EXPORT void gsm_ref_hotness_update(int32_t n, float* hotness, float const* mass, double decay)
{
    gsm::ref::hotnessUpdate(n, hotness, mass, decay);
}

GSM_EXPORT void gsm_ref_ranked_tiers(int32_t n, float const* hotness, int32_t const* tokens, int32_t nHot,
    int32_t const* hotIds, int32_t sinkTokens, int32_t fp16Window, double f0, double f1, double f2, double f3,
    int32_t* out)
{
    gsm::ref::rankedTiers(n, hotness, tokens, nHot, hotIds, sinkTokens, fp16Window, f0, f1, f2, f3, out);
}

// ---- probes of gsm_math.h, so tests can compare the shared numerics with gsm/golden/quant.py ----
GSM_EXPORT void gsm_ref_f32_to_f16(float const* x, uint16_t* out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
    {
        out[i] = gsm::f32ToF16Bits(x[i]);
    }
}

GSM_EXPORT void gsm_ref_f16_to_f32(uint16_t const* x, float* out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i)
    {
        out[i] = gsm::f16BitsToF32(x[i]);
    }
}

// x [n, r], scale [r] -> codes [n, r]; qmax 2047 (INT12), 127 (INT8) or 7 (INT4)
GSM_EXPORT void gsm_ref_quantize(float const* x, float const* scale, int64_t n, int32_t r, int32_t qmax, int32_t* out)
{
    for (int64_t i = 0; i < n; ++i)
    {
        for (int32_t c = 0; c < r; ++c)
        {
            out[i * r + c] = gsm::quantize(x[i * r + c], scale[c], qmax);
        }
    }
}

// codes [n, r] -> values [n, r] by the rule of `tier` (1 INT12: comp unused; 2 INT8, 3 INT4: comp [r]).
// Returns 1 for another tier or a missing comp.
GSM_EXPORT int32_t gsm_ref_dequantize(
    int32_t const* q, float const* scale, float const* comp, int64_t n, int32_t r, int32_t tier, float* out)
{
    if (tier != gsm::kTierINT12 && tier != gsm::kTierINT8 && tier != gsm::kTierINT4)
    {
        return status(false, "dequantize: tier " + std::to_string(tier) + " has no codes (1 INT12, 2 INT8, 3 INT4)");
    }
    if (tier != gsm::kTierINT12 && comp == nullptr)
    {
        return status(false, "dequantize: the INT8 and INT4 rules add a compensation: comp is required");
    }
    for (int64_t i = 0; i < n; ++i)
    {
        for (int32_t c = 0; c < r; ++c)
        {
            int32_t const code = q[i * r + c];
            out[i * r + c] = tier == gsm::kTierINT12 ? gsm::dequantINT12(code, scale[c])
                : (tier == gsm::kTierINT8 ? gsm::dequantINT8(code, scale[c], comp[c])
                                          : gsm::dequantINT4(code, scale[c], comp[c]));
        }
    }
    return status(true, std::string());
}

// Data-free scales from s8 [n]: tier 1 the INT12 default, 3 the INT4 default; 1 for another tier.
GSM_EXPORT int32_t gsm_ref_default_scale(float const* s8, int64_t n, int32_t tier, float* out)
{
    if (tier != gsm::kTierINT12 && tier != gsm::kTierINT4)
    {
        return status(false, "default_scale: only INT12 (1) and INT4 (3) scales derive from s8");
    }
    for (int64_t i = 0; i < n; ++i)
    {
        out[i] = tier == gsm::kTierINT12 ? gsm::defaultScaleINT12(s8[i]) : gsm::defaultScaleINT4(s8[i]);
    }
    return status(true, std::string());
}

GSM_EXPORT void gsm_ref_pack_int12(int32_t const* q, int64_t n, uint8_t* out)
{
    for (int64_t p = 0; 2 * p < n; ++p)
    {
        gsm::packINT12Pair(q[2 * p], 2 * p + 1 < n ? q[2 * p + 1] : 0, out + 3 * p);
    }
}

GSM_EXPORT void gsm_ref_unpack_int12(uint8_t const* packed, int64_t n, int32_t* out)
{
    for (int64_t i = 0; i < n; ++i)
    {
        out[i] = gsm::unpackINT12(packed, static_cast<int32_t>(i));
    }
}

GSM_EXPORT void gsm_ref_pack_int4(int32_t const* q, int64_t n, uint8_t* out)
{
    for (int64_t p = 0; 2 * p < n; ++p)
    {
        out[p] = gsm::packINT4Pair(q[2 * p], 2 * p + 1 < n ? q[2 * p + 1] : 0);
    }
}

GSM_EXPORT void gsm_ref_unpack_int4(uint8_t const* packed, int64_t n, int32_t* out)
{
    for (int64_t i = 0; i < n; ++i)
    {
        out[i] = gsm::unpackINT4(packed, static_cast<int32_t>(i));
    }
}
