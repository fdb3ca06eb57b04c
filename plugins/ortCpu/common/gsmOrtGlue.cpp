// ONNX Runtime C API helpers shared by every op (gsmOrtGlue.h).
#include "gsmOrtGlue.h"

namespace gsm
{
namespace ortcpu
{

OrtApi const* gOrtApi = nullptr;

OrtStatus* invalidArgument(OrtOpDescriptor const& op, std::string const& message)
{
    return gOrtApi->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(op.name) + ": " + message).c_str());
}

OrtStatus* statusOf(OrtErrorCode code, std::string const& message)
{
    return gOrtApi->CreateStatus(code, message.c_str());
}

std::string dimsText(std::vector<int64_t> const& dims)
{
    std::string s = "[";
    for (size_t i = 0; i < dims.size(); ++i)
    {
        s += (i ? ", " : "") + std::to_string(dims[i]);
    }
    return s + "]";
}

namespace
{

// Input i and its shape; *value null (dims empty) where the node leaves an optional input out.
OrtStatus* inputShape(OrtKernelContext* ctx, size_t i, OrtValue const** value, std::vector<int64_t>* dims)
{
    GSM_ORT_TRY(gOrtApi->KernelContext_GetInput(ctx, i, value));
    if (*value == nullptr)
    {
        dims->clear();
        return nullptr;
    }
    OrtTensorTypeAndShapeInfo* info = nullptr;
    GSM_ORT_TRY(gOrtApi->GetTensorTypeAndShape(*value, &info));
    size_t n = 0;
    OrtStatus* st = gOrtApi->GetDimensionsCount(info, &n);
    if (st == nullptr)
    {
        dims->assign(n, 0);
        st = gOrtApi->GetDimensions(info, dims->data(), n);
    }
    gOrtApi->ReleaseTensorTypeAndShapeInfo(info);
    return st;
}

// Whether the node has an attribute `name` of a type other than int64 (ONNX Runtime reports a missing attribute
// and a mistyped one alike, and a mistyped one must not read as missing).
bool hasOtherTypedAttribute(OrtKernelInfo const* info, char const* name)
{
    float f = 0.f;
    size_t n = 0;
    OrtStatus* const probes[] = {gOrtApi->KernelInfoGetAttribute_float(info, name, &f),
        gOrtApi->KernelInfoGetAttribute_string(info, name, nullptr, &n),
        gOrtApi->KernelInfoGetAttributeArray_int64(info, name, nullptr, &n),
        gOrtApi->KernelInfoGetAttributeArray_float(info, name, nullptr, &n)};
    bool found = false;
    for (OrtStatus* st : probes)
    {
        found = found || st == nullptr;
        if (st != nullptr)
        {
            gOrtApi->ReleaseStatus(st);
        }
    }
    return found;
}

bool runOnIntraOpPool(void* ctx, void (*fn)(void*, size_t), size_t total, void* data)
{
    OrtStatus* st
        = gOrtApi->KernelContext_ParallelFor(static_cast<OrtKernelContext const*>(ctx), fn, total, 0, data);
    if (st != nullptr)
    {
        gOrtApi->ReleaseStatus(st);
        return false;
    }
    return true;
}

} // namespace

OrtStatus* readInputs(OrtKernelContext* ctx, OrtOpDescriptor const& op, NodeInputs* in)
{
    if (op.inputCount > kMaxOpInputs) // an op declared with more inputs than NodeInputs holds
    {
        return statusOf(ORT_FAIL, std::string(op.name) + ": more inputs than kMaxOpInputs (gsmOrtGlue.h)");
    }
    size_t present = 0;
    GSM_ORT_TRY(gOrtApi->KernelContext_GetInputCount(ctx, &present));
    for (size_t i = 0; i < op.inputCount; ++i)
    {
        if (i < present)
        {
            GSM_ORT_TRY(inputShape(ctx, i, &in->value[i], &in->shape[i]));
        }
        if (in->value[i] == nullptr && op.inputs[i].kind != INPUT_OUTPUT_OPTIONAL)
        {
            return invalidArgument(op, std::string("input ") + op.inputs[i].name + " is missing");
        }
    }
    for (size_t i = 0; i < op.inputCount; ++i)
    {
        if (in->value[i] != nullptr) // GetTensorData (const) is newer than the 1.17 API
        {
            GSM_ORT_TRY(gOrtApi->GetTensorMutableData(const_cast<OrtValue*>(in->value[i]), &in->data[i]));
        }
    }
    return nullptr;
}

