/*
 * gsm_math.h: the numerics of the GSM latent cache and selection, written once.
 *
 * The contract is docs/decisions.md "Rounding" and gsm/golden/quant.py; docs/engine_io.md section 6
 * repeats it. Every engine (this CPU reference, the CUDA kernels, the TensorRT plugins) calls these
 * functions so that dequantised latents agree bit for bit with the golden model.
 *
 * Compiled by nvcc the functions are __host__ __device__; by a plain C++ compiler they are inline
 * host functions. Host code must be compiled without FMA contraction (-ffp-contract=off) and
 * without fast-math, because the contract fixes every float32 rounding step.
 */
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define GSM_HD __host__ __device__ __forceinline__
#else
#define GSM_HD inline
#endif

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace gsm
{

// Tier codes, ordered by precision lost: demotion only ever increases the code (gsm/tiers.py).
constexpr int32_t kTierFP16 = 0;
constexpr int32_t kTierINT12 = 1;
constexpr int32_t kTierINT8 = 2;
constexpr int32_t kTierINT4 = 3;
constexpr int32_t kQmaxINT12 = 2047;
constexpr int32_t kQmaxINT8 = 127;
constexpr int32_t kQmaxINT4 = 7; // symmetric like INT8: the code -8 is never produced

// ---------------------------------------------------------------------------------------------
// Bit casts (memcpy on the host is the only defined way; the device has intrinsics).
GSM_HD uint32_t floatBits(float x)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
#endif
}

GSM_HD float bitsFloat(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// ---------------------------------------------------------------------------------------------
// float32 -> float16 bits, round to nearest, ties to even (IEEE 754). The host version is written
// out because neither C++17 nor every host compiler has a half type; it reproduces
// torch.Tensor.half() (and __float2half_rn) for every input including subnormals, overflow to
// infinity and NaN (quieted, payload truncated).
GSM_HD uint16_t f32ToF16Bits(float x)
{
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(x));
#else
    uint32_t const u = floatBits(x);
    uint32_t const sign = (u >> 16) & 0x8000u;
    uint32_t const absu = u & 0x7FFFFFFFu;
    if (absu >= 0x7F800000u) // Inf or NaN
    {
        if (absu == 0x7F800000u)
        {
            return static_cast<uint16_t>(sign | 0x7C00u);
        }
        return static_cast<uint16_t>(sign | 0x7E00u | ((absu >> 13) & 0x3FFu));
    }
    if (absu >= 0x477FF000u) // >= 65520: rounds to infinity
    {
        return static_cast<uint16_t>(sign | 0x7C00u);
    }
    if (absu < 0x38800000u) // below the smallest normal half (2^-14): subnormal or zero
    {
        if (absu < 0x33000000u) // < 2^-25: rounds to zero (2^-25 itself is a tie to even 0)
        {
            return static_cast<uint16_t>(sign);
        }
        // value = mant * 2^(e-150) with the implicit bit; half subnormal unit is 2^-24.
        uint32_t const e = absu >> 23;
        uint32_t const mant = (absu & 0x7FFFFFu) | 0x800000u;
        uint32_t const shift = 126u - e; // 150 - 24 - e; in [14, 24] here
        uint32_t q = mant >> shift;
        uint32_t const rem = mant & ((1u << shift) - 1u);
        uint32_t const half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u)))
        {
            ++q;
        }
        return static_cast<uint16_t>(sign | q);
    }
    // normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits to even; a carry
    // out of the mantissa correctly bumps the exponent (up to infinity, excluded above).
    uint32_t v = absu - 0x38000000u; // exponent - 112, in the half's position after >> 13
    uint32_t const rem = v & 0x1FFFu;
    v >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (v & 1u)))
    {
        ++v;
    }
    return static_cast<uint16_t>(sign | v);
#endif
}

