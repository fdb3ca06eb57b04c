// The pool ops' shared binding (gsmPoolOrt.h).
#include "gsmPoolOrt.h"

namespace gsm
{
namespace ortcpu
{

OrtStatus* poolRowsAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info, int64_t rows[4])
{
    char const* const names[4] = {"rows_fp16", "rows_int12", "rows_int8", "rows_int4"};
    for (int i = 0; i < 4; ++i)
    {
        GSM_ORT_TRY(intAttribute(op, info, names[i], &rows[i]));
        if (rows[i] < 0 || rows[i] > kSlotRowMask)
        {
            return invalidArgument(op, std::string("attribute ") + names[i] + " = " + std::to_string(rows[i])
                + " is outside [0, 2^24)");
        }
    }
    return nullptr;
}

GsmDims poolLayout(int64_t rk, int64_t rv, int64_t N, int64_t const rows[4])
{
    GsmDims g{};
    g.rankK = static_cast<int32_t>(rk);
    g.rankV = static_cast<int32_t>(rv);
    g.nMax = static_cast<int32_t>(N);
    g.rowsFP16 = static_cast<int32_t>(rows[0]);
    g.rowsINT12 = static_cast<int32_t>(rows[1]);
    g.rowsINT8 = static_cast<int32_t>(rows[2]);
    g.rowsINT4 = static_cast<int32_t>(rows[3]);
    return g;
}

PoolSource poolSource(GsmDims const& g, void* pool, void* slots, void* quant, void* rowCache, void* rowTags, int64_t C)
{
    PoolSource ps;
    ps.dims = g;
    ps.pool = static_cast<uint8_t*>(pool);
    ps.poolBytes = 4 * poolWords(g);
    ps.slots = static_cast<int32_t const*>(slots);
    ps.quant = static_cast<float const*>(quant);
    ps.cacheRows = static_cast<float*>(rowCache);
    ps.cacheTags = static_cast<int32_t*>(rowTags);
    ps.capacity = C;
    return ps;
}

} // namespace ortcpu
} // namespace gsm
