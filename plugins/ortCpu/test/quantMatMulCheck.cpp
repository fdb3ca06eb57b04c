// GsmQuantMatMul's raw-pointer API (gsmQuantMatMul.h) on fixed pseudo-random tiles and activations, no ONNX Runtime:
// prints the kernel it ran and, per case, the FNV-1a hash of the output's float32 bits and its first value.
// scripts/check_ortcpu_aarch64.sh runs it on x86-64 (each kernel by GSM_ORT_QMM_KERNEL) and on aarch64 under qemu: the
// kernels spell the same fused multiply-adds in the same order, so every line must be identical.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "GsmQuantMatMul/gsmQuantMatMul.h"

namespace
{

uint32_t gState = 12345u;

uint32_t next()
{
    gState = gState * 1664525u + 1013904223u;
    return gState >> 8;
}

float uniform(float lo, float hi)
{
    return lo + (hi - lo) * static_cast<float>(next() & 0xFFFF) / 65535.f;
}

struct Case
{
    int64_t M, K, N, bits, block;
    bool offsets;
};

} // namespace

int main()
{
    using namespace gsm::ortcpu;
    Case const cases[] = {{1, 576, 576, 4, 32, true}, {5, 100, 37, 4, 32, true}, {3, 200, 40, 4, 128, false},
        {1, 576, 200, 8, 32, false}, {6, 130, 33, 8, 64, false}};
    std::printf("kernel %s\n", quantMatMulKernel());
    for (Case const& c : cases)
    {
        int64_t const G = (c.K + c.block - 1) / c.block, S = G * c.block / kQSubBlock, NT = (c.N + 15) / 16;
        std::vector<uint8_t> codes(static_cast<size_t>(NT * S * quantSubBlockBytes(c.bits)));
        for (auto& b : codes)
        {
            b = static_cast<uint8_t>(next());
        }
        std::vector<float> scales(static_cast<size_t>(NT * G * 16)), offsets(scales.size()), x(static_cast<size_t>(c.M * c.K));
        for (auto& v : scales)
        {
            v = uniform(0.001f, 0.05f);
        }
        for (auto& v : offsets)
        {
            v = uniform(-0.4f, 0.1f);
        }
        for (auto& v : x)
        {
            v = uniform(-2.f, 2.f) * (next() % 29 == 0 ? 25.f : 1.f);
        }
        std::vector<float> y(static_cast<size_t>(c.M * c.N));
        QuantMatMulArgs a;
        a.M = c.M;
        a.K = c.K;
        a.N = c.N;
        a.bits = c.bits;
        a.block = c.block;
        a.x = x.data();
        a.codes = codes.data();
        a.scales = scales.data();
        a.offsets = c.offsets ? offsets.data() : nullptr;
        a.y = y.data();
        runQuantMatMul(a, ParallelRunner{});
        uint64_t h = 1469598103934665603ull;
        for (float v : y)
        {
            uint32_t bits;
            std::memcpy(&bits, &v, sizeof bits);
            for (int i = 0; i < 4; ++i)
            {
                h = (h ^ ((bits >> (8 * i)) & 0xFF)) * 1099511628211ull;
            }
        }
        std::printf("M %" PRId64 " K %" PRId64 " N %" PRId64 " bits %" PRId64 " block %" PRId64 " offsets %d: %016" PRIx64
                    " y0 %.9g\n", c.M, c.K, c.N, c.bits, c.block, c.offsets ? 1 : 0, h, static_cast<double>(y[0]));
    }
    return 0;
}
