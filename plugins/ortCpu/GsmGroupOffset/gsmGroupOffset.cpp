// GsmGroupOffset: tiles of rows x columns on the intra-op pool; the kernels are ../kernels/gsmOrtKernels.h's.
#include "gsmGroupOffset.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/gsmOrtKernels.h"

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
// a decode row wide enough for the pool (an LM head: 49,152 columns x 18 groups) splits into this many column
// strips, each streamed as one row is serially. Two: SmolLM2's head term went 134-144 -> 79 us on 2 threads and
// stayed within noise on 1 (where the strips run one after the other); 4 strips cost 1 thread 10-15 %, 8 strips
// more (each strip restarts the prefetcher on every offsets row)
constexpr int64_t kRowSplits = 2;
constexpr int64_t kRowSplitWork = 1 << 19;

struct Job
{
    GroupOffsetArgs const* a;
    float const* sums;  // [M, G]
    int64_t G, cols, colTiles;  // columns per tile: kCols, or every column for a decode call's row
    Kernels const* k;
};

void tile(void* data, size_t i)
{
    Job const& j = *static_cast<Job const*>(data);
    GroupOffsetArgs const& a = *j.a;
    int64_t const r0 = static_cast<int64_t>(i) / j.colTiles * kRows, c0 = static_cast<int64_t>(i) % j.colTiles * j.cols;
    int64_t const r1 = std::min(a.M, r0 + kRows), c1 = std::min(a.N, c0 + j.cols);
    for (int64_t m = r0; m < r1; m += 4)
    {
        int64_t const rows = std::min<int64_t>(4, r1 - m);
        float const* res = a.residual != nullptr ? a.residual + m * a.N : nullptr;
        if (a.offsets == nullptr)  // main holds the whole projection (GsmQuantMatMul): the residual only
        {
            for (int64_t r = m; r < m + rows; ++r)
            {
                for (int64_t n = c0; n < c1; ++n)
                {
                    a.y[r * a.N + n] = a.residual != nullptr ? a.main[r * a.N + n] + a.residual[r * a.N + n]
                                                             : a.main[r * a.N + n];
                }
            }
        }
        else if (a.halfOffsets)
        {
            j.k->groupOffsetHalf(j.sums + m * j.G, rows, static_cast<uint16_t const*>(a.offsets), j.G, a.N, c0, c1,
                a.main + m * a.N, res, a.y + m * a.N);
        }
        else
        {
            j.k->groupOffset(j.sums + m * j.G, rows, static_cast<float const*>(a.offsets), j.G, a.N, c0, c1,
                a.main + m * a.N, res, a.y + m * a.N);
        }
    }
}

// normed = y / sqrt(mean(y^2) + eps) * w for rows [r0, r1): the mean of squares summed in float64, then the
// float32 steps of the graph's own RMSNorm (ReduceMean, Add, Sqrt, Div, Mul)
void normRows(GroupOffsetArgs const& a, int64_t r0, int64_t r1)
{
    for (int64_t m = r0; m < r1; ++m)
    {
        float const* y = a.y + m * a.N;
        double ss = 0.0;
        for (int64_t n = 0; n < a.N; ++n)
        {
            ss += static_cast<double>(y[n]) * y[n];
        }
        float const rms = std::sqrt(static_cast<float>(ss / static_cast<double>(a.N)) + a.normEps);
        float* o = a.normed + m * a.N;
        for (int64_t n = 0; n < a.N; ++n)
        {
            o[n] = y[n] / rms * a.normWeight[n];
        }
    }
}

void normTile(void* data, size_t i)
{
    GroupOffsetArgs const& a = *static_cast<GroupOffsetArgs const*>(data);
    int64_t const r0 = static_cast<int64_t>(i) * kRows;
    normRows(a, r0, std::min(a.M, r0 + kRows));
}

struct SwigluJob
{
    float const* full;  // [M, 2I]
    float* y;           // [M, I]
    int64_t I, M;
    Kernels const* k;
};

