// GsmQuantMatMul: activations quantised per row and block, then 16-row tiles on the intra-op pool; three kernels that
// give the same bits (gsmQuantMatMul.h): generic C++, AVX2 (maddubs) and AVX-512 VNNI (dpbusd), picked at run time.
#include "gsmQuantMatMul.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../common/gsm_math.h"

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12's AVX-512 conversion intrinsics start from _mm512_undefined_*: a false "may be used uninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define GSM_QMM_X86 1
#endif

namespace gsm
{
namespace ortcpu
{
namespace
{

// a decode call's tiles split into parts of at least this many multiply-adds (smaller ones cost the pool more
// than they save: SmolLM2 INT4 at 256 tokens on 2 threads, 6 alternating runs each with the weights prefetched and
// on large pages, 167.6-183.7 tok/s at 2^16, 163.2-174.7 at 2^17, 170.3-171.1 at 2^18 (3 runs), 163.0-169.6 at
// 2^15 (3); 1 thread the same); a prefill call's parts are kPrefillTiles tiles, every row group of the call through
// each
constexpr int64_t kPartWork = 1 << 16;
constexpr int64_t kPrefillTiles = 8;
// The x86 kernels ask for the codes this many bytes ahead of the sub-block they read: one row reads a matrix once,
// as one stream (tiles and sub-blocks lie in reading order), faster than the hardware prefetchers fetch it alone
// (SmolLM2's 121 decode projections in a chain, 1 thread: INT4 3.7-4.0 -> 2.3-2.9 ms, INT8 5.4-6.1 -> 4.2-4.8;
// 1 KB and 4 KB gained less, 16 KB no more; prefetching the scales and offsets as well made no difference)
constexpr int64_t kPrefetchBytes = 8192;

struct Ctx
{
    QuantMatMulArgs const* a;
    int64_t G, S, NT, partTiles;  // blocks, sub-blocks of 32 inputs, tiles, tiles a part
    int8_t const* xq;     // [M, S * 32]
    float const* dx;      // [M, G]
    float const* sums;    // [M, G]
    int32_t const* bias;  // [M, G]: -z * the block's sum of xq (the VNNI kernel's dot starts there: centred codes)
};

float param(void const* p, bool half, int64_t i)
{
    return half ? f16BitsToF32(static_cast<uint16_t const*>(p)[i]) : static_cast<float const*>(p)[i];
}

int32_t zeroPoint(int64_t bits)
{
    return bits == 4 ? 8 : 128;
}

#ifdef GSM_QMM_X86
// the same source for each ISA (ifunc by cpuid): lane-wise IEEE adds, maxima and products, nothing contracted, so every
// clone gives the same bits; AVX-512 made SmolLM2's rows (576 and 1,536 inputs) 3.6x faster than baseline x86-64
#define GSM_QMM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GSM_QMM_CLONES
#endif

// 1.5 * 2^23: (t + kRound) - kRound rounds t half to even (the default rounding mode) for |t| < 2^22, as nearbyint does
constexpr float kRound = 12582912.f;

// row m's int8 codes, scale, float32 sum and -z * code sum per block (padding inputs are code 0 and add nothing).
// The sum's order is part of the definition: 8 lanes (inputs k0 + j, k0 + j + 8, ...), then
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
GSM_QMM_CLONES void quantizeRow(float const* x, int64_t K, int64_t G, int64_t block, int32_t z, int8_t* q, float* dx,
    float* sums, int32_t* bias)
{
    for (int64_t b = 0; b < G; ++b)
    {
        int64_t const k0 = b * block, n = std::min(block, K - k0);
        float const* xb = x + k0;
        float lane[8] = {}, peak[8] = {}, pad[8];
        for (int64_t i = 0; i < block; i += 8)
        {
            float const* v = xb + i;
            if (i + 8 > n)  // the row's last inputs, zero-padded
            {
                for (int64_t j = 0; j < 8; ++j)
                {
                    pad[j] = i + j < n ? xb[i + j] : 0.f;
                }
                v = pad;
            }
            for (int j = 0; j < 8; ++j)
            {
                lane[j] += v[j];
                peak[j] = std::max(peak[j], std::fabs(v[j]));
            }
        }
        float amax = 0.f;
        for (float p : peak)
        {
            amax = std::max(amax, p);
        }
        float const d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
        int8_t* qb = q + k0;
        int32_t qs = 0;
        for (int64_t k = 0; k < n; ++k)
        {
            qb[k] = static_cast<int8_t>(static_cast<int32_t>((xb[k] * inv + kRound) - kRound));
            qs += qb[k];
        }
        for (int64_t k = n; k < block; ++k)
        {
            qb[k] = 0;
        }
        dx[b] = d;
        sums[b] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        bias[b] = -z * qs;
    }
}

void storeTile(QuantMatMulArgs const& a, int64_t m, int64_t t, float const* v)
{
    int64_t const n0 = t * kQTileRows, n = std::min(kQTileRows, a.N - n0);
    std::memcpy(a.y + m * a.N + n0, v, static_cast<size_t>(n) * sizeof(float));
}

// -- generic ----------------------------------------------------------------------------------------------------
// code of tile row r, input k of sub-block s (k < 32), from the sub-block's bytes
int32_t codeAt(uint8_t const* sb, int64_t bits, int64_t r, int64_t k)
{
    if (bits == 8)
    {
        return sb[(k / 4) * 64 + r * 4 + k % 4];
    }
    uint8_t const byte = sb[(k / 8) * 64 + r * 4 + k % 4];
    return k % 8 < 4 ? byte & 0x0F : byte >> 4;
}

void tilesGeneric(Ctx const& c, int64_t m0, int64_t m1, int64_t t0, int64_t t1)
{
    QuantMatMulArgs const& a = *c.a;
    int64_t const G = c.G, subs = a.block / kQSubBlock, sbBytes = quantSubBlockBytes(a.bits);
    int32_t const z = zeroPoint(a.bits);
    for (int64_t t = t0; t < t1; ++t)
    {
        for (int64_t m = m0; m < m1; ++m)
        {
            int8_t const* q = c.xq + m * c.S * kQSubBlock;
            float acc[kQTileRows] = {};
            for (int64_t b = 0; b < G; ++b)
            {
                for (int64_t r = 0; r < kQTileRows; ++r)
                {
                    int32_t dot = 0;
                    for (int64_t s = b * subs; s < (b + 1) * subs; ++s)
                    {
                        uint8_t const* sb = a.codes + (t * c.S + s) * sbBytes;
                        for (int64_t k = 0; k < kQSubBlock; ++k)
                        {
                            dot += (codeAt(sb, a.bits, r, k) - z) * q[s * kQSubBlock + k];
                        }
                    }
                    int64_t const i = (t * G + b) * kQTileRows + r;
                    float const main = static_cast<float>(dot) * c.dx[m * G + b];
                    acc[r] = std::fma(main, param(a.scales, a.halfScales, i), acc[r]);
                    if (a.offsets != nullptr)
                    {
                        acc[r] = std::fma(param(a.offsets, a.halfOffsets, i), c.sums[m * G + b], acc[r]);
                    }
                }
            }
            storeTile(a, m, t, acc);
        }
    }
}

#ifdef GSM_QMM_X86
// the first kPrefetchBytes of tile t0's codes: a part starts where the stream's prefetches have not reached (a decode
// step's ~150 projections each start cold: SmolLM2 at 256 tokens, 1 thread, 3 alternating runs, INT4 6.7-7.5 ->
// 6.3-7.0 ms a step, INT8 8.3-8.6 -> 8.2-8.5)
inline void prefetchStart(Ctx const& c, int64_t t0, int64_t sbBytes)
{
    for (int64_t o = 0; o < kPrefetchBytes; o += 64)
    {
        _mm_prefetch(reinterpret_cast<char const*>(c.a->codes + t0 * c.S * sbBytes + o), _MM_HINT_T0);
    }
}

// the sub-block kPrefetchBytes past the one at sb (sbBytes long), asked for as sb is read
inline void prefetchAhead(uint8_t const* sb, int64_t sbBytes)
{
    for (int64_t o = 0; o < sbBytes; o += 64)
    {
        _mm_prefetch(reinterpret_cast<char const*>(sb + kPrefetchBytes + o), _MM_HINT_T0);
    }
}

// -- AVX-512 VNNI: one tile's 16 rows in one register, up to 4 activation rows sharing each code load -----------
#define GSM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

GSM_VNNI inline __m512 loadParams16(void const* p, bool half, int64_t i)
{
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(static_cast<uint16_t const*>(p) + i)))
                : _mm512_loadu_ps(static_cast<float const*>(p) + i);
}

template <int BITS, int R>
GSM_VNNI void tilesVnniR(Ctx const& c, int64_t m0, int64_t t0, int64_t t1)
{
    QuantMatMulArgs const& a = *c.a;
    int64_t const G = c.G, subs = a.block / kQSubBlock;
    constexpr int64_t sbBytes = quantSubBlockBytes(BITS);
    __m512i const low = _mm512_set1_epi8(0x0F);
    int32_t const* w[R];
    for (int r = 0; r < R; ++r)
    {
        w[r] = reinterpret_cast<int32_t const*>(c.xq + (m0 + r) * c.S * kQSubBlock);
    }
    prefetchStart(c, t0, sbBytes);
    for (int64_t t = t0; t < t1; ++t)
    {
        __m512 acc[R];
        for (int r = 0; r < R; ++r)
        {
            acc[r] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < G; ++b)
        {
            __m512i d[R];
            for (int r = 0; r < R; ++r)
            {
                d[r] = _mm512_set1_epi32(c.bias[(m0 + r) * G + b]);
            }
            for (int64_t s = b * subs; s < (b + 1) * subs; ++s)
            {
                uint8_t const* sb = a.codes + (t * c.S + s) * sbBytes;
                prefetchAhead(sb, sbBytes);
                __m512i v[8];  // the sub-block's 8 words of 16 rows: inputs 4p .. 4p + 3 in v[p]
                if constexpr (BITS == 4)
                {
                    for (int p = 0; p < 4; ++p)
                    {
                        __m512i const raw = _mm512_loadu_si512(sb + 64 * p);
                        v[2 * p] = _mm512_and_si512(raw, low);
                        v[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    }
                }
                else
                {
                    for (int p = 0; p < 8; ++p)
                    {
                        v[p] = _mm512_loadu_si512(sb + 64 * p);
                    }
                }
                for (int r = 0; r < R; ++r)
                {
                    int32_t const* ws = w[r] + s * 8;
                    for (int p = 0; p < 8; ++p)
                    {
                        d[r] = _mm512_dpbusd_epi32(d[r], v[p], _mm512_set1_epi32(ws[p]));
                    }
                }
            }
            int64_t const i = (t * G + b) * kQTileRows;
            __m512 const sc = loadParams16(a.scales, a.halfScales, i);
            for (int r = 0; r < R; ++r)
            {
                int64_t const mb = (m0 + r) * G + b;
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d[r]), _mm512_set1_ps(c.dx[mb])), sc, acc[r]);
            }
            if (a.offsets != nullptr)
            {
                __m512 const off = loadParams16(a.offsets, a.halfOffsets, i);
                for (int r = 0; r < R; ++r)
                {
                    acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(c.sums[(m0 + r) * G + b]), acc[r]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
        {
            alignas(64) float out[kQTileRows];
            _mm512_store_ps(out, acc[r]);
            storeTile(a, m0 + r, t, out);
        }
    }
}

struct Vnni
{
    template <int BITS, int R>
    static void run(Ctx const& c, int64_t m0, int64_t t0, int64_t t1)
    {
        tilesVnniR<BITS, R>(c, m0, t0, t1);
    }
};

// -- AVX2: a tile as two registers of 8 rows. maddubs multiplies u8 by s8 in saturating pairs: 4-bit codes as they
// are (at most 2 * 15 * 127), 8-bit ones centred first (|u - 128| by sign(xq, u - 128), at most 2 * 128 * 127) ----
#define GSM_AVX2 __attribute__((target("avx2,fma,f16c")))

GSM_AVX2 inline __m256 loadParams8(void const* p, bool half, int64_t i)
{
    return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(static_cast<uint16_t const*>(p) + i)))
                : _mm256_loadu_ps(static_cast<float const*>(p) + i);
}

