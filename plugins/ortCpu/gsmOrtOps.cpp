// ONNX Runtime glue of libgsm_ort_ops.so: the custom-op domain "ai.gsm_edge.cpu" (version 1) with six ops,
// GsmPoolAttention and GsmPoolSharedAttention (the attention over the plugins' pools, gsmPoolRows.h),
// GsmCachedAttention (the same core over float32 buffers, gsmCachedAttention.h), GsmGroupOffset (gsmGroupOffset.h),
// GsmQuantMatMul (gsmQuantMatMul.h) and GsmSideSplit (gsmSideSplit.h), through ONNX Runtime's C API only. Load it with
// SessionOptions.register_custom_ops_library(path) (which calls RegisterCustomOps below).
#include <onnxruntime_c_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "GsmCachedAttention/gsmCachedAttention.h"
#include "GsmGroupOffset/gsmGroupOffset.h"
#include "GsmQuantMatMul/gsmQuantMatMul.h"
#include "GsmSideSplit/gsmSideSplit.h"

namespace
{

// ORT 1.17: the first C API with KernelContext_ParallelFor. The op struct says the same version, so ONNX
// Runtime reads only the OrtCustomOp fields that version has.
constexpr uint32_t kApiVersion = 17;
constexpr char const* kDomain = "ai.gsm_edge.cpu";
constexpr char const* kOpName = "GsmCachedAttention";

OrtApi const* gApi = nullptr;

enum Input : size_t
{
    kQ, kIndexQ, kIndexW, kNewLatentK, kNewLatentV, kNewIndexKeys, kLatentV, kIndexKeys, kKRows, kKUp, kVUp,
    kRopeCos, kRopeSin, kCacheRows, kPastLengths, kNewLengths, kSparseWindow, kSparseTopK, kNumInputs
};
char const* const kInputNames[kNumInputs] = {"q", "index_q", "index_w", "new_latent_k", "new_latent_v",
    "new_index_keys", "latent_v", "index_keys", "k_rows", "k_up", "v_up", "rope_cos", "rope_sin", "cache_rows",
    "past_lengths", "new_lengths", "sparse_window", "sparse_top_k"};
// with attribute v_rows = 1 input kLatentV holds the cached V rows [R, N_max, kvD] and the node has the fifth output
char const* const kVRowsName = "latent_v (the V rows, v_rows = 1)";
constexpr size_t kNumOutputs = 5; // attn_out, new_k_rows, selected, attn_mass, and new_v_rows (v_rows = 1 only)
constexpr size_t kNewVRows = 4;

struct Kernel
{
    int64_t numHeads, numKvHeads, headDim, indexHeads, indexDim, sinkTokens, topKDivisor, vRows;
};

OrtStatus* invalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmCachedAttention: " + m).c_str());
}

std::string dimsText(std::vector<int64_t> const& v)
{
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i)
    {
        s += (i ? ", " : "") + std::to_string(v[i]);
    }
    return s + "]";
}

#define GSM_ORT_TRY(expr)                                                                                            \
    do                                                                                                               \
    {                                                                                                                \
        OrtStatus* _st = (expr);                                                                                     \
        if (_st != nullptr)                                                                                          \
        {                                                                                                            \
            return _st;                                                                                              \
        }                                                                                                            \
    } while (0)

// Input i and its shape; *value null (dims empty) where the node leaves an optional input out.
OrtStatus* optionalInputShape(OrtKernelContext* ctx, size_t i, OrtValue const** value, std::vector<int64_t>* dims)
{
    GSM_ORT_TRY(gApi->KernelContext_GetInput(ctx, i, value));
    if (*value == nullptr)
    {
        dims->clear();
        return nullptr;
    }
    OrtTensorTypeAndShapeInfo* info = nullptr;
    GSM_ORT_TRY(gApi->GetTensorTypeAndShape(*value, &info));
    size_t n = 0;
    OrtStatus* st = gApi->GetDimensionsCount(info, &n);
    if (st == nullptr)
    {
        dims->assign(n, 0);
        st = gApi->GetDimensions(info, dims->data(), n);
    }
    gApi->ReleaseTensorTypeAndShapeInfo(info);
    return st;
}

// GsmCachedAttention's input i and its shape (every input is required)
OrtStatus* inputShape(OrtKernelContext* ctx, size_t i, OrtValue const** value, std::vector<int64_t>* dims)
{
    GSM_ORT_TRY(optionalInputShape(ctx, i, value, dims));
    if (*value == nullptr)
    {
        return invalid(std::string("input ") + kInputNames[i] + " is missing");
    }
    return nullptr;
}

OrtStatus* elementType(OrtValue const* value, ONNXTensorElementDataType* type)
{
    OrtTensorTypeAndShapeInfo* info = nullptr;
    GSM_ORT_TRY(gApi->GetTensorTypeAndShape(value, &info));
    OrtStatus* st = gApi->GetTensorElementType(info, type);
    gApi->ReleaseTensorTypeAndShapeInfo(info);
    return st;
}

// The element type two inputs share, `a` or `b`; else an error with `message` (naming the inputs and what is allowed).
OrtStatus* sharedType(OrtValue const* x, OrtValue const* y, ONNXTensorElementDataType a, ONNXTensorElementDataType b,
    char const* message, ONNXTensorElementDataType* type)
{
    ONNXTensorElementDataType other = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(x, type));
    GSM_ORT_TRY(elementType(y, &other));
    return (*type == a || *type == b) && other == *type ? nullptr : invalid(message);
}

// Checks that input i has exactly the shape `want` (entries < 0: any size, reported back); `name` in place of the
// input's own where it holds something else (the V rows)
OrtStatus* expectShape(size_t i, std::vector<int64_t> const& got, std::vector<int64_t> want, char const* meaning,
    char const* name = nullptr)
{
    bool ok = got.size() == want.size();
    for (size_t a = 0; ok && a < want.size(); ++a)
    {
        ok = want[a] < 0 || want[a] == got[a];
    }
    if (!ok)
    {
        std::string w = "[";
        for (size_t a = 0; a < want.size(); ++a)
        {
            w += (a ? ", " : "") + (want[a] < 0 ? std::string("*") : std::to_string(want[a]));
        }
        return invalid(std::string("input ") + (name ? name : kInputNames[i]) + " has shape " + dimsText(got)
            + ", expected " + w + "] (" + meaning + ")");
    }
    return nullptr;
}

bool runParallel(void* ctx, void (*fn)(void*, size_t), size_t total, void* data)
{
    OrtStatus* st = gApi->KernelContext_ParallelFor(static_cast<OrtKernelContext const*>(ctx), fn, total, 0, data);
    if (st != nullptr)
    {
        gApi->ReleaseStatus(st);
        return false;
    }
    return true;
}