void swigluRows(void* data, size_t i)
{
    SwigluJob const& s = *static_cast<SwigluJob const*>(data);
    int64_t const r0 = static_cast<int64_t>(i) * kRows, r1 = std::min(s.M, r0 + kRows);
    for (int64_t m = r0; m < r1; ++m)
    {
        s.k->swiglu(s.full + m * 2 * s.I, s.I, s.y + m * s.I);
    }
}

} // namespace

bool runGroupOffset(GroupOffsetArgs const& a, ParallelRunner const& par)
{
    Kernels const& k = cpuKernels();
    int64_t const G = a.offsets != nullptr ? (a.K + a.block - 1) / a.block : 0;
    static thread_local std::vector<float> sums;
    sums.resize(static_cast<size_t>(a.M * G));
    for (int64_t m = 0; G > 0 && m < a.M; ++m)
    {
        k.groupSums(a.x + m * a.K, a.K, a.block, sums.data() + m * G);
    }
    // main already the whole sum (GsmQuantMatMul's, no residual): the SwiGLU product reads it as it is
    bool const ready = a.offsets == nullptr && a.residual == nullptr && a.swiglu;
    // else, with swiglu, the projection's [M, N] lands in scratch first, then the product goes to y [M, N/2]
    GroupOffsetArgs b = a;
    static thread_local std::vector<float> full;
    if (a.swiglu && !ready)
    {
        full.resize(static_cast<size_t>(a.M * a.N));
        b.y = full.data();
    }
    int64_t const colTiles = (a.N + kCols - 1) / kCols;
    bool const wideRow = par.run != nullptr && a.M < 4 && a.M * G * a.N >= kRowSplitWork;
    // without an offset term (G = 0) only the epilogues' elementwise passes are left: a pool for more than a tile of rows
    bool const serial = !wideRow && (par.run == nullptr || (a.M <= kRows && colTiles == 1)
                                        || (G > 0 ? a.M * G * a.N < kSerialWork : a.M <= kRows));
    // rows fewer than 4 (a decode step) take every column at once, or a few wide strips of them on the pool: the
    // kernel then streams each offsets row start to end, where 256-column strips read the array in 1 KB pieces
    // a row apart
    bool const whole = (serial || wideRow) && a.M < 4;
    int64_t const strip = wideRow ? ((a.N + kRowSplits - 1) / kRowSplits + 63) / 64 * 64 : a.N;
    Job j{&b, sums.data(), G, whole ? strip : kCols, whole ? (a.N + strip - 1) / strip : colTiles, &k};
    int64_t const tiles = ready ? 0 : (a.M + kRows - 1) / kRows * j.colTiles;
    if (serial)
    {
        for (int64_t i = 0; i < tiles; ++i)
        {
            tile(&j, static_cast<size_t>(i));
        }
    }
    else if (tiles > 0 && !par.run(par.ctx, tile, static_cast<size_t>(tiles), &j))
    {
        return false;
    }
    if (a.normWeight != nullptr)
    {
        int64_t const items = (a.M + kRows - 1) / kRows;
        if (serial || items == 1)
        {
            normRows(a, 0, a.M);
            return true;
        }
        return par.run(par.ctx, normTile, static_cast<size_t>(items), const_cast<GroupOffsetArgs*>(&a));
    }
    if (!a.swiglu)
    {
        return true;
    }
    SwigluJob s{ready ? a.main : b.y, a.y, a.N / 2, a.M, &k};
    int64_t const items = (a.M + kRows - 1) / kRows;
    if (serial || items == 1)
    {
        for (int64_t i = 0; i < items; ++i)
        {
            swigluRows(&s, static_cast<size_t>(i));
        }
        return true;
    }
    return par.run(par.ctx, swigluRows, static_cast<size_t>(items), &s);
}

} // namespace ortcpu
} // namespace gsm