template <int BITS, int R>
GSM_AVX2 void tilesAvx2R(Ctx const& c, int64_t m0, int64_t t0, int64_t t1)
{
    QuantMatMulArgs const& a = *c.a;
    int64_t const G = c.G, subs = a.block / kQSubBlock;
    constexpr int64_t sbBytes = quantSubBlockBytes(BITS);
    __m256i const low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
    int32_t const* w[R];
    for (int r = 0; r < R; ++r)
    {
        w[r] = reinterpret_cast<int32_t const*>(c.xq + (m0 + r) * c.S * kQSubBlock);
    }
    prefetchStart(c, t0, sbBytes);
    for (int64_t t = t0; t < t1; ++t)
    {
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r)
        {
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < G; ++b)
        {
            int64_t const i = (t * G + b) * kQTileRows;
            for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7: bytes 32h .. 32h + 31 of each 64-byte word group
            {
                __m256i d[R];
                for (int r = 0; r < R; ++r)
                {
                    d[r] = BITS == 4 ? _mm256_set1_epi32(c.bias[(m0 + r) * G + b]) : _mm256_setzero_si256();
                }
                for (int64_t s = b * subs; s < (b + 1) * subs; ++s)
                {
                    uint8_t const* sb = a.codes + (t * c.S + s) * sbBytes + 32 * h;
                    if (h == 0)  // the second half row group reads the same lines
                    {
                        prefetchAhead(sb, sbBytes);
                    }
                    __m256i v[8];
                    if constexpr (BITS == 4)
                    {
                        for (int p = 0; p < 4; ++p)
                        {
                            __m256i const raw = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(sb + 64 * p));
                            v[2 * p] = _mm256_and_si256(raw, low);
                            v[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                        }
                    }
                    else
                    {
                        for (int p = 0; p < 8; ++p)
                        {
                            v[p] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(sb + 64 * p)), flip);
                        }
                    }
                    for (int r = 0; r < R; ++r)
                    {
                        int32_t const* ws = w[r] + s * 8;
                        for (int p = 0; p < 8; ++p)
                        {
                            __m256i const xw = _mm256_set1_epi32(ws[p]);
                            __m256i const prod = BITS == 4
                                ? _mm256_maddubs_epi16(v[p], xw)
                                : _mm256_maddubs_epi16(_mm256_sign_epi8(v[p], v[p]), _mm256_sign_epi8(xw, v[p]));
                            d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(prod, ones));
                        }
                    }
                }
                __m256 const sc = loadParams8(a.scales, a.halfScales, i + 8 * h);
                for (int r = 0; r < R; ++r)
                {
                    int64_t const mb = (m0 + r) * G + b;
                    acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d[r]), _mm256_set1_ps(c.dx[mb])), sc,
                        acc[r][h]);
                }
                if (a.offsets != nullptr)
                {
                    __m256 const off = loadParams8(a.offsets, a.halfOffsets, i + 8 * h);
                    for (int r = 0; r < R; ++r)
                    {
                        acc[r][h] = _mm256_fmadd_ps(off, _mm256_set1_ps(c.sums[(m0 + r) * G + b]), acc[r][h]);
                    }
                }
            }
        }
        for (int r = 0; r < R; ++r)
        {
            alignas(32) float out[kQTileRows];
            _mm256_store_ps(out, acc[r][0]);
            _mm256_store_ps(out + 8, acc[r][1]);
            storeTile(a, m0 + r, t, out);
        }
    }
}

