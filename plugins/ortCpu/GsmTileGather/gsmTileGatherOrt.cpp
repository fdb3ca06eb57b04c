// GsmTileGather's ONNX Runtime binding: rows `ids` of a weight stored as GsmQuantMatMul's tiles, dequantised
// (gatherQuantRows, ../GsmQuantMatMul/gsmQuantMatMul.h: the tile layout's own reader).
#include "../GsmQuantMatMul/gsmQuantMatMul.h"
#include "../GsmQuantMatMul/gsmQuantTilesOrt.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kIds, kCodes, kScales, kOffsets, kNumInputs
};

constexpr auto kOpen = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // float32 or float16, checked per call

OrtOpPort const kInputs[] = {{"ids", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, INPUT_OUTPUT_REQUIRED},
    {"codes", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, INPUT_OUTPUT_REQUIRED}, {"scales", kOpen, INPUT_OUTPUT_REQUIRED},
    {"offsets", kOpen, INPUT_OUTPUT_OPTIONAL}};
OrtOpPort const kOutputs[] = {{"y", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, INPUT_OUTPUT_REQUIRED}};
static_assert(portCount(kInputs) == kNumInputs, "ports");

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    TileAttributes const& t = *static_cast<TileAttributes const*>(opKernel);
    NodeInputs x;
    GSM_ORT_TRY(readInputs(ctx, kTileGatherOp, &x));
    ONNXTensorElementDataType scaleType, offType;
    GSM_ORT_TRY(tileInputs(kTileGatherOp, t, x, kCodes, kScales, kOffsets, &scaleType, &offType));
    int64_t M = 1;
    for (int64_t d : x.shape[kIds])
    {
        M *= d;
    }
    int64_t const outDims[2] = {M, t.K};
    void* y = nullptr;
    GSM_ORT_TRY(makeOutput(ctx, 0, outDims, 2, &y));
    QuantGatherArgs a;
    a.M = M;
    a.K = t.K;
    a.N = t.N;
    a.bits = t.bits;
    a.block = t.block;
    a.ids = x.as<int64_t>(kIds);
    a.codes = x.as<uint8_t>(kCodes);
    a.scales = x.data[kScales];
    a.offsets = x.data[kOffsets];
    a.halfScales = scaleType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.halfOffsets = offType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.y = static_cast<float*>(y);
    int64_t const bad = gatherQuantRows(a);
    if (bad >= 0)
    {
        return invalidArgument(kTileGatherOp, "ids[" + std::to_string(bad) + "] = " + std::to_string(a.ids[bad])
            + " is outside [0, " + std::to_string(t.N) + ")");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    TileAttributes t{};
    GSM_ORT_TRY(tileAttributes(kTileGatherOp, info, &t));
    *kernel = new TileAttributes(t);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kTileGatherOp{"GsmTileGather", kInputs, kNumInputs, kOutputs, 1, create, compute,
    destroyKernel<TileAttributes>};

} // namespace ortcpu
} // namespace gsm
