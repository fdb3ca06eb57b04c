/*
 * CPU reference of the GSM latent cache (docs/engine_io.md 4.1, 4.3 and the runtime's tier policy).
 * It defines the results the CUDA kernels are tested against, and is what the ONNX Runtime backend
 * and the runtime call on the host.
 */
#pragma once

#include "../common/gsm_layout.h"

#include <cstdint>
#include <string>

namespace gsm
{
namespace ref
{

// GsmKVCacheUpdate: write the valid new rows (FP16, RNE) into the rows kv_slots names, and the
// indexer keys by position (FP16, or INT8 codes with d.indexKeyBits 8: key then holds the codes).
// ck [B,S,r_k], cv [B,S,r_v], key [B,S,dI] float32, kv_slots [B, N_max]; pool [R, poolWords] int32 and
// indexKeys [R, N_max, indexKeyBytes(d)] bytes, sequence b in row rows.of(b).
// Returns false and sets *err when a slot of a new position is not an FP16-tier row, a row is outside
// the pools or lengths are out of range.
bool kvCacheUpdate(GsmDims const& d, int32_t B, int32_t S, float const* ck, float const* cv, float const* key,
    int32_t* pool, void* indexKeys, int32_t const* slots, int32_t const* pastLengths,
    int32_t const* newLengths, CacheRows rows, std::string* err);

// GsmKVDemote: list [M,3] = (b, old slot entry, new slot entry). All sources are read before any
// destination is written; destination rows must be distinct. A demotion quantises the value the row
// holds (FP16, or INT12- / INT8-dequantised, compensation included); an unchanged tier moves the row.
// quant [5, r]: s12, s8, comp8, s4, comp4.
bool kvDemote(GsmDims const& d, int32_t B, int32_t M, int32_t const* list, int32_t* pool, float const* quant,
    std::string* err);

// Dequantised latents by position (tests, the ONNX Runtime backend, debugging): ck [B,N_max,r_k],
// cv [B,N_max,r_v]; positions whose slot is empty get NaN.
bool readLatents(GsmDims const& d, int32_t B, int32_t const* pool, int32_t const* slots, float const* quant,
    float* ck, float* cv, std::string* err);

// Hotness EMA of decisions "Hotness": h <- float32(decay)*h + float32(1 - decay)*m (each product
// and the sum rounded separately, as torch computes it).
void hotnessUpdate(int32_t n, float* hotness, float const* mass, double decay);

// Tier each position gets from its hotness rank alone (decisions "Re-tier pass"); the runtime
// applies max(old, ranked). tokens [n], hotIds [nHot]; f0..f3 the tier fractions (f3 = 0: no INT4 row);
// out [n] tier codes.
void rankedTiers(int32_t n, float const* hotness, int32_t const* tokens, int32_t nHot, int32_t const* hotIds,
    int32_t sinkTokens, int32_t fp16Window, double f0, double f1, double f2, double f3, int32_t* out);

} // namespace ref
} // namespace gsm
