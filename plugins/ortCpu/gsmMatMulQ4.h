/*
 * gsmMatMulQ4.h: the math of the ONNX Runtime CPU op GsmMatMulQ4 (README.md here), on raw pointers.
 * A 4-bit weight on the float-zero-point grid (Q4_1's: w = scale * u + min per group of 32, u in 0..15), split as the
 * portable graph splits it, w = scale * (u - 8) + offset with offset = min + 8 * scale (builder/qlinear.py), times
 * float32 activations, the offset term included, in one pass over the weight:
 *   y[m, n] = sum_b ( float(sum_{k in b} (u[n, k] - 8) * xq[m, k]) * dx[m, b] * scale[n, b] + offset[n, b] * S[m, b] )
 * where, per row m and block b of 32 inputs, dx = max|x| / 127 (float32), xq = round-half-even(x * (1 / dx)) in int8
 * (MatMulNBits accuracy_level 4 quantises its activations so) and S = the float32 sum of the block's x. The codes are
 * centred (u - 8, as MatMulNBits' symmetric kernel takes them) because the activations' rounding error is multiplied
 * by them: on SmolLM2-like weights that halves the error against uncentred codes; the offset term sees exact sums.
 * Each output accumulates over b in that order with two fused multiply-adds per block, so every kernel (generic,
 * AVX2, AVX-512 VNNI) gives the same bits. Against MatMulNBits (symmetric part) + GsmGroupOffset (the offset term):
 * one node instead of two, and the group minima and scales are read beside the codes, not in a second pass.
 *
 * Weight layout ("tiles", builder/qlinear.py q4_tiles): rows in tiles of 16 (N padded with zero rows), K in blocks
 * of 32 (padded with zero codes), G = ceil(K / 32):
 *   codes [ceil(N/16), G, 4, 16, 4] uint8: byte (t, b, p, r, j) = u(16t+r, 32b+8p+j) | u(16t+r, 32b+8p+4+j) << 4
 *   scales, offsets [ceil(N/16), G, 16] float32 or float16
 * so one 64-byte load holds 8 inputs of 16 rows and its low / high nibbles multiply one broadcast 4-byte word of xq.
 */
#pragma once

#include <cstdint>

#include "gsmCachedAttention.h"

namespace gsm
{
namespace ortcpu
{

constexpr int64_t kQ4Block = 32;
constexpr int64_t kQ4TileRows = 16;

struct MatMulQ4Args
{
    int64_t M = 0, K = 0, N = 0;
    float const* x = nullptr;          // [M, K]
    uint8_t const* codes = nullptr;    // tiles (above)
    void const* scales = nullptr;      // [NT, G, 16] float32, or float16 bits when halfScales
    void const* offsets = nullptr;     // the same, halfOffsets
    bool halfScales = false, halfOffsets = false;
    float* y = nullptr;                // [M, N]
};

// y = x @ W^T (shapes are the caller's to check); false if the intra-op pool failed.
bool runMatMulQ4(MatMulQ4Args const& a, ParallelRunner const& par);

// Which kernel runMatMulQ4 uses on this CPU: "avx512vnni", "avx2" or "generic"; GSM_ORT_Q4_KERNEL=generic|avx2 picks a
// lower one (tests compare them).
char const* matMulQ4Kernel();

} // namespace ortcpu
} // namespace gsm