// float16 bits -> float32 (exact).
GSM_HD float f16BitsToF32(uint16_t h)
{
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    uint32_t const sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    uint32_t const e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0x1Fu)
    {
        return bitsFloat(sign | 0x7F800000u | (m << 13));
    }
    if (e == 0)
    {
        if (m == 0)
        {
            return bitsFloat(sign);
        }
        // subnormal: m * 2^-24, exact in float32
        int32_t ex = -1;
        do
        {
            ++ex;
            m <<= 1;
        } while ((m & 0x400u) == 0);
        return bitsFloat(sign | ((112u - static_cast<uint32_t>(ex)) << 23) | ((m & 0x3FFu) << 13));
    }
    return bitsFloat(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// The FP16 tier and deployed-mode rounding: float32(float16_rne(x)).
GSM_HD float roundFP16(float x)
{
    return f16BitsToF32(f32ToF16Bits(x));
}

// ---------------------------------------------------------------------------------------------
// Separately rounded float32 operations. nvcc would contract a*b+c into an FMA; the contract
// forbids it, so the device path names the rounding intrinsics. Host code relies on
// -ffp-contract=off (set by plugins/CMakeLists.txt).
GSM_HD float mulRN(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

GSM_HD float addRN(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

GSM_HD float divRN(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

// rint with ties to even (the default rounding mode on host and device; torch.round does the same).
GSM_HD float rintEven(float x)
{
#if defined(__CUDA_ARCH__)
    return rintf(x);
#else
    return std::nearbyint(x);
#endif
}

// INT12/INT8/INT4 code: clamp(rint_half_even(x / s), -qmax, qmax) with an IEEE float32 division.
// NaN latents are outside the contract (the golden's cast of NaN is implementation defined).
GSM_HD int32_t quantize(float x, float scale, int32_t qmax)
{
    float q = rintEven(divRN(x, scale));
    float const lim = static_cast<float>(qmax);
    q = q > lim ? lim : (q < -lim ? -lim : q);
    return static_cast<int32_t>(q);
}

GSM_HD float dequantINT12(int32_t q, float s12)
{
    return mulRN(static_cast<float>(q), s12);
}

GSM_HD float dequantINT8(int32_t q, float s8, float comp)
{
    return addRN(mulRN(static_cast<float>(q), s8), comp);
}

// The same two roundings as INT8, with the tier's own scale and compensation.
GSM_HD float dequantINT4(int32_t q, float s4, float comp4)
{
    return addRN(mulRN(static_cast<float>(q), s4), comp4);
}

// Default INT12 scale when calibration has none: float32(float32(s8 * 127) / 2047).
GSM_HD float defaultScaleINT12(float s8)
{
    return divRN(mulRN(s8, 127.0f), 2047.0f);
}

// Default INT4 scale when calibration has none: float32(float32(s8 * 127) / 7).
GSM_HD float defaultScaleINT4(float s8)
{
    return divRN(mulRN(s8, 127.0f), 7.0f);
}

// ---------------------------------------------------------------------------------------------
// INT12 packing: two 12-bit two's-complement codes a, b in three bytes
//   byte0 = a & 0xFF, byte1 = ((a >> 8) & 0xF) | ((b & 0xF) << 4), byte2 = (b >> 4) & 0xFF.
GSM_HD void packINT12Pair(int32_t a, int32_t b, uint8_t* out3)
{
    uint32_t const ua = static_cast<uint32_t>(a) & 0xFFFu;
    uint32_t const ub = static_cast<uint32_t>(b) & 0xFFFu;
    out3[0] = static_cast<uint8_t>(ua & 0xFFu);
    out3[1] = static_cast<uint8_t>(((ua >> 8) & 0x0Fu) | ((ub & 0x0Fu) << 4));
    out3[2] = static_cast<uint8_t>((ub >> 4) & 0xFFu);
}

GSM_HD int32_t signExtend12(uint32_t v)
{
    return v >= 2048u ? static_cast<int32_t>(v) - 4096 : static_cast<int32_t>(v);
}

// Code i of a packed INT12 array (i even: first of its pair).
GSM_HD int32_t unpackINT12(uint8_t const* packed, int32_t i)
{
    uint8_t const* p = packed + 3 * (i >> 1);
    uint32_t const v = (i & 1) ? ((static_cast<uint32_t>(p[1]) >> 4) | (static_cast<uint32_t>(p[2]) << 4))
                               : (static_cast<uint32_t>(p[0]) | ((static_cast<uint32_t>(p[1]) & 0x0Fu) << 8));
    return signExtend12(v);
}

// Bytes of n packed INT12 codes (odd counts padded with a zero code).
GSM_HD int32_t packedINT12Bytes(int32_t n)
{
    return 3 * ((n + 1) / 2);
}

// ---------------------------------------------------------------------------------------------
// INT4 packing: codes 2j and 2j + 1 in the low and high nibble of byte j, each as q & 0xF (4-bit
// two's complement).
GSM_HD uint8_t packINT4Pair(int32_t a, int32_t b)
{
    return static_cast<uint8_t>((static_cast<uint32_t>(a) & 0x0Fu) | ((static_cast<uint32_t>(b) & 0x0Fu) << 4));
}

// Code i of a packed INT4 array.
GSM_HD int32_t unpackINT4(uint8_t const* packed, int32_t i)
{
    uint32_t const byte = packed[i >> 1];
    uint32_t const v = (i & 1) ? (byte >> 4) : (byte & 0x0Fu);
    return v >= 8u ? static_cast<int32_t>(v) - 16 : static_cast<int32_t>(v);
}

// Bytes of n packed INT4 codes (odd counts padded with a zero code).
GSM_HD int32_t packedINT4Bytes(int32_t n)
{
    return (n + 1) / 2;
}

// ---------------------------------------------------------------------------------------------
// Selection order (spec 4.1, decisions "Selection ties"): a higher index score first, equal scores
// to the lower position. -0.0 == +0.0 here, as in the golden's stable sort.
GSM_HD bool selectsBefore(float scoreA, int32_t posA, float scoreB, int32_t posB)
{
    return scoreA > scoreB || (scoreA == scoreB && posA < posB);
}

// Monotone map float -> uint32 for radix selection (larger float -> larger key); -0.0 is folded
// into +0.0 so that the radix order agrees with selectsBefore on ties.
GSM_HD uint32_t orderedKey(float x)
{
    uint32_t const u = floatBits(x == 0.0f ? 0.0f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Spec 4.1: a query at position t attends densely when t + 1 <= sinks + window + top_k.
GSM_HD bool selectionIsDense(int32_t t, int32_t sinks, int32_t window, int32_t topK)
{
    return static_cast<int64_t>(t) + 1 <= static_cast<int64_t>(sinks) + window + topK;
}

} // namespace gsm
