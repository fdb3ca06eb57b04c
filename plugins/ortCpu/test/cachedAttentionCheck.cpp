/*
 * cachedAttentionCheck: runs GsmCachedAttention's raw-pointer API (gsmCachedAttention.h, no ONNX Runtime) on
 * fixed pseudo-random inputs for several geometries and writes every output to one file, so that the builds of
 * the kernels for different ISAs (x86 AVX2, x86 baseline, aarch64 NEON under qemu) can be compared on the same
 * inputs: scripts/check_ortcpu_aarch64.sh builds it three ways, plugins/ortCpu/test/compare_outputs.py compares.
 *
 * Inputs come from an integer xorshift generator only (no libm, no std::random distributions): uniform floats
 * are k * 2^-23 and float16 keys are drawn as bit patterns, so they are bit-identical on every target.
 * RoPE tables are random values in [-1, 1) too (the op only multiplies by them; std::cos could differ between
 * the targets' libm builds).
 *
 * Besides the op's four outputs it writes each case's index scores (hidden behind the selection otherwise) and
 * every finite float16 decoded by the kernels (half_decode/dI8, /dI12 as int32 bits: compared exactly).
 *
 * Output file: "GSMCHK1\n", "kernels <name>\n", then per tensor a line "<case>/<tensor> <f4|i4> <ndim> <dims...>\n"
 * followed by its little-endian bytes.
 *
 * Usage: cachedAttentionCheck OUT_FILE   (GSM_ORT_KERNELS=baseline picks the baseline kernels on x86)
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "GsmCachedAttention/gsmCachedAttention.h" // from the -I folder: scripts/check_ortcpu_aarch64.sh may point it at a scratch copy
#include "kernels/gsmOrtKernels.h"

namespace
{

using gsm::ortcpu::CachedAttentionDims;
using gsm::ortcpu::CachedAttentionInputs;
using gsm::ortcpu::CachedAttentionOutputs;

struct Rng
{
    uint64_t s;
    explicit Rng(uint64_t seed)
        : s(seed * 0x9E3779B97F4A7C15ull + 1)
    {
    }
    uint64_t next() // xorshift64*
    {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        return s * 0x2545F4914F6CDD1Dull;
    }
    float uniform() // [-1, 1), a multiple of 2^-23: exact
    {
        return static_cast<float>(static_cast<int32_t>(next() >> 40)) * (1.0f / 8388608.0f) - 1.0f;
    }
    uint16_t half() // float16 bits, magnitudes 2^-5..2^1 with a few subnormals and signed zeros
    {
        uint64_t const r = next();
        uint32_t const sign = static_cast<uint32_t>(r >> 63) << 15;
        uint32_t const m = static_cast<uint32_t>(r >> 20) & 0x3FFu;
        uint32_t const pick = static_cast<uint32_t>(r & 63u);
        uint32_t e = 10u + static_cast<uint32_t>((r >> 8) % 6u);
        if (pick == 0)
        {
            e = 0; // subnormal (or zero when m == 0)
        }
        if (pick == 1)
        {
            return static_cast<uint16_t>(sign); // +-0
        }
        return static_cast<uint16_t>(sign | (e << 10) | m);
    }
};

struct Case
{
    char const* name;
    int64_t nH, nKV, D, nI, dI, rk, rv; // geometry
    int64_t R, N, sinks, S;
    int32_t window;
    std::vector<int32_t> past, fresh, topK; // per sequence: past length, new length, top-k
    bool zeroW;                             // every index weight +-0: all candidate scores tie at 0
};

std::vector<float> floats(Rng& g, int64_t n, float scale = 1.0f)
{
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v)
    {
        x = g.uniform() * scale; // scale a power of two: exact
    }
    return v;
}

std::vector<uint16_t> halves(Rng& g, int64_t n)
{
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (uint16_t& x : v)
    {
        x = g.half();
    }
    return v;
}

struct Writer
{
    FILE* f;
    template <class T>
    void tensor(std::string const& name, char const* dtype, std::vector<int64_t> const& dims, T const* data)
    {
        int64_t n = 1;
        std::fprintf(f, "%s %s %zu", name.c_str(), dtype, dims.size());
        for (int64_t d : dims)
        {
            std::fprintf(f, " %lld", static_cast<long long>(d));
            n *= d;
        }
        std::fputc('\n', f);
        std::fwrite(data, sizeof(T), static_cast<size_t>(n), f);
    }
};

bool runCase(Case const& c, uint64_t seed, Writer& w)
{
    Rng g(seed);
    int64_t const B = static_cast<int64_t>(c.past.size()), S = c.S, kvD = c.nKV * c.D;
    CachedAttentionDims d;
    d.B = B;
    d.S = S;
    d.nH = c.nH;
    d.nKV = c.nKV;
    d.D = c.D;
    d.nI = c.nI;
    d.dI = c.dI;
    d.rk = c.rk;
    d.rv = c.rv;
    d.R = c.R;
    d.N = c.N;
    d.sinks = c.sinks;

    auto const q = floats(g, B * S * c.nH * c.D);
    auto const iq = floats(g, B * S * c.nI * c.dI);
    auto iw = floats(g, B * S * c.nI);
    if (c.zeroW)
    {
        for (float& x : iw)
        {
            x = x < 0.f ? -0.f : 0.f;
        }
    }
    auto const nlk = floats(g, B * S * c.rk);
    auto const nlv = floats(g, B * S * c.rv);
    auto const nik = halves(g, B * S * c.dI);
    auto const lv = floats(g, c.R * c.N * c.rv);
    auto const ik = halves(g, c.R * c.N * c.dI);
    auto const kr = floats(g, c.R * c.N * kvD);
    auto const ku = floats(g, kvD * c.rk, 0.25f);
    auto const vu = floats(g, kvD * c.rv, 0.25f);
    auto const rc = floats(g, c.N * c.D);
    auto const rs = floats(g, c.N * c.D);
    std::vector<int32_t> rows(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b)
    {
        rows[static_cast<size_t>(b)] = static_cast<int32_t>(c.R - 1 - b); // distinct, not 0..B-1 (B <= R)
    }

    CachedAttentionInputs in;
    in.q = q.data();
    in.indexQ = iq.data();
    in.indexW = iw.data();
    in.newLatentK = nlk.data();
    in.newLatentV = nlv.data();
    in.newIndexKeys = nik.data();
    in.latentV = lv.data();
    in.indexKeys = ik.data();
    in.kRows = kr.data();
    in.kUp = ku.data();
    in.vUp = vu.data();
    in.ropeCos = rc.data();
    in.ropeSin = rs.data();
    in.cacheRows = rows.data();
    in.pastLengths = c.past.data();
    in.newLengths = c.fresh.data();
    in.window = c.window;
    in.topK = c.topK.data();

    int64_t k = 0, L = 0;
    std::string err;
    if (!gsm::ortcpu::prepareCachedAttention(d, in, &k, &L, &err))
    {
        std::fprintf(stderr, "error: case %s: %s\n", c.name, err.c_str());
        return false;
    }
    // outputs start from a fixed pattern, so that an element the op leaves unwritten compares equal, not random
    std::vector<float> attnOut(static_cast<size_t>(B * S * c.nH * c.D), 1234.5f);
    std::vector<float> newK(static_cast<size_t>(B * S * kvD), 1234.5f);
    std::vector<int32_t> sel(static_cast<size_t>(B * S * k), -7);
    std::vector<float> mass(static_cast<size_t>(B * L), 1234.5f);
    CachedAttentionOutputs out;
    out.attnOut = attnOut.data();
    out.newKRows = newK.data();
    out.selected = sel.data();
    out.attnMass = mass.data();
    gsm::ortcpu::ParallelRunner serial; // run == nullptr: plain loops on this thread
    if (!gsm::ortcpu::runCachedAttention(d, in, k, L, out, serial, &err))
    {
        std::fprintf(stderr, "error: case %s: %s\n", c.name, err.c_str());
        return false;
    }
    // the index scores reach the outputs only through the (discrete) selection: write them too, those of the first
    // query against every position of the first sequence's cache row
    std::vector<float> scores(static_cast<size_t>(c.N));
    float const sqrtDI = static_cast<float>(std::sqrt(static_cast<double>(c.dI)));
    gsm::ortcpu::cpuKernels().scores(iq.data(), iw.data(), c.nI, c.dI, sqrtDI, ik.data() + rows[0] * c.N * c.dI, c.N,
        scores.data());
    std::string const p = std::string(c.name) + "/";
    w.tensor(p + "attn_out", "f4", {B, S, c.nH * c.D}, attnOut.data());
    w.tensor(p + "new_k_rows", "f4", {B, S, kvD}, newK.data());
    w.tensor(p + "selected", "i4", {B, S, k}, sel.data());
    w.tensor(p + "attn_mass", "f4", {B, L}, mass.data());
    w.tensor(p + "index_scores", "f4", {c.N}, scores.data());
    return true;
}

// Every finite float16 through the kernels' float16 -> float32 conversion (F16C, NEON vcvt_f32_f16, or the scalar
// halfBits), read back exactly through the index-score kernel: two heads with weights 1 and -1 and queries e_j
// and -e_j give relu(x_j) - relu(-x_j) = x_j (products by +-1 and 0, sums with zeros: exact), sqrt(dI) passed as 1.
// Written as int32 bit patterns, so the comparison demands bit equality. dI 8: the scores8 path (load8h);
// dI 12: the generic path (halfToFloat, its vector loop and scalar tail).
void halfDecode(Writer& w)
{
    std::vector<uint16_t> pats;
    for (uint32_t u = 0; u < 65536u; ++u)
    {
        if (((u >> 10) & 0x1Fu) != 0x1Fu) // not inf/NaN (0 * inf would be NaN)
        {
            pats.push_back(static_cast<uint16_t>(u));
        }
    }
    for (int64_t dI : {8, 12})
    {
        int64_t const n = (static_cast<int64_t>(pats.size()) + dI - 1) / dI;
        std::vector<uint16_t> keys(static_cast<size_t>(n * dI), 0);
        std::copy(pats.begin(), pats.end(), keys.begin());
        std::vector<int32_t> bits(static_cast<size_t>(n * dI));
        std::vector<float> out(static_cast<size_t>(n));
        float const wts[2] = {1.f, -1.f};
        for (int64_t j = 0; j < dI; ++j)
        {
            std::vector<float> iq(static_cast<size_t>(2 * dI), 0.f);
            iq[static_cast<size_t>(j)] = 1.f;
            iq[static_cast<size_t>(dI + j)] = -1.f;
            gsm::ortcpu::cpuKernels().scores(iq.data(), wts, 2, dI, 1.f, keys.data(), n, out.data());
            for (int64_t i = 0; i < n; ++i)
            {
                std::memcpy(&bits[static_cast<size_t>(i * dI + j)], &out[static_cast<size_t>(i)], sizeof(float));
            }
        }
        w.tensor("half_decode/dI" + std::to_string(dI), "i4", {n, dI}, bits.data());
    }
}

// SmolLM2-135M's attention (nH 9, nKV 3, D 64) with its GSM indexer and latent ranks
#define SMOL 9, 3, 64, 4, 32, 188, 192
// every dimension odd-sized: scalar tails in dot/matvec (rk 37), ctxDecode's 12-column tail (rv 53), 3 + 3 + 1
// heads in the float64 sum, 4 + 1 indexer heads in scores8 (dI 24), MQA
#define ODD_A 7, 1, 10, 5, 24, 37, 53
// the generic index-score path (dI 12, not a multiple of 8), 3 + 2 heads, grouped 5 / 5
#define ODD_B 5, 5, 18, 3, 12, 9, 29
// dI > 256: the heap path of scores()
#define WIDE 2, 1, 72, 2, 264, 40, 24

std::vector<Case> cases()
{
    // name, geometry, R, N, sinks, S, window, past, new, top-k, zero index weights
    return {
        {"smol_decode_b1", SMOL, 2, 200, 4, 1, 16, {150}, {1}, {32}, false},
        {"smol_decode_b3", SMOL, 4, 160, 2, 1, 8, {130, 0, 57}, {1, 1, 0}, {16, 0, 5}, false},
        {"smol_prefill_b3", SMOL, 4, 160, 2, 5, 8, {100, 0, 37}, {5, 3, 5}, {12, 0, 7}, false},
        {"smol_decode_long", SMOL, 2, 1100, 4, 1, 64, {1030, 700}, {1, 1}, {64, 128}, false},
        {"smol_ties_decode", SMOL, 3, 96, 1, 1, 4, {70, 33}, {1, 1}, {9, 6}, true},
        {"smol_ties_prefill", SMOL, 3, 96, 1, 5, 4, {60, 20}, {5, 2}, {7, 0}, true},
        {"odd_a_decode_b3", ODD_A, 4, 80, 1, 1, 3, {41, 0, 66}, {1, 1, 1}, {7, 0, 13}, false},
        {"odd_a_prefill_b1", ODD_A, 2, 80, 1, 5, 2, {31}, {4}, {6}, false},
        {"odd_b_decode_b3", ODD_B, 4, 64, 0, 1, 0, {25, 31, 8}, {1, 0, 1}, {4, 2, 0}, false},
        {"odd_b_prefill_b3", ODD_B, 4, 64, 2, 5, 3, {9, 26, 0}, {4, 5, 5}, {3, 6, 100}, false},
        {"odd_b_dense_decode", ODD_B, 2, 64, 1, 1, 2, {10, 3}, {1, 1}, {100, 100}, false},
        {"wide_decode_b1", WIDE, 1, 48, 1, 1, 2, {37}, {1}, {5}, false},
        {"wide_prefill_b1", WIDE, 1, 48, 1, 5, 2, {20}, {5}, {4}, false},
    };
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s OUT_FILE\n", argv[0]);
        return 2;
    }
    FILE* f = std::fopen(argv[1], "wb");
    if (f == nullptr)
    {
        std::fprintf(stderr, "error: cannot write %s\n", argv[1]);
        return 2;
    }
    char const* kname = gsm::ortcpu::cpuKernels().name;
    std::fprintf(f, "GSMCHK1\nkernels %s\n", kname);
    Writer w{f};
    uint64_t seed = 1;
    for (Case const& c : cases())
    {
        if (!runCase(c, seed++, w))
        {
            std::fclose(f);
            return 1;
        }
    }
    halfDecode(w);
    if (std::fclose(f) != 0)
    {
        std::fprintf(stderr, "error: writing %s failed\n", argv[1]);
        return 1;
    }
    std::printf("kernels %s: %zu cases -> %s\n", kname, cases().size(), argv[1]);
    return 0;
}
