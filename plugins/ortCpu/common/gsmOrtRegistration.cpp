// RegisterCustomOps, the library's one exported symbol: every op of the table in gsmOrtOpTable.h becomes an
// OrtCustomOp whose metadata callbacks read its descriptor, so an op is added by its descriptor alone. Load the
// library with SessionOptions.register_custom_ops_library(path).
#include <cstring>

#include "gsmOrtGlue.h"
#include "gsmOrtOpTable.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

// The OrtCustomOp first, so that the pointer ONNX Runtime passes back to the callbacks is the whole record
struct RegisteredOp
{
    OrtCustomOp op;
    OrtOpDescriptor const* descriptor;
};

OrtOpDescriptor const& descriptorOf(OrtCustomOp const* op)
{
    return *reinterpret_cast<RegisteredOp const*>(op)->descriptor;
}

char const* ORT_API_CALL opName(OrtCustomOp const* op)
{
    return descriptorOf(op).name;
}

char const* ORT_API_CALL opProvider(OrtCustomOp const*)
{
    return "CPUExecutionProvider";
}

ONNXTensorElementDataType ORT_API_CALL inputType(OrtCustomOp const* op, size_t i)
{
    return descriptorOf(op).inputs[i].type;
}

size_t ORT_API_CALL inputCount(OrtCustomOp const* op)
{
    return descriptorOf(op).inputCount;
}

ONNXTensorElementDataType ORT_API_CALL outputType(OrtCustomOp const* op, size_t i)
{
    return descriptorOf(op).outputs[i].type;
}

size_t ORT_API_CALL outputCount(OrtCustomOp const* op)
{
    return descriptorOf(op).outputCount;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL inputKind(OrtCustomOp const* op, size_t i)
{
    return descriptorOf(op).inputs[i].kind;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL outputKind(OrtCustomOp const* op, size_t i)
{
    return descriptorOf(op).outputs[i].kind;
}

OrtMemType ORT_API_CALL inputMemory(OrtCustomOp const*, size_t)
{
    return OrtMemTypeDefault;
}

// no op has a variadic input or output; ONNX Runtime asks only for those that do
int ORT_API_CALL one(OrtCustomOp const*)
{
    return 1;
}

int ORT_API_CALL firstVersion(OrtCustomOp const*)
{
    return 1;
}

int ORT_API_CALL lastVersion(OrtCustomOp const*)
{
    return 1;
}

RegisteredOp registered(OrtOpDescriptor const& d)
{
    RegisteredOp r;
    std::memset(&r.op, 0, sizeof r.op);
    r.descriptor = &d;
    OrtCustomOp& op = r.op;
    op.version = kOrtApiVersion;
    op.GetName = opName;
    op.GetExecutionProviderType = opProvider;
    op.GetInputType = inputType;
    op.GetInputTypeCount = inputCount;
    op.GetOutputType = outputType;
    op.GetOutputTypeCount = outputCount;
    op.GetInputCharacteristic = inputKind;
    op.GetOutputCharacteristic = outputKind;
    op.GetInputMemoryType = inputMemory;
    op.GetVariadicInputMinArity = one;
    op.GetVariadicInputHomogeneity = one;
    op.GetVariadicOutputMinArity = one;
    op.GetVariadicOutputHomogeneity = one;
    op.CreateKernelV2 = d.create;
    op.KernelComputeV2 = d.compute;
    op.KernelDestroy = d.destroy;
    op.GetStartVersion = firstVersion;
    op.GetEndVersion = lastVersion;
    return r;
}

OrtOpDescriptor const* const kOps[] = {&kCachedAttentionOp, &kGroupOffsetOp, &kQuantMatMulOp, &kSideSplitOp,
    &kPoolAttentionOp, &kPoolSharedAttentionOp, &kTileGatherOp};
constexpr size_t kOpCount = sizeof kOps / sizeof kOps[0];

} // namespace
} // namespace ortcpu
} // namespace gsm

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(
    OrtSessionOptions* options, OrtApiBase const* apiBase)
{
    using namespace gsm::ortcpu;
    OrtApi const* api = apiBase != nullptr ? apiBase->GetApi(kOrtApiVersion) : nullptr;
    if (api == nullptr)
    {
        // too old an ONNX Runtime: version 1 of the API always exists and can make the status
        OrtApi const* v1 = apiBase != nullptr ? apiBase->GetApi(1) : nullptr;
        return v1 != nullptr ? v1->CreateStatus(ORT_FAIL,
                   "libgsm_ort_ops.so needs ONNX Runtime >= 1.17 (C API version 17: KernelContext_ParallelFor); "
                   "this ONNX Runtime does not provide it")
                             : nullptr;
    }
    gOrtApi = api;
    // one domain for the process (ONNX Runtime keeps pointers to it and to the ops; sessions may outlive any one
    // registration)
    static RegisteredOp ops[kOpCount];
    static OrtCustomOpDomain* domain = nullptr;
    if (domain == nullptr)
    {
        GSM_ORT_TRY(api->CreateCustomOpDomain(kOrtDomain, &domain));
        for (size_t i = 0; i < kOpCount; ++i)
        {
            ops[i] = registered(*kOps[i]);
            GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &ops[i].op));
        }
    }
    return api->AddCustomOpDomain(options, domain);
}