struct Avx2
{
    template <int BITS, int R>
    static void run(Ctx const& c, int64_t m0, int64_t t0, int64_t t1)
    {
        tilesAvx2R<BITS, R>(c, m0, t0, t1);
    }
};

// rows m0 .. m1 in groups of up to 4 through kernel family Kn (Kn::run<BITS, R>), tiles t0 .. t1
template <class Kn, int BITS>
void byRowGroups(Ctx const& c, int64_t m0, int64_t m1, int64_t t0, int64_t t1)
{
    for (int64_t m = m0; m < m1; m += 4)
    {
        switch (std::min<int64_t>(4, m1 - m))
        {
        case 1: Kn::template run<BITS, 1>(c, m, t0, t1); break;
        case 2: Kn::template run<BITS, 2>(c, m, t0, t1); break;
        case 3: Kn::template run<BITS, 3>(c, m, t0, t1); break;
        default: Kn::template run<BITS, 4>(c, m, t0, t1); break;
        }
    }
}

template <class Kn>
void tilesOf(Ctx const& c, int64_t m0, int64_t m1, int64_t t0, int64_t t1)
{
    (c.a->bits == 4 ? byRowGroups<Kn, 4> : byRowGroups<Kn, 8>)(c, m0, m1, t0, t1);
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
    char const* want = std::getenv("GSM_ORT_QMM_KERNEL");
    std::string const w = want != nullptr ? want : "";
#ifdef GSM_QMM_X86
    __builtin_cpu_init();
    bool const avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    bool const vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    if (vnni && w != "generic" && w != "avx2")
    {
        return {tilesOf<Vnni>, "avx512vnni"};
    }
    if (avx2 && w != "generic")
    {
        return {tilesOf<Avx2>, "avx2"};
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

int64_t gatherQuantRows(QuantGatherArgs const& a)
{
    int64_t const G = (a.K + a.block - 1) / a.block, S = G * a.block / kQSubBlock;
    int64_t const sbBytes = quantSubBlockBytes(a.bits);
    int32_t const z = zeroPoint(a.bits);
    for (int64_t m = 0; m < a.M; ++m)
    {
        int64_t const id = a.ids[m];
        if (id < 0 || id >= a.N)
        {
            return m;
        }
        int64_t const t = id / kQTileRows, r = id % kQTileRows;
        float* y = a.y + m * a.K;
        for (int64_t k = 0; k < a.K; ++k)
        {
            int64_t const s = k / kQSubBlock, i = (t * G + k / a.block) * kQTileRows + r;
            float const w = static_cast<float>(codeAt(a.codes + (t * S + s) * sbBytes, a.bits, r, k % kQSubBlock) - z)
                * param(a.scales, a.halfScales, i);
            y[k] = a.offsets != nullptr ? w + param(a.offsets, a.halfOffsets, i) : w;
        }
    }
    return -1;
}

char const* quantMatMulKernel()
{
    return choice().name;
}

bool runQuantMatMul(QuantMatMulArgs const& a, ParallelRunner const& par)
{
    int64_t const G = (a.K + a.block - 1) / a.block, S = G * a.block / kQSubBlock;
    int64_t const NT = (a.N + kQTileRows - 1) / kQTileRows;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> dx, sums;
    static thread_local std::vector<int32_t> bias;
    xq.resize(static_cast<size_t>(a.M * S * kQSubBlock));
    dx.resize(static_cast<size_t>(a.M * G));
    sums.resize(static_cast<size_t>(a.M * G));
    bias.resize(static_cast<size_t>(a.M * G));
    for (int64_t m = 0; m < a.M; ++m)
    {
        quantizeRow(a.x + m * a.K, a.K, G, a.block, zeroPoint(a.bits), xq.data() + m * S * kQSubBlock,
            dx.data() + m * G, sums.data() + m * G, bias.data() + m * G);
    }
    int64_t const work = a.M * a.N * a.K;
    int64_t partTiles = NT;
    if (par.run != nullptr && work >= 2 * kPartWork)
    {
        partTiles = a.M <= 4 ? std::max<int64_t>(1, NT / std::min<int64_t>(NT, work / kPartWork)) : kPrefillTiles;
    }
    Ctx c{&a, G, S, NT, partTiles, xq.data(), dx.data(), sums.data(), bias.data()};
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