OrtStatus* ORT_API_CALL computeV2(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    using gsm::ortcpu::CachedAttentionDims;
    OrtValue const* v[kNumInputs];
    std::vector<int64_t> sh[kNumInputs];
    for (size_t i = 0; i < kNumInputs; ++i)
    {
        GSM_ORT_TRY(inputShape(ctx, i, &v[i], &sh[i]));
    }
    // the indexer keys: FP16, or INT8 codes (decisions "INT8 indexer keys"), the same in both key inputs
    ONNXTensorElementDataType keyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(sharedType(v[kIndexKeys], v[kNewIndexKeys], ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
        ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
        "inputs index_keys and new_index_keys must both be float16 or both int8 (INT8 key codes)", &keyType));
    // U_k and U_v: float32, or float16 when the checkpoint's U lie on the FP16 grid (the builder stores them so)
    ONNXTensorElementDataType kUpType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(sharedType(v[kKUp], v[kVUp], ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
        "inputs k_up and v_up must both be float or both float16", &kUpType));
    CachedAttentionDims d;
    d.nH = kn.numHeads;
    d.nKV = kn.numKvHeads;
    d.D = kn.headDim;
    d.nI = kn.indexHeads;
    d.dI = kn.indexDim;
    d.sinks = kn.sinkTokens;
    d.topKDivisor = kn.topKDivisor;
    // B and S from index_q; q is [B, S, nH*D] or, as the projection leaves it, [B*S, nH*D] (attn_out then the same)
    if (sh[kIndexQ].size() != 3)
    {
        return invalid("input index_q has shape " + dimsText(sh[kIndexQ]) + ", expected [B, S, index_heads*index_dim]");
    }
    d.B = sh[kIndexQ][0];
    d.S = sh[kIndexQ][1];
    bool const flatQ = sh[kQ].size() == 2;
    bool const vRows = kn.vRows != 0;
    if (sh[kLatentV].size() != 3 || sh[kKUp].size() != 2 || sh[kVUp].size() != 2)
    {
        return invalid(std::string("input ") + (vRows ? kVRowsName : "latent_v") + " has shape "
            + dimsText(sh[kLatentV]) + ", k_up " + dimsText(sh[kKUp]) + " and v_up " + dimsText(sh[kVUp])
            + ", expected [R, N_max, " + (vRows ? "kvD" : "rv") + "], [kvD, rk] and [kvD, rv]");
    }
    d.R = sh[kLatentV][0];
    d.N = sh[kLatentV][1];
    d.rv = vRows ? sh[kVUp][1] : sh[kLatentV][2];
    d.rk = sh[kKUp][1];
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D;
    size_t outputs = 0;
    GSM_ORT_TRY(gApi->KernelContext_GetOutputCount(ctx, &outputs));
    if (outputs != (vRows ? kNumOutputs : kNumOutputs - 1))
    {
        return invalid("the node has " + std::to_string(outputs) + " outputs; attribute v_rows = "
            + std::to_string(kn.vRows) + " needs " + std::to_string(vRows ? kNumOutputs : kNumOutputs - 1)
            + (vRows ? " (the fifth: new_v_rows)" : ""));
    }
    if (vRows)
    {
        GSM_ORT_TRY(expectShape(kLatentV, sh[kLatentV], {-1, -1, kvD}, "[R, N_max, num_kv_heads*head_dim]", kVRowsName));
    }
    if (flatQ)
    {
        GSM_ORT_TRY(expectShape(kQ, sh[kQ], {B * S, d.nH * d.D}, "[B*S, num_heads*head_dim], or [B, S, ...]"));
    }
    else
    {
        GSM_ORT_TRY(expectShape(kQ, sh[kQ], {B, S, d.nH * d.D}, "[B, S, num_heads*head_dim], or [B*S, ...]"));
    }
    GSM_ORT_TRY(expectShape(kIndexQ, sh[kIndexQ], {B, S, d.nI * d.dI}, "[B, S, index_heads*index_dim]"));
    GSM_ORT_TRY(expectShape(kIndexW, sh[kIndexW], {B, S, d.nI}, "[B, S, index_heads]"));
    GSM_ORT_TRY(expectShape(kNewLatentK, sh[kNewLatentK], {B, S, d.rk}, "[B, S, rk], rk from k_up"));
    GSM_ORT_TRY(expectShape(kNewLatentV, sh[kNewLatentV], {B, S, d.rv},
        vRows ? "[B, S, rv], rv from v_up" : "[B, S, rv], rv from latent_v"));
    GSM_ORT_TRY(expectShape(kNewIndexKeys, sh[kNewIndexKeys], {B, S, d.dI}, "[B, S, index_dim]"));
    GSM_ORT_TRY(expectShape(kIndexKeys, sh[kIndexKeys], {d.R, d.N, d.dI}, "[R, N_max, index_dim] as latent_v"));
    GSM_ORT_TRY(expectShape(kKRows, sh[kKRows], {d.R, d.N, kvD}, "[R, N_max, num_kv_heads*head_dim]"));
    GSM_ORT_TRY(expectShape(kKUp, sh[kKUp], {kvD, d.rk}, "[num_kv_heads*head_dim, rk]"));
    GSM_ORT_TRY(expectShape(kVUp, sh[kVUp], {kvD, d.rv}, "[num_kv_heads*head_dim, rv], rv from latent_v"));
    GSM_ORT_TRY(expectShape(kRopeCos, sh[kRopeCos], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(expectShape(kRopeSin, sh[kRopeSin], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(expectShape(kCacheRows, sh[kCacheRows], {B}, "[B]"));
    GSM_ORT_TRY(expectShape(kPastLengths, sh[kPastLengths], {B}, "[B]"));
    GSM_ORT_TRY(expectShape(kNewLengths, sh[kNewLengths], {B}, "[B]"));
    GSM_ORT_TRY(expectShape(kSparseWindow, sh[kSparseWindow], {1}, "[1]"));
    GSM_ORT_TRY(expectShape(kSparseTopK, sh[kSparseTopK], {B}, "[B]"));

    gsm::ortcpu::CachedAttentionInputs in;
    void const* p[kNumInputs];
    for (size_t i = 0; i < kNumInputs; ++i)
    {
        void* data = nullptr; // GetTensorData (const) is newer than the 1.17 API
        GSM_ORT_TRY(gApi->GetTensorMutableData(const_cast<OrtValue*>(v[i]), &data));
        p[i] = data;
    }
    in.q = static_cast<float const*>(p[kQ]);
    in.indexQ = static_cast<float const*>(p[kIndexQ]);
    in.indexW = static_cast<float const*>(p[kIndexW]);
    in.newLatentK = static_cast<float const*>(p[kNewLatentK]);
    in.newLatentV = static_cast<float const*>(p[kNewLatentV]);
    in.newIndexKeys = p[kNewIndexKeys];
    (vRows ? in.vRows : in.latentV) = static_cast<float const*>(p[kLatentV]);
    in.indexKeys = p[kIndexKeys];
    in.int8Keys = keyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    in.kRows = static_cast<float const*>(p[kKRows]);
    in.kUp = p[kKUp];
    in.vUp = p[kVUp];
    in.halfUp = kUpType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    in.ropeCos = static_cast<float const*>(p[kRopeCos]);
    in.ropeSin = static_cast<float const*>(p[kRopeSin]);
    in.cacheRows = static_cast<int32_t const*>(p[kCacheRows]);
    in.pastLengths = static_cast<int32_t const*>(p[kPastLengths]);
    in.newLengths = static_cast<int32_t const*>(p[kNewLengths]);
    in.window = *static_cast<int32_t const*>(p[kSparseWindow]);
    in.topK = static_cast<int32_t const*>(p[kSparseTopK]);

    std::string err;
    int64_t k = 0, L = 0;
    if (!gsm::ortcpu::prepareCachedAttention(d, in, &k, &L, &err))
    {
        return gApi->CreateStatus(ORT_INVALID_ARGUMENT, err.c_str());
    }
    int64_t const outDims[kNumOutputs][3] = {{B, S, d.nH * d.D}, {B, S, kvD}, {B, S, k}, {B, L, 0}, {B, S, kvD}};
    int64_t const flatOut[2] = {B * S, d.nH * d.D};
    size_t const outRank[kNumOutputs] = {flatQ ? size_t{2} : size_t{3}, 3, 3, 2, 3};
    void* o[kNumOutputs] = {};
    for (size_t i = 0; i < outputs; ++i)
    {
        OrtValue* ov = nullptr;
        GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, i, i == 0 && flatQ ? flatOut : outDims[i], outRank[i], &ov));
        GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &o[i]));
    }
    gsm::ortcpu::CachedAttentionOutputs out;
    out.attnOut = static_cast<float*>(o[0]);
    out.newKRows = static_cast<float*>(o[1]);
    out.selected = static_cast<int32_t*>(o[2]);
    out.attnMass = static_cast<float*>(o[3]);
    out.newVRows = static_cast<float*>(o[kNewVRows]);
    gsm::ortcpu::ParallelRunner par;
    par.run = runParallel;
    par.ctx = ctx;
    if (!gsm::ortcpu::runCachedAttention(d, in, k, L, out, par, &err))
    {
        return gApi->CreateStatus(ORT_FAIL, err.c_str());
    }
    return nullptr;
}

OrtStatus* attribute(OrtKernelInfo const* info, char const* name, int64_t* value,
    OrtStatus* (*fail)(std::string const&) = invalid)
{
    OrtStatus* st = gApi->KernelInfoGetAttribute_int64(info, name, value);
    if (st != nullptr)
    {
        std::string m = std::string("attribute ") + name + " (int64) is missing or invalid: " + gApi->GetErrorMessage(st);
        gApi->ReleaseStatus(st);
        return fail(m);
    }
    return nullptr;
}

// Whether the node has an attribute `name` of a type other than int64 (ONNX Runtime reports a missing attribute
// and a mistyped one alike, and a mistyped one must not read as missing).
bool hasOtherTypedAttribute(OrtKernelInfo const* info, char const* name)
{
    float f = 0.f;
    size_t n = 0;
    OrtStatus* const probes[] = {gApi->KernelInfoGetAttribute_float(info, name, &f),
        gApi->KernelInfoGetAttribute_string(info, name, nullptr, &n),
        gApi->KernelInfoGetAttributeArray_int64(info, name, nullptr, &n),
        gApi->KernelInfoGetAttributeArray_float(info, name, nullptr, &n)};
    bool found = false;
    for (OrtStatus* st : probes)
    {
        found = found || st == nullptr;
        if (st != nullptr)
        {
            gApi->ReleaseStatus(st);
        }
    }
    return found;
}

// An int64 attribute that graphs written before it existed lack: `fallback` then.
OrtStatus* optionalAttribute(OrtKernelInfo const* info, char const* name, int64_t fallback, int64_t* value,
    OrtStatus* (*fail)(std::string const&) = invalid)
{
    OrtStatus* st = gApi->KernelInfoGetAttribute_int64(info, name, value);
    if (st == nullptr)
    {
        return nullptr;
    }
    gApi->ReleaseStatus(st);
    if (hasOtherTypedAttribute(info, name))
    {
        return fail(std::string("attribute ") + name + " must be an int64");
    }
    *value = fallback;
    return nullptr;
}

OrtStatus* ORT_API_CALL createKernelV2(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    Kernel kn{};
    GSM_ORT_TRY(attribute(info, "num_heads", &kn.numHeads));
    GSM_ORT_TRY(attribute(info, "num_kv_heads", &kn.numKvHeads));
    GSM_ORT_TRY(attribute(info, "head_dim", &kn.headDim));
    GSM_ORT_TRY(attribute(info, "index_heads", &kn.indexHeads));
    GSM_ORT_TRY(attribute(info, "index_dim", &kn.indexDim));
    GSM_ORT_TRY(attribute(info, "sink_tokens", &kn.sinkTokens));
    GSM_ORT_TRY(optionalAttribute(info, "sparse_top_k_divisor", 0, &kn.topKDivisor));
    GSM_ORT_TRY(optionalAttribute(info, "v_rows", 0, &kn.vRows));
    if (kn.vRows != 0 && kn.vRows != 1)
    {
        return invalid("attribute v_rows = " + std::to_string(kn.vRows) + " must be 0 or 1 (1: input latent_v holds "
            "the cached V rows [R, N_max, kvD] and the node has a fifth output, new_v_rows)");
    }
    if (kn.numHeads <= 0 || kn.numKvHeads <= 0 || kn.numHeads % kn.numKvHeads != 0)
    {
        return invalid("attributes num_heads = " + std::to_string(kn.numHeads) + ", num_kv_heads = "
            + std::to_string(kn.numKvHeads) + ": both must be positive, num_heads a multiple of num_kv_heads");
    }
    if (kn.headDim <= 0 || kn.headDim % 2 != 0)
    {
        return invalid("attribute head_dim = " + std::to_string(kn.headDim) + " must be positive and even");
    }
    if (kn.indexHeads <= 0 || kn.indexDim <= 0 || kn.sinkTokens < 0)
    {
        return invalid("attributes index_heads, index_dim must be positive and sink_tokens >= 0 (got "
            + std::to_string(kn.indexHeads) + ", " + std::to_string(kn.indexDim) + ", "
            + std::to_string(kn.sinkTokens) + ")");
    }
    if (kn.topKDivisor < 0)
    {
        return invalid("attribute sparse_top_k_divisor = " + std::to_string(kn.topKDivisor)
            + " must be >= 0 (0: a fixed top-k)");
    }
    *kernel = new Kernel(kn);
    return nullptr;
}

void ORT_API_CALL destroyKernel(void* kernel)
{
    delete static_cast<Kernel*>(kernel);
}

char const* ORT_API_CALL opName(OrtCustomOp const*)
{
    return kOpName;
}

char const* ORT_API_CALL opProvider(OrtCustomOp const*)
{
    return "CPUExecutionProvider";
}

