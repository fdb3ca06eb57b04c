// GsmQuantMatMul's ONNX Runtime binding: the tiles and x checked against the attributes, then the product
// (gsmQuantMatMul.h) and, where the node asks for one, the epilogue GsmGroupOffset shares (residual, SwiGLU, norm).
#include "../GsmGroupOffset/gsmEpilogueOrt.h"
#include "gsmQuantMatMul.h"
#include "gsmQuantTilesOrt.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kX, kCodes, kScales, kOffsets, kResidual, kNormWeight, kNumInputs
};

constexpr auto kOpen = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // float32 or float16, checked per call

OrtOpPort const kInputs[] = {{"x", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, INPUT_OUTPUT_REQUIRED},
    {"codes", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, INPUT_OUTPUT_REQUIRED}, {"scales", kOpen, INPUT_OUTPUT_REQUIRED},
    {"offsets", kOpen, INPUT_OUTPUT_OPTIONAL}, {"residual", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, INPUT_OUTPUT_OPTIONAL},
    {"norm_weight", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, INPUT_OUTPUT_OPTIONAL}};
static_assert(portCount(kInputs) == kNumInputs, "ports");

struct Kernel
{
    Epilogue epilogue;
    TileAttributes tiles;
};

// x [M, K] and the epilogue's inputs against the attributes; M from x
OrtStatus* checkRows(Kernel const& kn, NodeInputs const& x, int64_t* M)
{
    OrtOpDescriptor const& op = kQuantMatMulOp;
    TileAttributes const& t = kn.tiles;
    std::vector<int64_t> const* sh = x.shape;
    if (sh[kX].size() != 2 || sh[kX][1] != t.K)
    {
        return invalidArgument(op, "input x has shape " + dimsText(sh[kX]) + ", expected [M, " + std::to_string(t.K)
            + "]");
    }
    *M = sh[kX][0];
    if (kn.epilogue.swiglu != 0 && (x.has(kResidual) || t.N % 2 != 0))
    {
        return invalidArgument(op, "with swiglu = 1 N must be even (gate, then up) and there is no residual");
    }
    if (x.has(kResidual) && sh[kResidual] != std::vector<int64_t>{*M, t.N})
    {
        return invalidArgument(op, "input residual has shape " + dimsText(sh[kResidual]) + ", expected ["
            + std::to_string(*M) + ", " + std::to_string(t.N) + "]");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    TileAttributes const& t = kn.tiles;
    NodeInputs x;
    GSM_ORT_TRY(readInputs(ctx, kQuantMatMulOp, &x));
    ONNXTensorElementDataType scaleType, offType;
    GSM_ORT_TRY(tileInputs(kQuantMatMulOp, t, x, kCodes, kScales, kOffsets, &scaleType, &offType));
    int64_t M = 0;
    GSM_ORT_TRY(checkRows(kn, x, &M));
    GroupOffsetArgs e; // the epilogue (residual, SwiGLU, norm) over the full product
    e.M = M;
    e.K = t.K;
    e.N = t.N;
    e.block = t.block;
    e.x = x.as<float>(kX);
    e.residual = x.as<float>(kResidual);
    GSM_ORT_TRY(epilogueOutputs(kQuantMatMulOp, ctx, kn.epilogue, x.as<float>(kNormWeight), x.shape[kNormWeight], &e));
    // without an epilogue the product goes straight to y; else through scratch the epilogue reads
    bool const plain = e.residual == nullptr && !e.swiglu && e.normed == nullptr;
    static thread_local std::vector<float> full;
    QuantMatMulArgs a;
    a.M = M;
    a.K = t.K;
    a.N = t.N;
    a.bits = t.bits;
    a.block = t.block;
    a.x = e.x;
    a.codes = x.as<uint8_t>(kCodes);
    a.scales = x.data[kScales];
    a.offsets = x.data[kOffsets];
    a.halfScales = scaleType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.halfOffsets = offType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (!plain)
    {
        full.resize(static_cast<size_t>(M * t.N));
    }
    a.y = plain ? e.y : full.data();
    ParallelRunner const par = intraOpPool(ctx);
    e.main = full.data();
    if (!runQuantMatMul(a, par) || (!plain && !runGroupOffset(e, par)))
    {
        return statusOf(ORT_FAIL, "GsmQuantMatMul: the intra-op thread pool failed");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    Kernel kn{};
    GSM_ORT_TRY(tileAttributes(kQuantMatMulOp, info, &kn.tiles));
    GSM_ORT_TRY(epilogueAttributes(kQuantMatMulOp, info, &kn.epilogue));
    *kernel = new Kernel(kn);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kQuantMatMulOp{"GsmQuantMatMul", kInputs, kNumInputs, kEpilogueOutputs, 2, create, compute,
    destroyKernel<Kernel>};

} // namespace ortcpu
} // namespace gsm
