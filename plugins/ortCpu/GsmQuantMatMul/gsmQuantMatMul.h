/*
 * gsmQuantMatMul.h: the math of the ONNX Runtime CPU op GsmQuantMatMul (README.md here), on raw pointers.
 * A weight quantised per group of `block` inputs (a multiple of 32), w = scale * (u - z) [+ offset], u the stored
 * unsigned code and z its zero point (4-bit: 8, 8-bit: 128), times float32 activations in one pass over the weight:
 *   y[m, n] = sum_b ( float(sum_{k in b} (u[n, k] - z) * xq[m, k]) * dx[m, b] * scale[n, b] [+ offset[n, b] * S[m, b]] )
 * where, per row m and block b, dx = max|x| / 127 (float32), xq = round-half-even(x * (1 / dx)) in int8 (MatMulNBits
 * accuracy_level 4 quantises its activations so, per block of the weight's group) and S = the float32 sum of the
 * block's x (summed in 8 lanes, then pairwise: quantizeRow). The offset term is a float-zero-point (Q4_1) weight's:
 * the portable graph splits such a weight as scale * (u - 8) + offset, offset = min + 8 * scale (builder/qlinear.py),
 * and so does this op. Codes are centred (u - z) because the activations' rounding error is multiplied by them:
 * uncentred 4-bit codes doubled the error.
 * Each output accumulates over b in that order with one or two fused multiply-adds per block, so every kernel
 * (generic, AVX2, AVX-512 VNNI) gives the same bits.
 *
 * Weight layout ("tiles", builder/qlinear.py quant_tiles): rows in tiles of 16 (N padded with zero rows), K padded to
 * G = ceil(K / block) blocks, cut in sub-blocks of 32 inputs; per tile t and sub-block s (of S = G * block / 32):
 *   4-bit: 256 bytes [4][16][4], byte (p, r, j) = u(16t+r, 32s+8p+j) | u(16t+r, 32s+8p+4+j) << 4
 *   8-bit: 512 bytes [8][16][4], byte (p, r, j) = u(16t+r, 32s+4p+j)
 * so one 64-byte load holds 4 or 8 inputs of 16 rows and multiplies one broadcast 4-byte word of xq;
 *   scales, offsets [ceil(N/16), G, 16] float32 or float16 (offsets only for a float-zero-point weight).
 */
#pragma once

#include <cstdint>

#include "../common/gsmParallel.h"

namespace gsm
{
namespace ortcpu
{

constexpr int64_t kQTileRows = 16;
constexpr int64_t kQSubBlock = 32;

struct QuantMatMulArgs
{
    int64_t M = 0, K = 0, N = 0, bits = 4, block = 32;
    float const* x = nullptr;          // [M, K]
    uint8_t const* codes = nullptr;    // tiles (above)
    void const* scales = nullptr;      // [NT, G, 16] float32, or float16 bits when halfScales
    void const* offsets = nullptr;     // the same (halfOffsets), or null: no offset term
    bool halfScales = false, halfOffsets = false;
    float* y = nullptr;                // [M, N]
};

// Bytes of one tile's sub-block of 32 inputs.
constexpr int64_t quantSubBlockBytes(int64_t bits)
{
    return kQTileRows * kQSubBlock * bits / 8;
}

// Rows ids[m] of the tiled weight, dequantised: y[m, k] = float(u - z) * scale [+ offset] (one rounded product, one
// rounded sum: the portable graph's GatherBlockQuantized and Add give the same bits), so an embedding tied to an LM
// head stored as tiles is read from the head's own bytes. Returns -1, or the first m whose id is outside [0, N).
struct QuantGatherArgs
{
    int64_t M = 0, K = 0, N = 0, bits = 4, block = 32;
    int64_t const* ids = nullptr;      // [M]
    uint8_t const* codes = nullptr;    // tiles
    void const* scales = nullptr;      // as QuantMatMulArgs
    void const* offsets = nullptr;
    bool halfScales = false, halfOffsets = false;
    float* y = nullptr;                // [M, K]
};

int64_t gatherQuantRows(QuantGatherArgs const& a);

// y = x @ W^T (shapes, bits in {4, 8} and block a multiple of 32 are the caller's to check); false if the intra-op
// pool failed.
bool runQuantMatMul(QuantMatMulArgs const& a, ParallelRunner const& par);

// Which kernel runQuantMatMul uses on this CPU: "avx512vnni", "avx2" or "generic"; GSM_ORT_QMM_KERNEL=generic|avx2
// picks a lower one (tests compare them).
char const* quantMatMulKernel();

} // namespace ortcpu
} // namespace gsm