ONNXTensorElementDataType ORT_API_CALL inputType(OrtCustomOp const*, size_t i)
{
    if (i == kNewIndexKeys || i == kIndexKeys)
    {
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // float16 keys or int8 codes, checked per call
    }
    if (i == kKUp || i == kVUp)
    {
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // float or float16, checked per call
    }
    return i >= kCacheRows ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL inputCount(OrtCustomOp const*)
{
    return kNumInputs;
}

ONNXTensorElementDataType ORT_API_CALL outputType(OrtCustomOp const*, size_t i)
{
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL outputCount(OrtCustomOp const*)
{
    return kNumOutputs;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(OrtCustomOp const*, size_t)
{
    return INPUT_OUTPUT_REQUIRED;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL attentionOutputKind(OrtCustomOp const*, size_t i)
{
    return i == kNewVRows ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

OrtMemType ORT_API_CALL memDefault(OrtCustomOp const*, size_t)
{
    return OrtMemTypeDefault;
}

int ORT_API_CALL one(OrtCustomOp const*)
{
    return 1;
}

int ORT_API_CALL startVersion(OrtCustomOp const*)
{
    return 1;
}

int ORT_API_CALL endVersion(OrtCustomOp const*)
{
    return 1;
}

// -- GsmGroupOffset ---------------------------------------------------------------------------------------------
constexpr char const* kOffsetOpName = "GsmGroupOffset";
enum OffsetInput : size_t
{
    kOffX, kOffMain, kOffOffsets, kOffResidual, kOffNormWeight, kOffNumInputs
};
char const* const kOffsetInputNames[kOffNumInputs] = {"x", "main", "offsets", "residual", "norm_weight"};

OrtCustomOpInputOutputCharacteristic ORT_API_CALL offsetInputKind(OrtCustomOp const*, size_t i)
{
    return i == kOffResidual || i == kOffNormWeight ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

// The attributes of the epilogues GsmGroupOffset and GsmQuantMatMul share: swiglu, and norm_epsilon when a norm is asked
struct Epilogue
{
    int64_t swiglu = 0;
    float normEps = 0.f;
    bool hasNormEps = false;
};

OrtStatus* epilogueAttributes(OrtKernelInfo const* info, Epilogue* e, OrtStatus* (*fail)(std::string const&))
{
    GSM_ORT_TRY(optionalAttribute(info, "swiglu", 0, &e->swiglu, fail));
    if (e->swiglu != 0 && e->swiglu != 1)
    {
        return fail("attribute swiglu = " + std::to_string(e->swiglu) + " must be 0 or 1");
    }
    OrtStatus* st = gApi->KernelInfoGetAttribute_float(info, "norm_epsilon", &e->normEps);
    e->hasNormEps = st == nullptr;
    if (st != nullptr)
    {
        gApi->ReleaseStatus(st);
    }
    if (e->hasNormEps && !(e->normEps >= 0.f))
    {
        return fail("attribute norm_epsilon = " + std::to_string(e->normEps) + " must be >= 0");
    }
    return nullptr;
}

struct OffsetKernel : Epilogue
{
    int64_t blockSize;
};

// Checks the norm's input (norm_weight [N], shape `normShape`; null: no norm) against the attributes and the node's
// outputs, then makes the epilogue's outputs into e: y [M, N] ([M, N / 2] with swiglu) and, with a norm, normed.
OrtStatus* epilogueOutputs(OrtKernelContext* ctx, Epilogue const& kn, float const* normWeight,
    std::vector<int64_t> const& normShape, gsm::ortcpu::GroupOffsetArgs* e, OrtStatus* (*fail)(std::string const&))
{
    size_t outputs = 0;
    GSM_ORT_TRY(gApi->KernelContext_GetOutputCount(ctx, &outputs));
    bool const norm = normWeight != nullptr;
    if (norm && (kn.swiglu != 0 || !kn.hasNormEps || outputs < 2 || normShape != std::vector<int64_t>{e->N}))
    {
        return fail("input norm_weight " + dimsText(normShape) + " needs shape [N] = [" + std::to_string(e->N)
            + "], attribute norm_epsilon, a second output (normed) and swiglu = 0");
    }
    if (!norm && outputs > 1)
    {
        return fail("output normed needs input norm_weight");
    }
    e->swiglu = kn.swiglu != 0;
    int64_t const outDims[2] = {e->M, e->swiglu ? e->N / 2 : e->N};
    OrtValue* ov = nullptr;
    GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, 0, outDims, 2, &ov));
    void* y = nullptr;
    GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &y));
    e->y = static_cast<float*>(y);
    if (norm)
    {
        OrtValue* nv = nullptr;
        GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, 1, outDims, 2, &nv));
        void* n = nullptr;
        GSM_ORT_TRY(gApi->GetTensorMutableData(nv, &n));
        e->normed = static_cast<float*>(n);
        e->normWeight = normWeight;
        e->normEps = kn.normEps;
    }
    return nullptr;
}

using InputKind = OrtCustomOpInputOutputCharacteristic (*)(OrtCustomOp const*, size_t);

// Inputs v[0 .. n) and their shapes (null and empty where an optional one is left out); a required one (the op's own
// `kind` says which) missing is an error naming it
OrtStatus* readInputs(OrtKernelContext* ctx, size_t n, char const* const* names, InputKind kind, OrtValue const** v,
    std::vector<int64_t>* sh, OrtStatus* (*fail)(std::string const&))
{
    size_t present = 0;
    GSM_ORT_TRY(gApi->KernelContext_GetInputCount(ctx, &present));
    for (size_t i = 0; i < n; ++i)
    {
        v[i] = nullptr;
        if (i < present)
        {
            GSM_ORT_TRY(optionalInputShape(ctx, i, &v[i], &sh[i]));
        }
        if (v[i] == nullptr && kind(nullptr, i) != INPUT_OUTPUT_OPTIONAL)
        {
            return fail(std::string("input ") + names[i] + " is missing");
        }
    }
    return nullptr;
}

// The data of inputs v[0 .. n) (null where an optional input is absent)
OrtStatus* inputData(OrtValue const* const* v, size_t n, void** p)
{
    for (size_t i = 0; i < n; ++i)
    {
        p[i] = nullptr;
        if (v[i] != nullptr)
        {
            GSM_ORT_TRY(gApi->GetTensorMutableData(const_cast<OrtValue*>(v[i]), &p[i]));
        }
    }
    return nullptr;
}

OrtStatus* offsetInvalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmGroupOffset: " + m).c_str());
}

