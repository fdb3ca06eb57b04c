/*
 * gsmOrtKernels.h: the hot loops of GsmCachedAttention / GsmPoolAttention, GsmGroupOffset and GsmSideSplit,
 * compiled twice from gsmOrtKernels.inc: once for the build's baseline (NEON on aarch64, SSE2 on x86-64) and, on
 * x86-64, once for AVX2+FMA+F16C, chosen at run time from the CPU's features (cpuKernels()).
 * FMA contraction and blocked (multi-lane) sums are allowed here: this op is not bound by the plugins'
 * bit-exact contract, only by float32 agreement with the portable graph (which MLAS computes the same way).
 */
#pragma once

#include <cstdint>

namespace gsm
{
namespace ortcpu
{

struct Kernels
{
    char const* name;
    // out[i] = (sum_h w[h] * relu(iq[h] . key_i)) / sqrtDI for the n keys rows[i*dI ..] (float16 bits)
    void (*scores)(float const* iq, float const* w, int64_t nI, int64_t dI, float sqrtDI, uint16_t const* keys,
        int64_t n, float* out);
    // the same over INT8 key codes (iq already scaled per channel by the keys' scale)
    void (*scoresInt8)(float const* iq, float const* w, int64_t nI, int64_t dI, float sqrtDI, int8_t const* keys,
        int64_t n, float* out);
    // out[s] = (qh . (rows[s] + off)) / sqrtD over D, s < n
    void (*logits)(float const* qh, float const* const* rows, int64_t off, int64_t n, int64_t D, float sqrtD,
        float* out);
    // ctx[h*rv + i] = float(sum_s pd[s*nH + h] * double(lat[s][i])) for every head h < nH, i0 <= i < i1
    void (*ctxDecode)(double const* pd, int64_t nH, float const* const* lat, int64_t n, int64_t i0, int64_t i1,
        float* ctx, int64_t rv);
    // y[o] = sum_i W[o*r + i] * x[i], o < m
    void (*matvec)(float const* W, float const* x, int64_t m, int64_t r, float* y);
    // the same over float16 weights (bits, widened exactly; the sums of matvec in its order)
    void (*matvecHalf)(uint16_t const* W, float const* x, int64_t m, int64_t r, float* y);
    // out[d] = sum_s p[s] * rows[s][off + d], d < D (s ascending)
    void (*weightedRows)(float const* p, float const* const* rows, int64_t off, int64_t n, int64_t D, float* out);
    // GsmGroupOffset, columns n0 <= n < n1 of `rows` rows m (sums [rows, G]; main, res and y of row stride N):
    // y[m*N + n] = main[m*N + n] + sum_g sums[m*G + g] * O[g*N + n] (g ascending), then + res[m*N + n] when res is
    // not null
    void (*groupOffset)(float const* sums, int64_t rows, float const* O, int64_t G, int64_t N, int64_t n0, int64_t n1,
        float const* main, float const* res, float* y);
    // the same over float16 offsets (bits, widened exactly)
    void (*groupOffsetHalf)(float const* sums, int64_t rows, uint16_t const* O, int64_t G, int64_t N, int64_t n0,
        int64_t n1, float const* main, float const* res, float* y);
    // sums[g] = sum of x[g*block .. min(K, (g+1)*block)), g < ceil(K / block)
    void (*groupSums)(float const* x, int64_t K, int64_t block, float* sums);
    // GsmSideSplit: v = y[i] * s[i] rounded to float16 (nearest even), as float32 (halfRound) or as float16 bits
    // (halfStore), for i below the returned count, a multiple of the vector width (0 without F16C); the caller
    // converts the rest
    int64_t (*halfRound)(float const* y, float const* s, int64_t n, float* out);
    int64_t (*halfStore)(float const* y, float const* s, int64_t n, uint16_t* out);
    // GsmGroupOffset with swiglu: out[i] = silu(y[i]) * y[I + i] for i < I (silu(a) = a / (1 + exp(-a)))
    void (*swiglu)(float const* y, int64_t I, float* out);
    // out[i] = the float16 bits h[i] widened (exact), i < n
    void (*halfToFloat)(uint16_t const* h, int64_t n, float* out);
    // ys[j] = W xs[j] over W [m, r], j < nx: matvec(W, xs[j], m, r, ys[j]) bit for bit, four vectors per pass
    void (*matvecs)(float const* W, int64_t m, int64_t r, float const* const* xs, int64_t nx, float* const* ys);
    // out[i] = float(q[i]) * s[i] + c[i] with two roundings (gsm_math.h dequantINT8: no fused multiply-add), i < n
    void (*dequantInt8)(int8_t const* q, float const* s, float const* c, int64_t n, float* out);
    // the same over INT4 codes, two to a byte, low nibble first, sign-extended (dequantINT4)
    void (*dequantInt4)(uint8_t const* packed, float const* s, float const* c, int64_t n, float* out);
};

Kernels const& genericKernels();
#if defined(__x86_64__) || defined(_M_X64)
Kernels const& avx2Kernels();
#endif
// the best kernels this CPU runs (decided once)
Kernels const& cpuKernels();

} // namespace ortcpu
} // namespace gsm
