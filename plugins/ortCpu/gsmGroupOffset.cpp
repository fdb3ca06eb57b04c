// GsmGroupOffset: tiles of rows x columns on the intra-op pool; the kernels are gsmCachedAttentionKernels'.
#include "gsmGroupOffset.h"

#include <algorithm>
#include <vector>

#include "gsmCachedAttentionKernels.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

// a tile: up to kRows rows x kCols columns (the offsets' strip of kCols columns stays in L1 across its rows)
constexpr int64_t kRows = 16;
constexpr int64_t kCols = 256;
// below this many multiply-adds one thread does it all: a pool hand-off costs more than it saves (SmolLM2's decode
// calls, up to 48 groups x 1,536 columns, ran 12.6-14.8 ms a step serial against 16.5 ms on a 2-thread pool)
constexpr int64_t kSerialWork = 1 << 20;

struct Job
{
    GroupOffsetArgs const* a;
    float const* sums;  // [M, G]
    int64_t G, colTiles;
    Kernels const* k;
};

void tile(void* data, size_t i)
{
    Job const& j = *static_cast<Job const*>(data);
    GroupOffsetArgs const& a = *j.a;
    int64_t const r0 = static_cast<int64_t>(i) / j.colTiles * kRows, c0 = static_cast<int64_t>(i) % j.colTiles * kCols;
    int64_t const r1 = std::min(a.M, r0 + kRows), c1 = std::min(a.N, c0 + kCols);
    for (int64_t m = r0; m < r1; m += 4)
    {
        int64_t const rows = std::min<int64_t>(4, r1 - m);
        j.k->groupOffset(j.sums + m * j.G, rows, a.offsets, j.G, a.N, c0, c1, a.main + m * a.N,
            a.residual != nullptr ? a.residual + m * a.N : nullptr, a.y + m * a.N);
    }
}

} // namespace

bool runGroupOffset(GroupOffsetArgs const& a, ParallelRunner const& par)
{
    Kernels const& k = cpuKernels();
    int64_t const G = (a.K + a.block - 1) / a.block;
    static thread_local std::vector<float> sums;
    sums.resize(static_cast<size_t>(a.M * G));
    for (int64_t m = 0; m < a.M; ++m)
    {
        k.groupSums(a.x + m * a.K, a.K, a.block, sums.data() + m * G);
    }
    Job j{&a, sums.data(), G, (a.N + kCols - 1) / kCols, &k};
    int64_t const tiles = (a.M + kRows - 1) / kRows * j.colTiles;
    if (par.run == nullptr || tiles == 1 || a.M * G * a.N < kSerialWork)
    {
        for (int64_t i = 0; i < tiles; ++i)
        {
            tile(&j, static_cast<size_t>(i));
        }
        return true;
    }
    return par.run(par.ctx, tile, static_cast<size_t>(tiles), &j);
}

} // namespace ortcpu
} // namespace gsm