OrtStatus* ORT_API_CALL offsetCompute(void* opKernel, OrtKernelContext* ctx)
{
    OffsetKernel const& kn = *static_cast<OffsetKernel const*>(opKernel);
    OrtValue const* v[kOffNumInputs];
    std::vector<int64_t> sh[kOffNumInputs];
    GSM_ORT_TRY(readInputs(ctx, kOffNumInputs, kOffsetInputNames, offsetInputKind, v, sh, offsetInvalid));
    ONNXTensorElementDataType offType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(v[kOffOffsets], &offType));
    if (offType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && offType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    {
        return offsetInvalid("input offsets must be float32 or float16");
    }
    if (sh[kOffX].size() != 2 || sh[kOffMain].size() != 2 || sh[kOffOffsets].size() != 2)
    {
        return offsetInvalid("inputs x " + dimsText(sh[kOffX]) + ", main " + dimsText(sh[kOffMain]) + ", offsets "
            + dimsText(sh[kOffOffsets]) + ": expected [M, K], [M, N] and [ceil(K / block_size), N]");
    }
    gsm::ortcpu::GroupOffsetArgs a;
    a.M = sh[kOffX][0];
    a.K = sh[kOffX][1];
    a.N = sh[kOffMain][1];
    a.block = kn.blockSize;
    int64_t const G = (a.K + a.block - 1) / a.block;
    if (sh[kOffMain][0] != a.M || sh[kOffOffsets][0] != G || sh[kOffOffsets][1] != a.N)
    {
        return offsetInvalid("inputs x " + dimsText(sh[kOffX]) + ", main " + dimsText(sh[kOffMain]) + ", offsets "
            + dimsText(sh[kOffOffsets]) + ": expected main [M, N] with x's M and offsets [" + std::to_string(G)
            + ", N] (ceil(K / block_size), block_size " + std::to_string(a.block) + ")");
    }
    if (kn.swiglu != 0 && (v[kOffResidual] != nullptr || a.N % 2 != 0))
    {
        return offsetInvalid("with swiglu = 1 main must have an even width (gate, then up) and there is no residual "
                             "(got main " + dimsText(sh[kOffMain]) + (v[kOffResidual] != nullptr ? ", a residual)" : ")"));
    }
    if (v[kOffResidual] != nullptr && sh[kOffResidual] != sh[kOffMain])
    {
        return offsetInvalid("input residual has shape " + dimsText(sh[kOffResidual]) + ", expected main's "
            + dimsText(sh[kOffMain]));
    }
    void* p[kOffNumInputs];
    GSM_ORT_TRY(inputData(v, kOffNumInputs, p));
    a.x = static_cast<float const*>(p[kOffX]);
    a.main = static_cast<float const*>(p[kOffMain]);
    a.offsets = p[kOffOffsets];
    a.halfOffsets = offType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.residual = static_cast<float const*>(p[kOffResidual]);
    GSM_ORT_TRY(epilogueOutputs(ctx, kn, static_cast<float const*>(p[kOffNormWeight]), sh[kOffNormWeight], &a,
        offsetInvalid));
    gsm::ortcpu::ParallelRunner par;
    par.run = runParallel;
    par.ctx = ctx;
    if (!gsm::ortcpu::runGroupOffset(a, par))
    {
        return gApi->CreateStatus(ORT_FAIL, "GsmGroupOffset: the intra-op thread pool failed");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL offsetCreateKernel(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info,
    void** kernel)
{
    OffsetKernel kn{};
    GSM_ORT_TRY(attribute(info, "block_size", &kn.blockSize, offsetInvalid));
    if (kn.blockSize <= 0)
    {
        return offsetInvalid("attribute block_size = " + std::to_string(kn.blockSize) + " must be positive");
    }
    GSM_ORT_TRY(epilogueAttributes(info, &kn, offsetInvalid));
    *kernel = new OffsetKernel(kn);
    return nullptr;
}

void ORT_API_CALL offsetDestroyKernel(void* kernel)
{
    delete static_cast<OffsetKernel*>(kernel);
}

char const* ORT_API_CALL offsetOpName(OrtCustomOp const*)
{
    return kOffsetOpName;
}

ONNXTensorElementDataType ORT_API_CALL offsetFloat(OrtCustomOp const*, size_t)
{
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

ONNXTensorElementDataType ORT_API_CALL offsetInputType(OrtCustomOp const*, size_t i)
{
    // offsets: float32 or float16, checked per call
    return i == kOffOffsets ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL offsetInputCount(OrtCustomOp const*)
{
    return kOffNumInputs;
}

size_t ORT_API_CALL offsetOutputCount(OrtCustomOp const*)
{
    return 2;  // y, and normed (optional: with norm_weight)
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL offsetOutputKind(OrtCustomOp const*, size_t i)
{
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

// -- GsmQuantMatMul ---------------------------------------------------------------------------------------------
constexpr char const* kQmmOpName = "GsmQuantMatMul";
enum QmmInput : size_t
{
    kQmmX, kQmmCodes, kQmmScales, kQmmOffsets, kQmmResidual, kQmmNormWeight, kQmmNumInputs
};
char const* const kQmmInputNames[kQmmNumInputs] = {"x", "codes", "scales", "offsets", "residual", "norm_weight"};

OrtCustomOpInputOutputCharacteristic ORT_API_CALL qmmInputKind(OrtCustomOp const*, size_t i)
{
    return i == kQmmOffsets || i == kQmmResidual || i == kQmmNormWeight ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

struct QmmKernel : Epilogue
{
    int64_t K, N, bits, block;
};

OrtStatus* qmmInvalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmQuantMatMul: " + m).c_str());
}

// The tiles of a GsmQuantMatMul weight among an op's inputs (codes, scales, optional offsets at the given indices):
// their element types (float32 or float16 parameters) and shapes for the kernel's K, N, bits and block_size
OrtStatus* tileInputs(QmmKernel const& kn, OrtValue const* const* v, std::vector<int64_t> const* sh, size_t codes,
    size_t scales, size_t offs, OrtStatus* (*fail)(std::string const&), ONNXTensorElementDataType* scaleType,
    ONNXTensorElementDataType* offType)
{
    using gsm::ortcpu::kQSubBlock;
    using gsm::ortcpu::kQTileRows;
    *scaleType = *offType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(v[scales], scaleType));
    bool const offsets = v[offs] != nullptr;
    if (offsets)
    {
        GSM_ORT_TRY(elementType(v[offs], offType));
    }
    for (auto t : {*scaleType, offsets ? *offType : *scaleType})
    {
        if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
        {
            return fail("inputs scales and offsets must be float32 or float16");
        }
    }
    int64_t const G = (kn.K + kn.block - 1) / kn.block, NT = (kn.N + kQTileRows - 1) / kQTileRows;
    std::vector<int64_t> const codesWant{NT, G * kn.block / kQSubBlock, gsm::ortcpu::quantSubBlockBytes(kn.bits)};
    std::vector<int64_t> const paramWant{NT, G, kQTileRows};
    if (sh[codes] != codesWant || sh[scales] != paramWant || (offsets && sh[offs] != paramWant))
    {
        return fail("inputs codes " + dimsText(sh[codes]) + ", scales " + dimsText(sh[scales])
            + (offsets ? ", offsets " + dimsText(sh[offs]) : std::string()) + ": expected " + dimsText(codesWant)
            + " and " + dimsText(paramWant) + " (K = " + std::to_string(kn.K) + ", N = " + std::to_string(kn.N)
            + ", bits = " + std::to_string(kn.bits) + ", block_size = " + std::to_string(kn.block)
            + ": tiles of 16 rows, sub-blocks of 32 inputs)");
    }
    return nullptr;
}

// Attributes K, N, bits (4 or 8) and block_size (a multiple of 32) of an op over tiles
OrtStatus* tileAttributes(OrtKernelInfo const* info, QmmKernel* kn, OrtStatus* (*fail)(std::string const&))
{
    for (auto [name, dst] : {std::pair<char const*, int64_t*>{"K", &kn->K}, {"N", &kn->N}, {"bits", &kn->bits},
             {"block_size", &kn->block}})
    {
        GSM_ORT_TRY(attribute(info, name, dst, fail));
        if (*dst <= 0)
        {
            return fail(std::string("attribute ") + name + " = " + std::to_string(*dst) + " must be positive");
        }
    }
    if (kn->bits != 4 && kn->bits != 8)
    {
        return fail("attribute bits = " + std::to_string(kn->bits) + " must be 4 or 8");
    }
    if (kn->block % gsm::ortcpu::kQSubBlock != 0)
    {
        return fail("attribute block_size = " + std::to_string(kn->block) + " must be a multiple of 32");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL qmmCompute(void* opKernel, OrtKernelContext* ctx)
{
    QmmKernel const& kn = *static_cast<QmmKernel const*>(opKernel);
    OrtValue const* v[kQmmNumInputs];
    std::vector<int64_t> sh[kQmmNumInputs];
    GSM_ORT_TRY(readInputs(ctx, kQmmNumInputs, kQmmInputNames, qmmInputKind, v, sh, qmmInvalid));
    ONNXTensorElementDataType scaleType, offType;
    GSM_ORT_TRY(tileInputs(kn, v, sh, kQmmCodes, kQmmScales, kQmmOffsets, qmmInvalid, &scaleType, &offType));
    if (sh[kQmmX].size() != 2 || sh[kQmmX][1] != kn.K)
    {
        return qmmInvalid("input x has shape " + dimsText(sh[kQmmX]) + ", expected [M, " + std::to_string(kn.K) + "]");
    }
    int64_t const M = sh[kQmmX][0];
    if (kn.swiglu != 0 && (v[kQmmResidual] != nullptr || kn.N % 2 != 0))
    {
        return qmmInvalid("with swiglu = 1 N must be even (gate, then up) and there is no residual");
    }
    if (v[kQmmResidual] != nullptr && sh[kQmmResidual] != std::vector<int64_t>{M, kn.N})
    {
        return qmmInvalid("input residual has shape " + dimsText(sh[kQmmResidual]) + ", expected [" + std::to_string(M)
            + ", " + std::to_string(kn.N) + "]");
    }
    void* p[kQmmNumInputs];
    GSM_ORT_TRY(inputData(v, kQmmNumInputs, p));
    gsm::ortcpu::GroupOffsetArgs e;  // the epilogue (residual, SwiGLU, norm) over the full product
    e.M = M;
    e.K = kn.K;
    e.N = kn.N;
    e.block = kn.block;
    e.x = static_cast<float const*>(p[kQmmX]);
    e.residual = static_cast<float const*>(p[kQmmResidual]);
    GSM_ORT_TRY(epilogueOutputs(ctx, kn, static_cast<float const*>(p[kQmmNormWeight]), sh[kQmmNormWeight], &e,
        qmmInvalid));
    bool const plain = e.residual == nullptr && !e.swiglu && e.normed == nullptr;
    static thread_local std::vector<float> full;
    gsm::ortcpu::QuantMatMulArgs a;
    a.M = M;
    a.K = kn.K;
    a.N = kn.N;
    a.bits = kn.bits;
    a.block = kn.block;
    a.x = e.x;
    a.codes = static_cast<uint8_t const*>(p[kQmmCodes]);
    a.scales = p[kQmmScales];
    a.offsets = p[kQmmOffsets];
    a.halfScales = scaleType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.halfOffsets = offType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (!plain)
    {
        full.resize(static_cast<size_t>(M * kn.N));
    }
    a.y = plain ? e.y : full.data();
    gsm::ortcpu::ParallelRunner par;
    par.run = runParallel;
    par.ctx = ctx;
    if (!gsm::ortcpu::runQuantMatMul(a, par))
    {
        return gApi->CreateStatus(ORT_FAIL, "GsmQuantMatMul: the intra-op thread pool failed");
    }
    e.main = full.data();
    if (!plain && !gsm::ortcpu::runGroupOffset(e, par))
    {
        return gApi->CreateStatus(ORT_FAIL, "GsmQuantMatMul: the intra-op thread pool failed");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL qmmCreateKernel(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    QmmKernel kn{};
    GSM_ORT_TRY(tileAttributes(info, &kn, qmmInvalid));
    GSM_ORT_TRY(epilogueAttributes(info, &kn, qmmInvalid));
    *kernel = new QmmKernel(kn);
    return nullptr;
}

void ORT_API_CALL qmmDestroyKernel(void* kernel)
{
    delete static_cast<QmmKernel*>(kernel);
}

char const* ORT_API_CALL qmmOpName(OrtCustomOp const*)
{
    return kQmmOpName;
}

ONNXTensorElementDataType ORT_API_CALL qmmInputType(OrtCustomOp const*, size_t i)
{
    if (i == kQmmCodes)
    {
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    }
    // scales, offsets: float32 or float16, checked per call
    return i == kQmmScales || i == kQmmOffsets ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL qmmInputCount(OrtCustomOp const*)
{
    return kQmmNumInputs;
}

// -- GsmTileGather ----------------------------------------------------------------------------------------------
// Rows of GsmQuantMatMul's tiled weight (an embedding tied to the LM head: the head's bytes, read once)
constexpr char const* kGatherOpName = "GsmTileGather";
enum GatherInput : size_t
{
    kGatherIds, kGatherCodes, kGatherScales, kGatherOffsets, kGatherNumInputs
};
char const* const kGatherInputNames[kGatherNumInputs] = {"ids", "codes", "scales", "offsets"};

OrtCustomOpInputOutputCharacteristic ORT_API_CALL gatherInputKind(OrtCustomOp const*, size_t i)
{
    return i == kGatherOffsets ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

OrtStatus* gatherInvalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmTileGather: " + m).c_str());
}

OrtStatus* ORT_API_CALL gatherCompute(void* opKernel, OrtKernelContext* ctx)
{
    QmmKernel const& kn = *static_cast<QmmKernel const*>(opKernel);  // K, N, bits, block_size
    OrtValue const* v[kGatherNumInputs];
    std::vector<int64_t> sh[kGatherNumInputs];
    GSM_ORT_TRY(readInputs(ctx, kGatherNumInputs, kGatherInputNames, gatherInputKind, v, sh, gatherInvalid));
    ONNXTensorElementDataType scaleType, offType;
    GSM_ORT_TRY(tileInputs(kn, v, sh, kGatherCodes, kGatherScales, kGatherOffsets, gatherInvalid, &scaleType,
        &offType));
    int64_t M = 1;
    for (int64_t d : sh[kGatherIds])
    {
        M *= d;
    }
    void* p[kGatherNumInputs];
    GSM_ORT_TRY(inputData(v, kGatherNumInputs, p));
    int64_t const outDims[2] = {M, kn.K};
    OrtValue* ov = nullptr;
    GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, 0, outDims, 2, &ov));
    void* y = nullptr;
    GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &y));
    gsm::ortcpu::QuantGatherArgs a;
    a.M = M;
    a.K = kn.K;
    a.N = kn.N;
    a.bits = kn.bits;
    a.block = kn.block;
    a.ids = static_cast<int64_t const*>(p[kGatherIds]);
    a.codes = static_cast<uint8_t const*>(p[kGatherCodes]);
    a.scales = p[kGatherScales];
    a.offsets = p[kGatherOffsets];
    a.halfScales = scaleType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.halfOffsets = offType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.y = static_cast<float*>(y);
    int64_t const bad = gsm::ortcpu::gatherQuantRows(a);
    if (bad >= 0)
    {
        return gatherInvalid("ids[" + std::to_string(bad) + "] = " + std::to_string(a.ids[bad]) + " is outside [0, "
            + std::to_string(kn.N) + ")");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL gatherCreateKernel(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info,
    void** kernel)
{
    QmmKernel kn{};
    GSM_ORT_TRY(tileAttributes(info, &kn, gatherInvalid));
    *kernel = new QmmKernel(kn);
    return nullptr;
}

char const* ORT_API_CALL gatherOpName(OrtCustomOp const*)
{
    return kGatherOpName;
}

ONNXTensorElementDataType ORT_API_CALL gatherInputType(OrtCustomOp const*, size_t i)
{
    if (i == kGatherIds)
    {
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    }
    return i == kGatherCodes ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

size_t ORT_API_CALL gatherInputCount(OrtCustomOp const*)
{
    return kGatherNumInputs;
}

size_t ORT_API_CALL gatherOutputCount(OrtCustomOp const*)
{
    return 1;
}

// -- GsmSideSplit -----------------------------------------------------------------------------------------------
constexpr char const* kSideOpName = "GsmSideSplit";
enum SideInput : size_t
{
    kSideY, kSideScale, kSideShape, kSideKeysLike, kSideNumInputs
};
char const* const kSideInputNames[kSideNumInputs] = {"y", "scale", "batch_shape", "keys_like"};
char const* const kSideOutputNames[gsm::ortcpu::kSideBlocks] = {"latent_k", "latent_v", "index_key", "index_q",
    "index_w"};

struct SideKernel
{
    int64_t widths[gsm::ortcpu::kSideBlocks];
};

OrtStatus* sideInvalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmSideSplit: " + m).c_str());
}

OrtStatus* ORT_API_CALL sideCompute(void* opKernel, OrtKernelContext* ctx)
{
    using gsm::ortcpu::kSideBlocks;
    SideKernel const& kn = *static_cast<SideKernel const*>(opKernel);
    OrtValue const* v[kSideNumInputs];
    std::vector<int64_t> sh[kSideNumInputs];
    for (size_t i = 0; i < kSideNumInputs; ++i)
    {
        GSM_ORT_TRY(optionalInputShape(ctx, i, &v[i], &sh[i]));
        if (v[i] == nullptr)
        {
            return sideInvalid(std::string("input ") + kSideInputNames[i] + " is missing");
        }
    }
    // the index key leaves as the key cache holds it: keys_like is that buffer (only its type and width are read)
    ONNXTensorElementDataType keyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(v[kSideKeysLike], &keyType));
    if (keyType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && keyType != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
    {
        return sideInvalid("input keys_like must be float16 or int8 (the key cache's type)");
    }
    int64_t W = 0;
    for (int64_t w : kn.widths)
    {
        W += w;
    }
    if (sh[kSideY].size() != 2 || sh[kSideY][1] != W)
    {
        return sideInvalid("input y has shape " + dimsText(sh[kSideY]) + ", expected [M, " + std::to_string(W)
            + "] (the sum of widths)");
    }
    if (sh[kSideScale] != std::vector<int64_t>{W})
    {
        return sideInvalid("input scale has shape " + dimsText(sh[kSideScale]) + ", expected [" + std::to_string(W)
            + "]");
    }
    if (sh[kSideKeysLike].empty() || sh[kSideKeysLike].back() != kn.widths[gsm::ortcpu::kSideIndexKey])
    {
        return sideInvalid("input keys_like has shape " + dimsText(sh[kSideKeysLike]) + ", expected a last axis of "
            + std::to_string(kn.widths[gsm::ortcpu::kSideIndexKey]) + " (widths[2], the index key's)");
    }
    if (sh[kSideShape] != std::vector<int64_t>{2})
    {
        return sideInvalid("input batch_shape has shape " + dimsText(sh[kSideShape]) + ", expected [2] ([B, S])");
    }
    void* p[kSideNumInputs];
    for (size_t i = 0; i < kSideNumInputs; ++i)
    {
        GSM_ORT_TRY(gApi->GetTensorMutableData(const_cast<OrtValue*>(v[i]), &p[i]));
    }
    int64_t const* bs = static_cast<int64_t const*>(p[kSideShape]);
    if (bs[0] < 0 || bs[1] < 0 || bs[0] * bs[1] != sh[kSideY][0])
    {
        return sideInvalid("input batch_shape = [" + std::to_string(bs[0]) + ", " + std::to_string(bs[1])
            + "] does not give y's " + std::to_string(sh[kSideY][0]) + " rows (B * S)");
    }
    gsm::ortcpu::SideSplitArgs a;
    a.M = sh[kSideY][0];
    a.W = W;
    a.y = static_cast<float const*>(p[kSideY]);
    a.scale = static_cast<float const*>(p[kSideScale]);
    a.int8Keys = keyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    for (int b = 0; b < kSideBlocks; ++b)
    {
        a.widths[b] = kn.widths[b];
        int64_t const dims[3] = {bs[0], bs[1], kn.widths[b]};
        OrtValue* ov = nullptr;
        GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, static_cast<size_t>(b), dims, 3, &ov));
        void* o = nullptr;
        GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &o));
        if (b == gsm::ortcpu::kSideIndexKey)
        {
            a.keys = o;
        }
        else
        {
            a.out[b] = static_cast<float*>(o);
        }
    }
    gsm::ortcpu::ParallelRunner par;
    par.run = runParallel;
    par.ctx = ctx;
    if (!gsm::ortcpu::runSideSplit(a, par))
    {
        return gApi->CreateStatus(ORT_FAIL, "GsmSideSplit: the intra-op thread pool failed");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL sideCreateKernel(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    SideKernel kn{};
    size_t n = gsm::ortcpu::kSideBlocks;
    OrtStatus* st = gApi->KernelInfoGetAttributeArray_int64(info, "widths", kn.widths, &n);
    if (st != nullptr || n != static_cast<size_t>(gsm::ortcpu::kSideBlocks))
    {
        std::string m = st != nullptr ? std::string(": ") + gApi->GetErrorMessage(st) : std::string();
        if (st != nullptr)
        {
            gApi->ReleaseStatus(st);
        }
        return sideInvalid("attribute widths must be 5 int64 (rk, rv, index_dim, index_heads*index_dim, "
                           "index_heads)" + m);
    }
    for (int64_t w : kn.widths)
    {
        if (w <= 0)
        {
            return sideInvalid("attribute widths holds " + std::to_string(w) + ": every width must be positive");
        }
    }
    *kernel = new SideKernel(kn);
    return nullptr;
}

void ORT_API_CALL sideDestroyKernel(void* kernel)
{
    delete static_cast<SideKernel*>(kernel);
}

char const* ORT_API_CALL sideOpName(OrtCustomOp const*)
{
    return kSideOpName;
}

ONNXTensorElementDataType ORT_API_CALL sideInputType(OrtCustomOp const*, size_t i)
{
    if (i == kSideShape)
    {
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    }
    // keys_like: float16 or int8; the index_key output takes its type (ONNX Runtime's custom-op type inference
    // gives an undefined output the type of the last input whose type is open)
    return i == kSideKeysLike ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL sideInputCount(OrtCustomOp const*)
{
    return kSideNumInputs;
}

ONNXTensorElementDataType ORT_API_CALL sideOutputType(OrtCustomOp const*, size_t i)
{
    return i == gsm::ortcpu::kSideIndexKey ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL sideOutputCount(OrtCustomOp const*)
{
    return gsm::ortcpu::kSideBlocks;
}

OrtCustomOp makeOp()
{
    OrtCustomOp op;
    std::memset(&op, 0, sizeof op);
    op.version = kApiVersion;
    op.GetName = opName;
    op.GetExecutionProviderType = opProvider;
    op.GetInputType = inputType;
    op.GetInputTypeCount = inputCount;
    op.GetOutputType = outputType;
    op.GetOutputTypeCount = outputCount;
    op.KernelDestroy = destroyKernel;
    op.GetInputCharacteristic = required;
    op.GetOutputCharacteristic = required;
    op.GetInputMemoryType = memDefault;
    op.GetVariadicInputMinArity = one;
    op.GetVariadicInputHomogeneity = one;
    op.GetVariadicOutputMinArity = one;
    op.GetVariadicOutputHomogeneity = one;
    op.CreateKernelV2 = createKernelV2;
    op.KernelComputeV2 = computeV2;
    op.GetStartVersion = startVersion;
    op.GetEndVersion = endVersion;
    return op;
}

// -- the pool ops' shared glue -----------------------------------------------------------------------------------
// The pool's region sizes: attributes rows_fp16, rows_int12, rows_int8, rows_int4 (engine_io section 3).
OrtStatus* poolRowsAttributes(OrtKernelInfo const* info, int64_t rows[4], OrtStatus* (*fail)(std::string const&))
{
    char const* const names[4] = {"rows_fp16", "rows_int12", "rows_int8", "rows_int4"};
    for (int i = 0; i < 4; ++i)
    {
        GSM_ORT_TRY(attribute(info, names[i], &rows[i], fail));
        if (rows[i] < 0 || rows[i] > gsm::kSlotRowMask)
        {
            return fail(std::string("attribute ") + names[i] + " = " + std::to_string(rows[i])
                + " is outside [0, 2^24)");
        }
    }
    return nullptr;
}

// The layout of a pool of latent ranks rk, rv over N positions with the attributes' regions.
gsm::GsmDims poolLayout(int64_t rk, int64_t rv, int64_t N, int64_t const rows[4])
{
    gsm::GsmDims g{};
    g.rankK = static_cast<int32_t>(rk);
    g.rankV = static_cast<int32_t>(rv);
    g.nMax = static_cast<int32_t>(N);
    g.rowsFP16 = static_cast<int32_t>(rows[0]);
    g.rowsINT12 = static_cast<int32_t>(rows[1]);
    g.rowsINT8 = static_cast<int32_t>(rows[2]);
    g.rowsINT4 = static_cast<int32_t>(rows[3]);
    return g;
}

// A pool, its slot table, quant table and a row cache of capacity C, from the node's input buffers.
gsm::ortcpu::PoolSource poolSource(gsm::GsmDims const& g, void* pool, void* slots, void* quant, void* rowCache,
    void* rowTags, int64_t C)
{
    gsm::ortcpu::PoolSource ps;
    ps.dims = g;
    ps.pool = static_cast<uint8_t*>(pool);
    ps.poolBytes = 4 * gsm::poolWords(g);
    ps.slots = static_cast<int32_t const*>(slots);
    ps.quant = static_cast<float const*>(quant);
    ps.cacheRows = static_cast<float*>(rowCache);
    ps.cacheTags = static_cast<int32_t*>(rowTags);
    ps.capacity = C;
    return ps;
}

template <class T>
void ORT_API_CALL destroyAs(void* kernel)
{
    delete static_cast<T*>(kernel);
}

// -- GsmPoolAttention -------------------------------------------------------------------------------------------
// GsmCachedAttention's math over the plugins' pools (gsmPoolRows.h): the cache the reference and TensorRT backends
// hold, read and written in place (kv_pool, index_keys, the row cache and its tags are the runtime's buffers, bound
// without a copy; ONNX Runtime 1.17's custom ops cannot declare an output aliasing an input, so the op writes its
// inputs, as the TensorRT plugins write their aliased pools).
constexpr char const* kPoolOpName = "GsmPoolAttention";
enum PoolInput : size_t
{
    kPQ, kPIndexQ, kPIndexW, kPNewLatentK, kPNewLatentV, kPNewIndexKeys, kPPool, kPIndexKeys, kPSlots, kPQuant,
    kPRowCache, kPRowTags, kPKUp, kPVUp, kPRopeCos, kPRopeSin, kPCacheRows, kPPastLengths, kPNewLengths,
    kPSparseWindow, kPSparseTopK, kPLogitRows, kPNumInputs
};
char const* const kPoolInputNames[kPNumInputs] = {"q", "index_q", "index_w", "new_latent_k", "new_latent_v",
    "new_index_keys", "kv_pool", "index_keys", "kv_slots", "quant", "row_cache", "row_cache_tags", "k_up", "v_up",
    "rope_cos", "rope_sin", "cache_rows", "past_lengths", "new_lengths", "sparse_window", "sparse_top_k",
    "logit_rows"};
// attn_out, selected, attn_mass, then optional: row_cache_misses, query_mass (needs input logit_rows)
constexpr size_t kPoolOutputs = 5;

struct PoolKernel
{
    int64_t numHeads, numKvHeads, headDim, indexHeads, indexDim, sinkTokens, topKDivisor;
    int64_t rows[4]; // rows_fp16, rows_int12, rows_int8, rows_int4
};

OrtStatus* poolInvalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmPoolAttention: " + m).c_str());
}

OrtStatus* poolShape(size_t i, std::vector<int64_t> const& got, std::vector<int64_t> const& want, char const* meaning)
{
    bool ok = got.size() == want.size();
    for (size_t a = 0; ok && a < want.size(); ++a)
    {
        ok = want[a] == got[a];
    }
    return ok ? nullptr
              : poolInvalid(std::string("input ") + kPoolInputNames[i] + " has shape " + dimsText(got) + ", expected "
                  + dimsText(want) + " (" + meaning + ")");
}

OrtStatus* ORT_API_CALL poolCompute(void* opKernel, OrtKernelContext* ctx)
{
    PoolKernel const& kn = *static_cast<PoolKernel const*>(opKernel);
    OrtValue const* v[kPNumInputs];
    std::vector<int64_t> sh[kPNumInputs];
    for (size_t i = 0; i < kPNumInputs; ++i)
    {
        GSM_ORT_TRY(optionalInputShape(ctx, i, &v[i], &sh[i]));
        if (v[i] == nullptr && i != kPLogitRows)
        {
            return poolInvalid(std::string("input ") + kPoolInputNames[i] + " is missing");
        }
    }
    ONNXTensorElementDataType newKeyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, keyType = newKeyType;
    ONNXTensorElementDataType kUpType = newKeyType, vUpType = newKeyType;
    GSM_ORT_TRY(elementType(v[kPNewIndexKeys], &newKeyType));
    GSM_ORT_TRY(elementType(v[kPIndexKeys], &keyType));
    GSM_ORT_TRY(elementType(v[kPKUp], &kUpType));
    GSM_ORT_TRY(elementType(v[kPVUp], &vUpType));
    bool const int8Keys = newKeyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if (!(int8Keys && keyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
        && !(newKeyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && keyType == newKeyType))
    {
        return poolInvalid("new_index_keys and index_keys must be int8 codes and int32 words of them, or both float16");
    }
    if (kUpType != vUpType
        || (kUpType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && kUpType != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16))
    {
        return poolInvalid("inputs k_up and v_up must both be float or both float16");
    }
    if (sh[kPIndexQ].size() != 3 || sh[kPKUp].size() != 2 || sh[kPVUp].size() != 2 || sh[kPSlots].size() != 2
        || sh[kPPool].size() != 2 || sh[kPRowCache].size() != 3)
    {
        return poolInvalid("inputs index_q " + dimsText(sh[kPIndexQ]) + ", k_up " + dimsText(sh[kPKUp]) + ", v_up "
            + dimsText(sh[kPVUp]) + ", kv_slots " + dimsText(sh[kPSlots]) + ", kv_pool " + dimsText(sh[kPPool])
            + ", row_cache " + dimsText(sh[kPRowCache]) + ": expected [B, S, nI*dI], [kvD, rk], [kvD, rv], "
            "[B, N_max], [R, P32], [R, C, kvD]");
    }
    gsm::ortcpu::CachedAttentionDims d;
    d.nH = kn.numHeads;
    d.nKV = kn.numKvHeads;
    d.D = kn.headDim;
    d.nI = kn.indexHeads;
    d.dI = kn.indexDim;
    d.sinks = kn.sinkTokens;
    d.topKDivisor = kn.topKDivisor;
    d.B = sh[kPIndexQ][0];
    d.S = sh[kPIndexQ][1];
    d.N = sh[kPSlots][1];
    d.R = sh[kPPool][0];
    d.rk = sh[kPKUp][1];
    d.rv = sh[kPVUp][1];
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D, C = sh[kPRowCache][1];
    gsm::GsmDims g = poolLayout(d.rk, d.rv, d.N, kn.rows);
    g.indexDim = static_cast<int32_t>(d.dI);
    g.indexKeyBits = int8Keys ? 8 : 16;
    int64_t const keyWidth = int8Keys ? (d.dI + 3) / 4 : d.dI;
    bool const flatQ = sh[kPQ].size() == 2;
    GSM_ORT_TRY(poolShape(kPQ, sh[kPQ], flatQ ? std::vector<int64_t>{B * S, d.nH * d.D}
                                               : std::vector<int64_t>{B, S, d.nH * d.D},
        "[B, S, num_heads*head_dim] or [B*S, ...]"));
    GSM_ORT_TRY(poolShape(kPIndexQ, sh[kPIndexQ], {B, S, d.nI * d.dI}, "[B, S, index_heads*index_dim]"));
    GSM_ORT_TRY(poolShape(kPIndexW, sh[kPIndexW], {B, S, d.nI}, "[B, S, index_heads]"));
    GSM_ORT_TRY(poolShape(kPNewLatentK, sh[kPNewLatentK], {B, S, d.rk}, "[B, S, rk], rk from k_up"));
    GSM_ORT_TRY(poolShape(kPNewLatentV, sh[kPNewLatentV], {B, S, d.rv}, "[B, S, rv], rv from v_up"));
    GSM_ORT_TRY(poolShape(kPNewIndexKeys, sh[kPNewIndexKeys], {B, S, d.dI}, "[B, S, index_dim]"));
    GSM_ORT_TRY(poolShape(kPPool, sh[kPPool], {d.R, gsm::poolWords(g)}, "[R, P32] of the rows_* attributes"));
    GSM_ORT_TRY(poolShape(kPIndexKeys, sh[kPIndexKeys], {d.R, d.N, keyWidth},
        "[R, N_max, index_dim] float16, or [R, N_max, ceil(index_dim / 4)] int32 words of INT8 codes"));
    GSM_ORT_TRY(poolShape(kPSlots, sh[kPSlots], {B, d.N}, "[B, N_max]"));
    GSM_ORT_TRY(poolShape(kPQuant, sh[kPQuant], {5, d.rk + d.rv}, "[5, rk + rv]: s12, s8, comp8, s4, comp4"));
    GSM_ORT_TRY(poolShape(kPRowCache, sh[kPRowCache], {d.R, C, kvD}, "[R, C, num_kv_heads*head_dim]"));
    GSM_ORT_TRY(poolShape(kPRowTags, sh[kPRowTags], {d.R, gsm::ortcpu::kTagRows, C}, "[R, 3, C]"));
    GSM_ORT_TRY(poolShape(kPKUp, sh[kPKUp], {kvD, d.rk}, "[num_kv_heads*head_dim, rk]"));
    GSM_ORT_TRY(poolShape(kPVUp, sh[kPVUp], {kvD, d.rv}, "[num_kv_heads*head_dim, rv]"));
    GSM_ORT_TRY(poolShape(kPRopeCos, sh[kPRopeCos], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(poolShape(kPRopeSin, sh[kPRopeSin], {d.N, d.D}, "[N_max, head_dim]"));
    for (size_t i : {kPCacheRows, kPPastLengths, kPNewLengths, kPSparseTopK})
    {
        GSM_ORT_TRY(poolShape(i, sh[i], {B}, "[B]"));
    }
    GSM_ORT_TRY(poolShape(kPSparseWindow, sh[kPSparseWindow], {1}, "[1]"));
    int64_t const J = v[kPLogitRows] == nullptr ? 0 : (sh[kPLogitRows].size() == 2 ? sh[kPLogitRows][1] : -1);
    if (v[kPLogitRows] != nullptr)
    {
        GSM_ORT_TRY(poolShape(kPLogitRows, sh[kPLogitRows], {B, J}, "[B, J]"));
    }
    if (g.rowsFP16 + static_cast<int64_t>(g.rowsINT12) + g.rowsINT8 + g.rowsINT4 < d.N)
    {
        return poolInvalid("attributes rows_fp16 + rows_int12 + rows_int8 + rows_int4 are below N_max = "
            + std::to_string(d.N) + " (one row per position)");
    }

    void* p[kPNumInputs] = {};
    for (size_t i = 0; i < kPNumInputs; ++i)
    {
        if (v[i] != nullptr)
        {
            GSM_ORT_TRY(gApi->GetTensorMutableData(const_cast<OrtValue*>(v[i]), &p[i]));
        }
    }
    int32_t const* logitRows = static_cast<int32_t const*>(p[kPLogitRows]);
    for (int64_t i = 0; i < B * J; ++i)
    {
        if (logitRows[i] < 0 || logitRows[i] >= S)
        {
            return poolInvalid("logit_rows[" + std::to_string(i / J) + ", " + std::to_string(i % J) + "] = "
                + std::to_string(logitRows[i]) + " is outside [0, S = " + std::to_string(S) + ")");
        }
    }
    gsm::ortcpu::PoolSource ps = poolSource(g, p[kPPool], p[kPSlots], p[kPQuant], p[kPRowCache], p[kPRowTags], C);
    ps.indexKeys = p[kPIndexKeys];
    gsm::ortcpu::CachedAttentionInputs in;
    in.q = static_cast<float const*>(p[kPQ]);
    in.indexQ = static_cast<float const*>(p[kPIndexQ]);
    in.indexW = static_cast<float const*>(p[kPIndexW]);
    in.newLatentK = static_cast<float const*>(p[kPNewLatentK]);
    in.newLatentV = static_cast<float const*>(p[kPNewLatentV]);
    in.newIndexKeys = p[kPNewIndexKeys];
    in.indexKeys = p[kPIndexKeys];
    in.int8Keys = int8Keys;
    in.keyStride = int8Keys ? 4 * keyWidth : d.dI;
    in.kUp = p[kPKUp];
    in.vUp = p[kPVUp];
    in.halfUp = kUpType == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    in.ropeCos = static_cast<float const*>(p[kPRopeCos]);
    in.ropeSin = static_cast<float const*>(p[kPRopeSin]);
    in.cacheRows = static_cast<int32_t const*>(p[kPCacheRows]);
    in.pastLengths = static_cast<int32_t const*>(p[kPPastLengths]);
    in.newLengths = static_cast<int32_t const*>(p[kPNewLengths]);
    in.window = *static_cast<int32_t const*>(p[kPSparseWindow]);
    in.topK = static_cast<int32_t const*>(p[kPSparseTopK]);
    in.pool = &ps;
    in.massRows = logitRows;
    in.J = J;

    std::string err;
    int64_t k = 0, L = 0;
    if (!gsm::ortcpu::prepareCachedAttention(d, in, &k, &L, &err))
    {
        return gApi->CreateStatus(ORT_INVALID_ARGUMENT, err.c_str());
    }
    size_t outputs = 0;
    GSM_ORT_TRY(gApi->KernelContext_GetOutputCount(ctx, &outputs));
    if (outputs > 4 && logitRows == nullptr)
    {
        return poolInvalid("output query_mass needs input logit_rows (the rows whose queries it measures)");
    }
    int64_t const outDims[kPoolOutputs][3] = {{B, S, d.nH * d.D}, {B, S, k}, {B, L, 0}, {B, 0, 0}, {B, J, L}};
    int64_t const flatOut[2] = {B * S, d.nH * d.D};
    size_t const outRank[kPoolOutputs] = {flatQ ? size_t{2} : size_t{3}, 3, 2, 1, 3};
    void* o[kPoolOutputs] = {};
    for (size_t i = 0; i < outputs && i < kPoolOutputs; ++i)
    {
        OrtValue* ov = nullptr;
        GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, i, i == 0 && flatQ ? flatOut : outDims[i], outRank[i], &ov));
        if (ov != nullptr)
        {
            GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &o[i]));
        }
    }
    ps.misses = static_cast<int32_t*>(o[3]);
    static thread_local std::vector<float> newKRows; // the call's K rows: scratch (the row cache keeps them)
    newKRows.resize(static_cast<size_t>(B * S * kvD));
    gsm::ortcpu::CachedAttentionOutputs out;
    out.attnOut = static_cast<float*>(o[0]);
    out.newKRows = newKRows.data();
    out.selected = static_cast<int32_t*>(o[1]);
    out.attnMass = static_cast<float*>(o[2]);
    out.queryMass = static_cast<float*>(o[4]);
    gsm::ortcpu::ParallelRunner par;
    par.run = runParallel;
    par.ctx = ctx;
    if (!gsm::ortcpu::runCachedAttention(d, in, k, L, out, par, &err))
    {
        return gApi->CreateStatus(ORT_FAIL, err.c_str());
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL poolCreateKernel(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    PoolKernel kn{};
    GSM_ORT_TRY(attribute(info, "num_heads", &kn.numHeads, poolInvalid));
    GSM_ORT_TRY(attribute(info, "num_kv_heads", &kn.numKvHeads, poolInvalid));
    GSM_ORT_TRY(attribute(info, "head_dim", &kn.headDim, poolInvalid));
    GSM_ORT_TRY(attribute(info, "index_heads", &kn.indexHeads, poolInvalid));
    GSM_ORT_TRY(attribute(info, "index_dim", &kn.indexDim, poolInvalid));
    GSM_ORT_TRY(attribute(info, "sink_tokens", &kn.sinkTokens, poolInvalid));
    GSM_ORT_TRY(optionalAttribute(info, "sparse_top_k_divisor", 0, &kn.topKDivisor, poolInvalid));
    GSM_ORT_TRY(poolRowsAttributes(info, kn.rows, poolInvalid));
    if (kn.numHeads <= 0 || kn.numKvHeads <= 0 || kn.numHeads % kn.numKvHeads != 0 || kn.headDim <= 0
        || kn.headDim % 2 != 0 || kn.indexHeads <= 0 || kn.indexDim <= 0 || kn.sinkTokens < 0 || kn.topKDivisor < 0)
    {
        return poolInvalid("attributes num_heads, num_kv_heads (a divisor of num_heads), head_dim (even), index_heads "
            "and index_dim must be positive, sink_tokens and sparse_top_k_divisor >= 0");
    }
    *kernel = new PoolKernel(kn);
    return nullptr;
}

char const* ORT_API_CALL poolOpName(OrtCustomOp const*)
{
    return kPoolOpName;
}

ONNXTensorElementDataType ORT_API_CALL poolInputType(OrtCustomOp const*, size_t i)
{
    switch (i)
    {
    case kPNewIndexKeys:
    case kPIndexKeys:
    case kPKUp:
    case kPVUp: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // checked per call
    case kPPool:
    case kPSlots:
    case kPRowTags: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    default: return i >= kPCacheRows ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
}

size_t ORT_API_CALL poolInputCount(OrtCustomOp const*)
{
    return kPNumInputs;
}

ONNXTensorElementDataType ORT_API_CALL poolOutputType(OrtCustomOp const*, size_t i)
{
    return i == 1 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL poolOutputCount(OrtCustomOp const*)
{
    return kPoolOutputs;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL poolInputKind(OrtCustomOp const*, size_t i)
{
    return i == kPLogitRows ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL poolOutputKind(OrtCustomOp const*, size_t i)
{
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

// -- GsmPoolSharedAttention -------------------------------------------------------------------------------------
constexpr char const* kSharedOpName = "GsmPoolSharedAttention";
enum SharedInput : size_t
{
    kSQ, kSPool, kSSlots, kSQuant, kSRowCache, kSRowTags, kSProjW, kSProjB, kSRopeCos, kSRopeSin, kSSelected,
    kSCacheRows, kSPastLengths, kSNewLengths, kSNumInputs
};
char const* const kSharedInputNames[kSNumInputs] = {"q", "kv_pool", "kv_slots", "quant", "row_cache",
    "row_cache_tags", "kv_proj_weight", "kv_proj_bias", "rope_cos", "rope_sin", "selected", "cache_rows",
    "past_lengths", "new_lengths"};

struct SharedKernel
{
    int64_t numHeads, numKvHeads, headDim, rankK;
    int64_t rows[4];
};

OrtStatus* sharedInvalid(std::string const& m)
{
    return gApi->CreateStatus(ORT_INVALID_ARGUMENT, ("GsmPoolSharedAttention: " + m).c_str());
}

OrtStatus* sharedShape(size_t i, std::vector<int64_t> const& got, std::vector<int64_t> const& want, char const* meaning)
{
    return got == want ? nullptr
                       : sharedInvalid(std::string("input ") + kSharedInputNames[i] + " has shape " + dimsText(got)
                           + ", expected " + dimsText(want) + " (" + meaning + ")");
}

OrtStatus* ORT_API_CALL sharedCompute(void* opKernel, OrtKernelContext* ctx)
{
    SharedKernel const& kn = *static_cast<SharedKernel const*>(opKernel);
    OrtValue const* v[kSNumInputs];
    std::vector<int64_t> sh[kSNumInputs];
    for (size_t i = 0; i < kSNumInputs; ++i)
    {
        GSM_ORT_TRY(optionalInputShape(ctx, i, &v[i], &sh[i]));
        if (v[i] == nullptr)
        {
            return sharedInvalid(std::string("input ") + kSharedInputNames[i] + " is missing");
        }
    }
    if (sh[kSSelected].size() != 3 || sh[kSProjW].size() != 2 || sh[kSSlots].size() != 2 || sh[kSPool].size() != 2
        || sh[kSRowCache].size() != 3)
    {
        return sharedInvalid("inputs selected " + dimsText(sh[kSSelected]) + ", kv_proj_weight " + dimsText(sh[kSProjW])
            + ", kv_slots " + dimsText(sh[kSSlots]) + ", kv_pool " + dimsText(sh[kSPool]) + ", row_cache "
            + dimsText(sh[kSRowCache]) + ": expected [B, S, k], [2*kvD, r], [B, N_max], [R, P32], [R, C, kvD]");
    }
    gsm::ortcpu::CachedAttentionDims d;
    d.nH = kn.numHeads;
    d.nKV = kn.numKvHeads;
    d.D = kn.headDim;
    d.B = sh[kSSelected][0];
    d.S = sh[kSSelected][1];
    d.N = sh[kSSlots][1];
    d.R = sh[kSPool][0];
    d.rk = kn.rankK;
    d.rv = sh[kSProjW][1] - kn.rankK;
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D, C = sh[kSRowCache][1];
    if (d.rv <= 0)
    {
        return sharedInvalid("kv_proj_weight has " + std::to_string(sh[kSProjW][1]) + " columns, not more than "
            "attribute rank_k = " + std::to_string(kn.rankK));
    }
    gsm::GsmDims const g = poolLayout(d.rk, d.rv, d.N, kn.rows);
    bool const flatQ = sh[kSQ].size() == 2;
    GSM_ORT_TRY(sharedShape(kSQ, sh[kSQ], flatQ ? std::vector<int64_t>{B * S, d.nH * d.D}
                                                 : std::vector<int64_t>{B, S, d.nH * d.D},
        "[B, S, num_heads*head_dim] or [B*S, ...]"));
    GSM_ORT_TRY(sharedShape(kSPool, sh[kSPool], {d.R, gsm::poolWords(g)}, "[R, P32] of the rows_* attributes"));
    GSM_ORT_TRY(sharedShape(kSSlots, sh[kSSlots], {B, d.N}, "[B, N_max]"));
    GSM_ORT_TRY(sharedShape(kSQuant, sh[kSQuant], {5, d.rk + d.rv}, "[5, r] of the source layer"));
    GSM_ORT_TRY(sharedShape(kSRowCache, sh[kSRowCache], {d.R, C, kvD}, "[R, C, num_kv_heads*head_dim]"));
    GSM_ORT_TRY(sharedShape(kSRowTags, sh[kSRowTags], {d.R, gsm::ortcpu::kTagRows, C}, "[R, 3, C]"));
    GSM_ORT_TRY(sharedShape(kSProjW, sh[kSProjW], {2 * kvD, d.rk + d.rv}, "[2*num_kv_heads*head_dim, r]"));
    GSM_ORT_TRY(sharedShape(kSProjB, sh[kSProjB], {2 * kvD}, "[2*num_kv_heads*head_dim]"));
    GSM_ORT_TRY(sharedShape(kSRopeCos, sh[kSRopeCos], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(sharedShape(kSRopeSin, sh[kSRopeSin], {d.N, d.D}, "[N_max, head_dim]"));
    for (size_t i : {kSCacheRows, kSPastLengths, kSNewLengths})
    {
        GSM_ORT_TRY(sharedShape(i, sh[i], {B}, "[B]"));
    }
    void* p[kSNumInputs];
    for (size_t i = 0; i < kSNumInputs; ++i)
    {
        GSM_ORT_TRY(gApi->GetTensorMutableData(const_cast<OrtValue*>(v[i]), &p[i]));
    }
    gsm::ortcpu::PoolSource ps = poolSource(g, p[kSPool], p[kSSlots], p[kSQuant], p[kSRowCache], p[kSRowTags], C);
    gsm::ortcpu::SharedAttentionInputs in;
    in.q = static_cast<float const*>(p[kSQ]);
    in.selected = static_cast<int32_t const*>(p[kSSelected]);
    in.k = sh[kSSelected][2];
    in.projW = static_cast<float const*>(p[kSProjW]);
    in.projB = static_cast<float const*>(p[kSProjB]);
    in.ropeCos = static_cast<float const*>(p[kSRopeCos]);
    in.ropeSin = static_cast<float const*>(p[kSRopeSin]);
    in.cacheRows = static_cast<int32_t const*>(p[kSCacheRows]);
    in.pastLengths = static_cast<int32_t const*>(p[kSPastLengths]);
    in.newLengths = static_cast<int32_t const*>(p[kSNewLengths]);
    in.pool = &ps;
    size_t outputs = 0;
    GSM_ORT_TRY(gApi->KernelContext_GetOutputCount(ctx, &outputs));
    int64_t const outDims[3] = {B, S, d.nH * d.D};
    int64_t const flatOut[2] = {B * S, d.nH * d.D};
    OrtValue* ov = nullptr;
    void* out = nullptr;
    GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, 0, flatQ ? flatOut : outDims, flatQ ? 2 : 3, &ov));
    GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &out));
    if (outputs > 1)
    {
        int64_t const bDims[1] = {B};
        void* m = nullptr;
        GSM_ORT_TRY(gApi->KernelContext_GetOutput(ctx, 1, bDims, 1, &ov));
        if (ov != nullptr)
        {
            GSM_ORT_TRY(gApi->GetTensorMutableData(ov, &m));
            ps.misses = static_cast<int32_t*>(m);
        }
    }
    gsm::ortcpu::ParallelRunner par;
    par.run = runParallel;
    par.ctx = ctx;
    std::string err;
    if (!gsm::ortcpu::runPoolSharedAttention(d, in, static_cast<float*>(out), par, &err))
    {
        return gApi->CreateStatus(ORT_INVALID_ARGUMENT, err.c_str());
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL sharedCreateKernel(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    SharedKernel kn{};
    GSM_ORT_TRY(attribute(info, "num_heads", &kn.numHeads, sharedInvalid));
    GSM_ORT_TRY(attribute(info, "num_kv_heads", &kn.numKvHeads, sharedInvalid));
    GSM_ORT_TRY(attribute(info, "head_dim", &kn.headDim, sharedInvalid));
    GSM_ORT_TRY(attribute(info, "rank_k", &kn.rankK, sharedInvalid));
    GSM_ORT_TRY(poolRowsAttributes(info, kn.rows, sharedInvalid));
    if (kn.numHeads <= 0 || kn.numKvHeads <= 0 || kn.numHeads % kn.numKvHeads != 0 || kn.headDim <= 0
        || kn.headDim % 2 != 0 || kn.rankK <= 0)
    {
        return sharedInvalid("attributes num_heads, num_kv_heads (a divisor of num_heads), head_dim (even) and rank_k "
            "must be positive");
    }
    *kernel = new SharedKernel(kn);
    return nullptr;
}

char const* ORT_API_CALL sharedOpName(OrtCustomOp const*)
{
    return kSharedOpName;
}

ONNXTensorElementDataType ORT_API_CALL sharedInputType(OrtCustomOp const*, size_t i)
{
    switch (i)
    {
    case kSPool:
    case kSSlots:
    case kSRowTags:
    case kSSelected:
    case kSCacheRows:
    case kSPastLengths:
    case kSNewLengths: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
}

size_t ORT_API_CALL sharedInputCount(OrtCustomOp const*)
{
    return kSNumInputs;
}

ONNXTensorElementDataType ORT_API_CALL sharedOutputType(OrtCustomOp const*, size_t i)
{
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

size_t ORT_API_CALL sharedOutputCount(OrtCustomOp const*)
{
    return 2;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL sharedOutputKind(OrtCustomOp const*, size_t i)
{
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

// What makes each further op of the domain; the other fields are GsmCachedAttention's (makeOp)
struct OpFns
{
    decltype(OrtCustomOp::GetName) name;
    decltype(OrtCustomOp::GetInputType) inputType;
    decltype(OrtCustomOp::GetInputTypeCount) inputCount;
    decltype(OrtCustomOp::GetOutputType) outputType;
    decltype(OrtCustomOp::GetOutputTypeCount) outputCount;
    decltype(OrtCustomOp::GetInputCharacteristic) inputKind;
    decltype(OrtCustomOp::CreateKernelV2) create;
    decltype(OrtCustomOp::KernelComputeV2) compute;
    decltype(OrtCustomOp::KernelDestroy) destroy;
};

OrtCustomOp makeOp(OpFns const& f)
{
    OrtCustomOp op = makeOp();
    op.GetName = f.name;
    op.GetInputType = f.inputType;
    op.GetInputTypeCount = f.inputCount;
    op.GetOutputType = f.outputType;
    op.GetOutputTypeCount = f.outputCount;
    op.GetInputCharacteristic = f.inputKind;
    op.CreateKernelV2 = f.create;
    op.KernelComputeV2 = f.compute;
    op.KernelDestroy = f.destroy;
    return op;
}

// `op` whose outputs are required or optional as `kind` says
OrtCustomOp withOutputKinds(OrtCustomOp op, decltype(OrtCustomOp::GetOutputCharacteristic) kind)
{
    op.GetOutputCharacteristic = kind;
    return op;
}

OrtCustomOp gOp = withOutputKinds(makeOp(), attentionOutputKind);
// An op with the epilogue's outputs: y, and normed where a norm weight is given
OrtCustomOp makeEpilogueOp(OpFns const& f)
{
    return withOutputKinds(makeOp(f), offsetOutputKind);
}

OrtCustomOp gOffsetOp = makeEpilogueOp({offsetOpName, offsetInputType, offsetInputCount, offsetFloat,
    offsetOutputCount, offsetInputKind, offsetCreateKernel, offsetCompute, offsetDestroyKernel});
OrtCustomOp gQmmOp = makeEpilogueOp({qmmOpName, qmmInputType, qmmInputCount, offsetFloat, offsetOutputCount,
    qmmInputKind, qmmCreateKernel, qmmCompute, qmmDestroyKernel});
OrtCustomOp gPoolOp = withOutputKinds(makeOp({poolOpName, poolInputType, poolInputCount, poolOutputType,
    poolOutputCount, poolInputKind, poolCreateKernel, poolCompute, destroyAs<PoolKernel>}), poolOutputKind);
OrtCustomOp gSharedOp = withOutputKinds(makeOp({sharedOpName, sharedInputType, sharedInputCount, sharedOutputType,
    sharedOutputCount, required, sharedCreateKernel, sharedCompute, destroyAs<SharedKernel>}), sharedOutputKind);
OrtCustomOp gGatherOp = makeOp({gatherOpName, gatherInputType, gatherInputCount, offsetFloat, gatherOutputCount,
    gatherInputKind, gatherCreateKernel, gatherCompute, qmmDestroyKernel});
OrtCustomOp gSideOp = makeOp({sideOpName, sideInputType, sideInputCount, sideOutputType, sideOutputCount, required,
    sideCreateKernel, sideCompute, sideDestroyKernel});

} // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(
    OrtSessionOptions* options, OrtApiBase const* apiBase)
{
    OrtApi const* api = apiBase != nullptr ? apiBase->GetApi(kApiVersion) : nullptr;
    if (api == nullptr)
    {
        // too old an ONNX Runtime: version 1 of the API always exists and can make the status
        OrtApi const* v1 = apiBase != nullptr ? apiBase->GetApi(1) : nullptr;
        return v1 != nullptr ? v1->CreateStatus(ORT_FAIL,
                   "libgsm_ort_ops.so needs ONNX Runtime >= 1.17 (C API version 17: KernelContext_ParallelFor); "
                   "this ONNX Runtime does not provide it")
                             : nullptr;
    }
    gApi = api;
    // one domain for the process (ONNX Runtime keeps a pointer; sessions may outlive any one registration)
    static OrtCustomOpDomain* domain = nullptr;
    if (domain == nullptr)
    {
        GSM_ORT_TRY(api->CreateCustomOpDomain(kDomain, &domain));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gOp));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gOffsetOp));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gQmmOp));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gSideOp));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gPoolOp));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gSharedOp));
        GSM_ORT_TRY(api->CustomOpDomain_Add(domain, &gGatherOp));
    }
    return api->AddCustomOpDomain(options, domain);
}
