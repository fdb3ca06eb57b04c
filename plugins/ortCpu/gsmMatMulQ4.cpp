// GsmMatMulQ4: activations quantised per row and block, then 16-row tiles on the intra-op pool; three kernels that
// give the same bits (gsmMatMulQ4.h): generic C++, AVX2 (maddubs) and AVX-512 VNNI (dpbusd), picked at run time.
#include "gsmMatMulQ4.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12's AVX-512 conversion intrinsics start from _mm512_undefined_*: a false "may be used uninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define GSM_Q4_X86 1
#endif

namespace gsm
{
namespace ortcpu
{
namespace
{

constexpr int64_t kTileBytes = kQ4TileRows * kQ4Block / 2;  // 256: one block of one tile
// a decode call's tiles split into parts of at least this many multiply-adds (smaller ones cost the pool more
// than they save); a prefill call's parts are kPrefillTiles tiles, every row group of the call through each
constexpr int64_t kPartWork = 1 << 18;
constexpr int64_t kPrefillTiles = 8;

struct Ctx
{
    MatMulQ4Args const* a;
    int64_t G, NT, partTiles;
    int8_t const* xq;   // [M, G * 32]
    float const* dx;    // [M, G]
    float const* sums;  // [M, G]
    int32_t const* bias;  // [M, G]: -8 * the block's sum of xq, where the centred dot product starts
};

float halfToFloat(uint16_t h)
{
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1Fu)
    {
        bits = sign | 0x7F800000u | (man << 13);
    }
    else if (exp != 0)
    {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    else if (man == 0)
    {
        bits = sign;
    }
    else  // subnormal: normalise
    {
        exp = 113u;
        while ((man & 0x400u) == 0)
        {
            man <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

float param(void const* p, bool half, int64_t i)
{
    return half ? halfToFloat(static_cast<uint16_t const*>(p)[i]) : static_cast<float const*>(p)[i];
}

// row m's int8 codes, scale, float32 sum and -8 * code sum per block (padding inputs are code 0 and add nothing)
void quantizeRow(float const* x, int64_t K, int64_t G, int8_t* q, float* dx, float* sums, int32_t* bias)
{
    for (int64_t b = 0; b < G; ++b)
    {
        int64_t const k0 = b * kQ4Block, k1 = std::min(K, k0 + kQ4Block);
        float amax = 0.f, s = 0.f;
        for (int64_t k = k0; k < k1; ++k)
        {
            amax = std::max(amax, std::fabs(x[k]));
            s += x[k];
        }
        float const d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
        int32_t qs = 0;
        for (int64_t k = k0; k < k0 + kQ4Block; ++k)
        {
            q[k] = k < k1 ? static_cast<int8_t>(std::nearbyint(x[k] * inv)) : 0;
            qs += q[k];
        }
        dx[b] = d;
        sums[b] = s;
        bias[b] = -8 * qs;
    }
}

void storeTile(MatMulQ4Args const& a, int64_t m, int64_t t, float const* v)
{
    int64_t const n0 = t * kQ4TileRows, n = std::min(kQ4TileRows, a.N - n0);
    std::memcpy(a.y + m * a.N + n0, v, static_cast<size_t>(n) * sizeof(float));
}

// -- generic ----------------------------------------------------------------------------------------------------
void tilesGeneric(Ctx const& c, int64_t m0, int64_t m1, int64_t t0, int64_t t1)
{
    MatMulQ4Args const& a = *c.a;
    int64_t const G = c.G;
    for (int64_t t = t0; t < t1; ++t)
    {
        uint8_t const* codes = a.codes + t * G * kTileBytes;
        for (int64_t m = m0; m < m1; ++m)
        {
            int8_t const* q = c.xq + m * G * kQ4Block;
            float acc[kQ4TileRows] = {};
            for (int64_t b = 0; b < G; ++b)
            {
                uint8_t const* cb = codes + b * kTileBytes;
                for (int64_t r = 0; r < kQ4TileRows; ++r)
                {
                    int32_t dot = c.bias[m * G + b];
                    for (int64_t p = 0; p < 4; ++p)
                    {
                        for (int64_t j = 0; j < 4; ++j)
                        {
                            uint8_t const u = cb[p * 64 + r * 4 + j];
                            dot += static_cast<int32_t>(u & 0x0F) * q[b * kQ4Block + 8 * p + j];
                            dot += static_cast<int32_t>(u >> 4) * q[b * kQ4Block + 8 * p + 4 + j];
                        }
                    }
                    int64_t const i = (t * G + b) * kQ4TileRows + r;
                    float const main = static_cast<float>(dot) * c.dx[m * G + b];
                    acc[r] = std::fma(main, param(a.scales, a.halfScales, i), acc[r]);
                    acc[r] = std::fma(param(a.offsets, a.halfOffsets, i), c.sums[m * G + b], acc[r]);
                }
            }
            storeTile(a, m, t, acc);
        }
    }
}

#ifdef GSM_Q4_X86
// -- AVX-512 VNNI: one tile's 16 rows in one register, up to 4 activation rows sharing each code expansion -------
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"))) void tilesVnniR(
    Ctx const& c, int64_t m0, int64_t t0, int64_t t1)
{
    MatMulQ4Args const& a = *c.a;
    int64_t const G = c.G;
    __m512i const low = _mm512_set1_epi8(0x0F);
    int32_t const* w[R];
    for (int r = 0; r < R; ++r)
    {
        w[r] = reinterpret_cast<int32_t const*>(c.xq + (m0 + r) * G * kQ4Block);
    }
    for (int64_t t = t0; t < t1; ++t)
    {
        uint8_t const* codes = a.codes + t * G * kTileBytes;
        __m512 acc[R];
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < G; ++b)
        {
            __m512i lo[4], hi[4];
            for (int p = 0; p < 4; ++p)
            {
                __m512i const v = _mm512_loadu_si512(codes + b * kTileBytes + 64 * p);
                lo[p] = _mm512_and_si512(v, low);
                hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            int64_t const i = (t * G + b) * kQ4TileRows;
            __m512 const s = a.halfScales
                ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(static_cast<uint16_t const*>(a.scales) + i)))
                : _mm512_loadu_ps(static_cast<float const*>(a.scales) + i);
            __m512 const off = a.halfOffsets
                ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(static_cast<uint16_t const*>(a.offsets) + i)))
                : _mm512_loadu_ps(static_cast<float const*>(a.offsets) + i);
            for (int r = 0; r < R; ++r)
            {
                int32_t const* wb = w[r] + b * 8;
                int64_t const mb = (m0 + r) * G + b;
                __m512i d = _mm512_dpbusd_epi32(_mm512_set1_epi32(c.bias[mb]), lo[0], _mm512_set1_epi32(wb[0]));
                d = _mm512_dpbusd_epi32(d, hi[0], _mm512_set1_epi32(wb[1]));
                d = _mm512_dpbusd_epi32(d, lo[1], _mm512_set1_epi32(wb[2]));
                d = _mm512_dpbusd_epi32(d, hi[1], _mm512_set1_epi32(wb[3]));
                d = _mm512_dpbusd_epi32(d, lo[2], _mm512_set1_epi32(wb[4]));
                d = _mm512_dpbusd_epi32(d, hi[2], _mm512_set1_epi32(wb[5]));
                d = _mm512_dpbusd_epi32(d, lo[3], _mm512_set1_epi32(wb[6]));
                d = _mm512_dpbusd_epi32(d, hi[3], _mm512_set1_epi32(wb[7]));
                __m512 const main = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(c.dx[mb]));
                acc[r] = _mm512_fmadd_ps(main, s, acc[r]);
                acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(c.sums[mb]), acc[r]);
            }
        }
        for (int r = 0; r < R; ++r)
        {
            alignas(64) float v[kQ4TileRows];
            _mm512_store_ps(v, acc[r]);
            storeTile(a, m0 + r, t, v);
        }
    }
}