OrtStatus* elementType(OrtValue const* value, ONNXTensorElementDataType* type)
{
    OrtTensorTypeAndShapeInfo* info = nullptr;
    GSM_ORT_TRY(gOrtApi->GetTensorTypeAndShape(value, &info));
    OrtStatus* st = gOrtApi->GetTensorElementType(info, type);
    gOrtApi->ReleaseTensorTypeAndShapeInfo(info);
    return st;
}

OrtStatus* sharedType(OrtOpDescriptor const& op, OrtValue const* x, OrtValue const* y, ONNXTensorElementDataType a,
    ONNXTensorElementDataType b, char const* message, ONNXTensorElementDataType* type)
{
    ONNXTensorElementDataType other = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(x, type));
    GSM_ORT_TRY(elementType(y, &other));
    return (*type == a || *type == b) && other == *type ? nullptr : invalidArgument(op, message);
}

OrtStatus* expectShape(OrtOpDescriptor const& op, size_t i, std::vector<int64_t> const& got,
    std::vector<int64_t> const& want, char const* meaning)
{
    return got == want ? nullptr
                       : invalidArgument(op, std::string("input ") + op.inputs[i].name + " has shape " + dimsText(got)
                           + ", expected " + dimsText(want) + " (" + meaning + ")");
}

OrtStatus* expectShapeAny(OrtOpDescriptor const& op, size_t i, std::vector<int64_t> const& got,
    std::vector<int64_t> const& want, char const* meaning, char const* name)
{
    bool ok = got.size() == want.size();
    for (size_t a = 0; ok && a < want.size(); ++a)
    {
        ok = want[a] < 0 || want[a] == got[a];
    }
    if (ok)
    {
        return nullptr;
    }
    std::string w = "[";
    for (size_t a = 0; a < want.size(); ++a)
    {
        w += (a ? ", " : "") + (want[a] < 0 ? std::string("*") : std::to_string(want[a]));
    }
    return invalidArgument(op, std::string("input ") + (name ? name : op.inputs[i].name) + " has shape "
        + dimsText(got) + ", expected " + w + "] (" + meaning + ")");
}

OrtStatus* intAttribute(OrtOpDescriptor const& op, OrtKernelInfo const* info, char const* name, int64_t* value)
{
    OrtStatus* st = gOrtApi->KernelInfoGetAttribute_int64(info, name, value);
    if (st != nullptr)
    {
        std::string m
            = std::string("attribute ") + name + " (int64) is missing or invalid: " + gOrtApi->GetErrorMessage(st);
        gOrtApi->ReleaseStatus(st);
        return invalidArgument(op, m);
    }
    return nullptr;
}

OrtStatus* optionalIntAttribute(OrtOpDescriptor const& op, OrtKernelInfo const* info, char const* name,
    int64_t fallback, int64_t* value)
{
    OrtStatus* st = gOrtApi->KernelInfoGetAttribute_int64(info, name, value);
    if (st == nullptr)
    {
        return nullptr;
    }
    gOrtApi->ReleaseStatus(st);
    if (hasOtherTypedAttribute(info, name))
    {
        return invalidArgument(op, std::string("attribute ") + name + " must be an int64");
    }
    *value = fallback;
    return nullptr;
}

OrtStatus* owningAttentionAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info,
    OwningAttentionAttributes* a)
{
    GSM_ORT_TRY(intAttribute(op, info, "num_heads", &a->numHeads));
    GSM_ORT_TRY(intAttribute(op, info, "num_kv_heads", &a->numKvHeads));
    GSM_ORT_TRY(intAttribute(op, info, "head_dim", &a->headDim));
    GSM_ORT_TRY(intAttribute(op, info, "index_heads", &a->indexHeads));
    GSM_ORT_TRY(intAttribute(op, info, "index_dim", &a->indexDim));
    GSM_ORT_TRY(intAttribute(op, info, "sink_tokens", &a->sinkTokens));
    return optionalIntAttribute(op, info, "sparse_top_k_divisor", 0, &a->topKDivisor);
}

OrtStatus* outputCount(OrtKernelContext* ctx, size_t* count)
{
    *count = 0;
    return gOrtApi->KernelContext_GetOutputCount(ctx, count);
}

OrtStatus* makeOutput(OrtKernelContext* ctx, size_t i, int64_t const* dims, size_t rank, void** data)
{
    *data = nullptr;
    OrtValue* value = nullptr;
    GSM_ORT_TRY(gOrtApi->KernelContext_GetOutput(ctx, i, dims, rank, &value));
    if (value != nullptr)
    {
        GSM_ORT_TRY(gOrtApi->GetTensorMutableData(value, data));
    }
    return nullptr;
}

ParallelRunner intraOpPool(OrtKernelContext* ctx)
{
    ParallelRunner par;
    par.run = runOnIntraOpPool;
    par.ctx = ctx;
    return par;
}

} // namespace ortcpu
} // namespace gsm
