// The epilogue's attributes and outputs (gsmEpilogueOrt.h).
#include "gsmEpilogueOrt.h"

namespace gsm
{
namespace ortcpu
{

OrtOpPort const kEpilogueOutputs[2] = {{"y", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, INPUT_OUTPUT_REQUIRED},
    {"normed", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, INPUT_OUTPUT_OPTIONAL}};

OrtStatus* epilogueAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info, Epilogue* e)
{
    GSM_ORT_TRY(optionalIntAttribute(op, info, "swiglu", 0, &e->swiglu));
    if (e->swiglu != 0 && e->swiglu != 1)
    {
        return invalidArgument(op, "attribute swiglu = " + std::to_string(e->swiglu) + " must be 0 or 1");
    }
    OrtStatus* st = gOrtApi->KernelInfoGetAttribute_float(info, "norm_epsilon", &e->normEps);
    e->hasNormEps = st == nullptr;
    if (st != nullptr)
    {
        gOrtApi->ReleaseStatus(st);
    }
    if (e->hasNormEps && !(e->normEps >= 0.f))
    {
        return invalidArgument(op, "attribute norm_epsilon = " + std::to_string(e->normEps) + " must be >= 0");
    }
    return nullptr;
}

OrtStatus* epilogueOutputs(OrtOpDescriptor const& op, OrtKernelContext* ctx, Epilogue const& e,
    float const* normWeight, std::vector<int64_t> const& normShape, GroupOffsetArgs* a)
{
    size_t outputs = 0;
    GSM_ORT_TRY(outputCount(ctx, &outputs));
    bool const norm = normWeight != nullptr;
    if (norm && (e.swiglu != 0 || !e.hasNormEps || outputs < 2 || normShape != std::vector<int64_t>{a->N}))
    {
        return invalidArgument(op, "input norm_weight " + dimsText(normShape) + " needs shape [N] = ["
            + std::to_string(a->N) + "], attribute norm_epsilon, a second output (normed) and swiglu = 0");
    }
    if (!norm && outputs > 1)
    {
        return invalidArgument(op, "output normed needs input norm_weight");
    }
    a->swiglu = e.swiglu != 0;
    int64_t const outDims[2] = {a->M, a->swiglu ? a->N / 2 : a->N};
    void* y = nullptr;
    GSM_ORT_TRY(makeOutput(ctx, 0, outDims, 2, &y));
    a->y = static_cast<float*>(y);
    if (norm)
    {
        void* n = nullptr;
        GSM_ORT_TRY(makeOutput(ctx, 1, outDims, 2, &n));
        a->normed = static_cast<float*>(n);
        a->normWeight = normWeight;
        a->normEps = e.normEps;
    }
    return nullptr;
}

} // namespace ortcpu
} // namespace gsm