void tilesVnni(Ctx const& c, int64_t m0, int64_t m1, int64_t t0, int64_t t1)
{
    for (int64_t m = m0; m < m1; m += 4)
    {
        switch (std::min<int64_t>(4, m1 - m))
        {
        case 1: tilesVnniR<1>(c, m, t0, t1); break;
        case 2: tilesVnniR<2>(c, m, t0, t1); break;
        case 3: tilesVnniR<3>(c, m, t0, t1); break;
        default: tilesVnniR<4>(c, m, t0, t1); break;
        }
    }
}

// -- AVX2: a tile as two registers of 8 rows; u8 x s8 pairs by maddubs (at most 2 * 15 * 127, no saturation) ----
template <int R>
__attribute__((target("avx2,fma,f16c"))) void tilesAvx2R(Ctx const& c, int64_t m0, int64_t t0, int64_t t1)
{
    MatMulQ4Args const& a = *c.a;
    int64_t const G = c.G;
    __m256i const low = _mm256_set1_epi8(0x0F);
    __m256i const ones = _mm256_set1_epi16(1);
    int32_t const* w[R];
    for (int r = 0; r < R; ++r)
    {
        w[r] = reinterpret_cast<int32_t const*>(c.xq + (m0 + r) * G * kQ4Block);
    }
    for (int64_t t = t0; t < t1; ++t)
    {
        uint8_t const* codes = a.codes + t * G * kTileBytes;
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r)
        {
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < G; ++b)
        {
            int64_t const i = (t * G + b) * kQ4TileRows;
            for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7: bytes 32h .. 32h + 31 of each 64-byte group
            {
                __m256i lo[4], hi[4];
                for (int p = 0; p < 4; ++p)
                {
                    __m256i const v = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(codes + b * kTileBytes + 64 * p + 32 * h));
                    lo[p] = _mm256_and_si256(v, low);
                    hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                __m256 const s = a.halfScales
                    ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(static_cast<uint16_t const*>(a.scales) + i + 8 * h)))
                    : _mm256_loadu_ps(static_cast<float const*>(a.scales) + i + 8 * h);
                __m256 const off = a.halfOffsets
                    ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(static_cast<uint16_t const*>(a.offsets) + i + 8 * h)))
                    : _mm256_loadu_ps(static_cast<float const*>(a.offsets) + i + 8 * h);
                for (int r = 0; r < R; ++r)
                {
                    int32_t const* wb = w[r] + b * 8;
                    int64_t const mb = (m0 + r) * G + b;
                    __m256i d = _mm256_set1_epi32(c.bias[mb]);
                    for (int p = 0; p < 4; ++p)
                    {
                        d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(lo[p], _mm256_set1_epi32(wb[2 * p])), ones));
                        d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(hi[p], _mm256_set1_epi32(wb[2 * p + 1])), ones));
                    }
                    __m256 const main = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(c.dx[mb]));
                    acc[r][h] = _mm256_fmadd_ps(main, s, acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(off, _mm256_set1_ps(c.sums[mb]), acc[r][h]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
        {
            alignas(32) float v[kQ4TileRows];
            _mm256_store_ps(v, acc[r][0]);
            _mm256_store_ps(v + 8, acc[r][1]);
            storeTile(a, m0 + r, t, v);
        }
    }
}

