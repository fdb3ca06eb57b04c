// GsmSideSplit's ONNX Runtime binding: y, scale, batch_shape and keys_like checked against attribute widths, five
// outputs [B, S, width] made (index_key in the key cache's type), then gsmSideSplit.h's math.
#include "../common/gsmOrtGlue.h"
#include "gsmSideSplit.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kY, kScale, kShape, kKeysLike, kNumInputs
};

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kRequired = INPUT_OUTPUT_REQUIRED;
// keys_like: float16 or int8; the index_key output takes its type (ONNX Runtime's custom-op type inference gives an
// undefined output the type of the last input whose type is open)
constexpr auto kKeyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

OrtOpPort const kInputs[] = {{"y", kF32, kRequired}, {"scale", kF32, kRequired},
    {"batch_shape", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, kRequired}, {"keys_like", kKeyType, kRequired}};
OrtOpPort const kOutputs[kSideBlocks] = {{"latent_k", kF32, kRequired}, {"latent_v", kF32, kRequired},
    {"index_key", kKeyType, kRequired}, {"index_q", kF32, kRequired}, {"index_w", kF32, kRequired}};
static_assert(portCount(kInputs) == kNumInputs, "ports");

struct Kernel
{
    int64_t widths[kSideBlocks];
};

// The shapes of y, scale, keys_like and batch_shape against the widths (W their sum)
OrtStatus* checkShapes(Kernel const& kn, NodeInputs const& x, int64_t W)
{
    OrtOpDescriptor const& op = kSideSplitOp;
    std::vector<int64_t> const* sh = x.shape;
    if (sh[kY].size() != 2 || sh[kY][1] != W)
    {
        return invalidArgument(op, "input y has shape " + dimsText(sh[kY]) + ", expected [M, " + std::to_string(W)
            + "] (the sum of widths)");
    }
    if (sh[kScale] != std::vector<int64_t>{W})
    {
        return invalidArgument(op, "input scale has shape " + dimsText(sh[kScale]) + ", expected [" + std::to_string(W)
            + "]");
    }
    if (sh[kKeysLike].empty() || sh[kKeysLike].back() != kn.widths[kSideIndexKey])
    {
        return invalidArgument(op, "input keys_like has shape " + dimsText(sh[kKeysLike]) + ", expected a last axis of "
            + std::to_string(kn.widths[kSideIndexKey]) + " (widths[2], the index key's)");
    }
    if (sh[kShape] != std::vector<int64_t>{2})
    {
        return invalidArgument(op, "input batch_shape has shape " + dimsText(sh[kShape]) + ", expected [2] ([B, S])");
    }
    int64_t const* bs = x.as<int64_t>(kShape);
    if (bs[0] < 0 || bs[1] < 0 || bs[0] * bs[1] != sh[kY][0])
    {
        return invalidArgument(op, "input batch_shape = [" + std::to_string(bs[0]) + ", " + std::to_string(bs[1])
            + "] does not give y's " + std::to_string(sh[kY][0]) + " rows (B * S)");
    }
    return nullptr;
}

// The five outputs [B, S, width]: the index key's into a.keys, the others' into a.out
OrtStatus* makeOutputs(OrtKernelContext* ctx, Kernel const& kn, int64_t const* bs, SideSplitArgs* a)
{
    for (int b = 0; b < kSideBlocks; ++b)
    {
        a->widths[b] = kn.widths[b];
        int64_t const dims[3] = {bs[0], bs[1], kn.widths[b]};
        void* o = nullptr;
        GSM_ORT_TRY(makeOutput(ctx, static_cast<size_t>(b), dims, 3, &o));
        if (b == kSideIndexKey)
        {
            a->keys = o;
        }
        else
        {
            a->out[b] = static_cast<float*>(o);
        }
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    NodeInputs x;
    GSM_ORT_TRY(readInputs(ctx, kSideSplitOp, &x));
    // the index key leaves as the key cache holds it: keys_like is that buffer (only its type and width are read)
    ONNXTensorElementDataType keyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(x.value[kKeysLike], &keyType));
    if (keyType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && keyType != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
    {
        return invalidArgument(kSideSplitOp, "input keys_like must be float16 or int8 (the key cache's type)");
    }
    int64_t W = 0;
    for (int64_t w : kn.widths)
    {
        W += w;
    }
    GSM_ORT_TRY(checkShapes(kn, x, W));
    SideSplitArgs a;
    a.M = x.shape[kY][0];
    a.W = W;
    a.y = x.as<float>(kY);
    a.scale = x.as<float>(kScale);
    a.int8Keys = keyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    GSM_ORT_TRY(makeOutputs(ctx, kn, x.as<int64_t>(kShape), &a));
    if (!runSideSplit(a, intraOpPool(ctx)))
    {
        return statusOf(ORT_FAIL, "GsmSideSplit: the intra-op thread pool failed");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    OrtOpDescriptor const& op = kSideSplitOp;
    Kernel kn{};
    size_t n = kSideBlocks;
    OrtStatus* st = gOrtApi->KernelInfoGetAttributeArray_int64(info, "widths", kn.widths, &n);
    if (st != nullptr || n != static_cast<size_t>(kSideBlocks))
    {
        std::string m = st != nullptr ? std::string(": ") + gOrtApi->GetErrorMessage(st) : std::string();
        if (st != nullptr)
        {
            gOrtApi->ReleaseStatus(st);
        }
        return invalidArgument(op, "attribute widths must be 5 int64 (rk, rv, index_dim, index_heads*index_dim, "
                                   "index_heads)" + m);
    }
    for (int64_t w : kn.widths)
    {
        if (w <= 0)
        {
            return invalidArgument(op, "attribute widths holds " + std::to_string(w) + ": every width must be positive");
        }
    }
    *kernel = new Kernel(kn);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kSideSplitOp{"GsmSideSplit", kInputs, kNumInputs, kOutputs, kSideBlocks, create, compute,
    destroyKernel<Kernel>};

} // namespace ortcpu
} // namespace gsm
