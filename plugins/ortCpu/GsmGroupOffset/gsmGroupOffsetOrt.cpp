// GsmGroupOffset's ONNX Runtime binding: shapes of x, main, offsets and the optional residual and norm weight
// checked, then gsmGroupOffset.h's math on the intra-op pool.
#include "gsmEpilogueOrt.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kX, kMain, kOffsets, kResidual, kNormWeight, kNumInputs
};

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

OrtOpPort const kInputs[] = {{"x", kF32, INPUT_OUTPUT_REQUIRED}, {"main", kF32, INPUT_OUTPUT_REQUIRED},
    {"offsets", ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, INPUT_OUTPUT_REQUIRED}, // float32 or float16
    {"residual", kF32, INPUT_OUTPUT_OPTIONAL}, {"norm_weight", kF32, INPUT_OUTPUT_OPTIONAL}};
static_assert(portCount(kInputs) == kNumInputs, "ports");

struct Kernel : Epilogue
{
    int64_t blockSize;
};

// M, K, N and the block from the shapes of x, main and offsets, each checked against the others
OrtStatus* readShapes(Kernel const& kn, NodeInputs const& x, GroupOffsetArgs* a)
{
    OrtOpDescriptor const& op = kGroupOffsetOp;
    std::vector<int64_t> const* sh = x.shape;
    if (sh[kX].size() != 2 || sh[kMain].size() != 2 || sh[kOffsets].size() != 2)
    {
        return invalidArgument(op, "inputs x " + dimsText(sh[kX]) + ", main " + dimsText(sh[kMain]) + ", offsets "
            + dimsText(sh[kOffsets]) + ": expected [M, K], [M, N] and [ceil(K / block_size), N]");
    }
    a->M = sh[kX][0];
    a->K = sh[kX][1];
    a->N = sh[kMain][1];
    a->block = kn.blockSize;
    int64_t const G = (a->K + a->block - 1) / a->block;
    if (sh[kMain][0] != a->M || sh[kOffsets][0] != G || sh[kOffsets][1] != a->N)
    {
        return invalidArgument(op, "inputs x " + dimsText(sh[kX]) + ", main " + dimsText(sh[kMain]) + ", offsets "
            + dimsText(sh[kOffsets]) + ": expected main [M, N] with x's M and offsets [" + std::to_string(G)
            + ", N] (ceil(K / block_size), block_size " + std::to_string(a->block) + ")");
    }
    if (kn.swiglu != 0 && (x.has(kResidual) || a->N % 2 != 0))
    {
        return invalidArgument(op, "with swiglu = 1 main must have an even width (gate, then up) and there is no "
                                   "residual (got main " + dimsText(sh[kMain]) + (x.has(kResidual) ? ", a residual)" : ")"));
    }
    if (x.has(kResidual) && sh[kResidual] != sh[kMain])
    {
        return invalidArgument(op, "input residual has shape " + dimsText(sh[kResidual]) + ", expected main's "
            + dimsText(sh[kMain]));
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    NodeInputs x;
    GSM_ORT_TRY(readInputs(ctx, kGroupOffsetOp, &x));
    ONNXTensorElementDataType offType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(x.value[kOffsets], &offType));
    if (offType != kF32 && offType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    {
        return invalidArgument(kGroupOffsetOp, "input offsets must be float32 or float16");
    }
    GroupOffsetArgs a;
    GSM_ORT_TRY(readShapes(kn, x, &a));
    a.x = x.as<float>(kX);
    a.main = x.as<float>(kMain);
    a.offsets = x.data[kOffsets];
    a.halfOffsets = offType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.residual = x.as<float>(kResidual);
    GSM_ORT_TRY(epilogueOutputs(kGroupOffsetOp, ctx, kn, x.as<float>(kNormWeight), x.shape[kNormWeight], &a));
    if (!runGroupOffset(a, intraOpPool(ctx)))
    {
        return statusOf(ORT_FAIL, "GsmGroupOffset: the intra-op thread pool failed");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    OrtOpDescriptor const& op = kGroupOffsetOp;
    Kernel kn{};
    GSM_ORT_TRY(intAttribute(op, info, "block_size", &kn.blockSize));
    if (kn.blockSize <= 0)
    {
        return invalidArgument(op, "attribute block_size = " + std::to_string(kn.blockSize) + " must be positive");
    }
    GSM_ORT_TRY(epilogueAttributes(op, info, &kn));
    *kernel = new Kernel(kn);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kGroupOffsetOp{"GsmGroupOffset", kInputs, kNumInputs, kEpilogueOutputs, 2, create, compute,
    destroyKernel<Kernel>};

} // namespace ortcpu
} // namespace gsm