void tilesAvx2(Ctx const& c, int64_t m0, int64_t m1, int64_t t0, int64_t t1)
{
    for (int64_t m = m0; m < m1; m += 4)
    {
        switch (std::min<int64_t>(4, m1 - m))
        {
        case 1: tilesAvx2R<1>(c, m, t0, t1); break;
        case 2: tilesAvx2R<2>(c, m, t0, t1); break;
        case 3: tilesAvx2R<3>(c, m, t0, t1); break;
        default: tilesAvx2R<4>(c, m, t0, t1); break;
        }
    }
}
#endif

using TilesFn = void (*)(Ctx const&, int64_t, int64_t, int64_t, int64_t);

struct Choice
{
    TilesFn fn;
    char const* name;
};

Choice pick()
{
    char const* want = std::getenv("GSM_ORT_Q4_KERNEL");
    std::string const w = want != nullptr ? want : "";
#ifdef GSM_Q4_X86
    __builtin_cpu_init();
    bool const avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    bool const vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    if (vnni && w != "generic" && w != "avx2")
    {
        return {tilesVnni, "avx512vnni"};
    }
    if (avx2 && w != "generic")
    {
        return {tilesAvx2, "avx2"};
    }
#endif
    return {tilesGeneric, "generic"};
}

Choice const& choice()
{
    static Choice const c = pick();
    return c;
}

void part(void* data, size_t i)
{
    Ctx const& c = *static_cast<Ctx const*>(data);
    int64_t const t0 = static_cast<int64_t>(i) * c.partTiles, t1 = std::min(c.NT, t0 + c.partTiles);
    choice().fn(c, 0, c.a->M, t0, t1);
}

} // namespace

char const* matMulQ4Kernel()
{
    return choice().name;
}

bool runMatMulQ4(MatMulQ4Args const& a, ParallelRunner const& par)
{
    int64_t const G = (a.K + kQ4Block - 1) / kQ4Block, NT = (a.N + kQ4TileRows - 1) / kQ4TileRows;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> dx, sums;
    static thread_local std::vector<int32_t> bias;
    xq.resize(static_cast<size_t>(a.M * G * kQ4Block));
    dx.resize(static_cast<size_t>(a.M * G));
    sums.resize(static_cast<size_t>(a.M * G));
    bias.resize(static_cast<size_t>(a.M * G));
    for (int64_t m = 0; m < a.M; ++m)
    {
        quantizeRow(a.x + m * a.K, a.K, G, xq.data() + m * G * kQ4Block, dx.data() + m * G, sums.data() + m * G,
            bias.data() + m * G);
    }
    int64_t const work = a.M * a.N * a.K;
    int64_t partTiles = NT;
    if (par.run != nullptr && work >= 2 * kPartWork)
    {
        partTiles = a.M <= 4 ? std::max<int64_t>(1, NT / std::min<int64_t>(NT, work / kPartWork)) : kPrefillTiles;
    }
    Ctx c{&a, G, NT, partTiles, xq.data(), dx.data(), sums.data(), bias.data()};
    int64_t const parts = (NT + partTiles - 1) / partTiles;
    if (parts == 1)
    {
        part(&c, 0);
        return true;
    }
    return par.run(par.ctx, part, static_cast<size_t>(parts), &c);
}

} // namespace ortcpu
} // namespace gsm
