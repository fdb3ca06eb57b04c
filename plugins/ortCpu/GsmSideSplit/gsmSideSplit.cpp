// GsmSideSplit: rows on the intra-op pool in a prefill, on the calling thread in a decode step.
#include "gsmSideSplit.h"

#include <algorithm>
#include <cmath>

#include "../../common/gsm_math.h"
#include "../kernels/gsmOrtKernels.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

// rows per pool item; below kSerialValues values one thread does it all (a decode step's row is ~1K values)
constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kSerialValues = 1 << 15;

void rows(SideSplitArgs const& a, int64_t m0, int64_t m1)
{
    Kernels const& k = cpuKernels();
    for (int64_t m = m0; m < m1; ++m)
    {
        float const* y = a.y + m * a.W;
        int64_t c = 0;
        for (int b = 0; b < kSideBlocks; ++b)
        {
            int64_t const w = a.widths[b];
            float const* s = a.scale + c;
            float const* yb = y + c;
            if (b == kSideIndexKey && a.int8Keys)
            {
                int8_t* o = static_cast<int8_t*>(a.keys) + m * w;
                for (int64_t i = 0; i < w; ++i)
                {
                    // the plugins' code of a value (gsm_math.h quantize: ONNX Round's half to even, then Clip) of
                    // the already scaled key; NaN gives code 0
                    float const v = yb[i] * s[i];
                    o[i] = v != v ? int8_t{0} : static_cast<int8_t>(quantize(v, 1.0f, kQmaxINT8));
                }
            }
            else if (b == kSideIndexKey)
            {
                uint16_t* o = static_cast<uint16_t*>(a.keys) + m * w;
                for (int64_t i = k.halfStore(yb, s, w, o); i < w; ++i)
                {
                    o[i] = f32ToF16Bits(yb[i] * s[i]);
                }
            }
            else if (b == kSideLatentK || b == kSideLatentV)
            {
                float* o = a.out[b] + m * w;
                for (int64_t i = k.halfRound(yb, s, w, o); i < w; ++i)
                {
                    o[i] = roundFP16(yb[i] * s[i]);
                }
            }
            else
            {
                float* o = a.out[b] + m * w;
                for (int64_t i = 0; i < w; ++i)
                {
                    o[i] = yb[i] * s[i];
                }
            }
            c += w;
        }
    }
}

void item(void* data, size_t i)
{
    SideSplitArgs const& a = *static_cast<SideSplitArgs const*>(data);
    int64_t const m0 = static_cast<int64_t>(i) * kRowsPerItem;
    rows(a, m0, std::min(a.M, m0 + kRowsPerItem));
}

} // namespace

bool runSideSplit(SideSplitArgs const& a, ParallelRunner const& par)
{
    int64_t const items = (a.M + kRowsPerItem - 1) / kRowsPerItem;
    if (par.run == nullptr || items <= 1 || a.M * a.W < kSerialValues)
    {
        rows(a, 0, a.M);
        return true;
    }
    return par.run(par.ctx, item, static_cast<size_t>(items), const_cast<SideSplitArgs*>(&a));
}

} // namespace ortcpu
} // namespace gsm
