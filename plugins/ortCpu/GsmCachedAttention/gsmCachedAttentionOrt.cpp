// GsmCachedAttention's ONNX Runtime binding: attributes, the inputs' types and shapes checked against each other
// (errors name the input), outputs made, then the math of gsmCachedAttention.h on the intra-op pool.
#include "../common/gsmOrtGlue.h"
#include "gsmCachedAttention.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kQ, kIndexQ, kIndexW, kNewLatentK, kNewLatentV, kNewIndexKeys, kLatentV, kIndexKeys, kKRows, kKUp, kVUp,
    kRopeCos, kRopeSin, kCacheRows, kPastLengths, kNewLengths, kSparseWindow, kSparseTopK, kNumInputs
};
enum Output : size_t
{
    kAttnOut, kNewKRows, kSelected, kAttnMass, kNewVRows, kNumOutputs
};

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto kI8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto kOpen = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // more than one type, checked per call
constexpr auto kRequired = INPUT_OUTPUT_REQUIRED;

OrtOpPort const kInputs[] = {{"q", kF32, kRequired}, {"index_q", kF32, kRequired}, {"index_w", kF32, kRequired},
    {"new_latent_k", kF32, kRequired}, {"new_latent_v", kF32, kRequired},
    {"new_index_keys", kOpen, kRequired}, // float16 keys or int8 codes
    {"latent_v", kF32, kRequired}, {"index_keys", kOpen, kRequired}, {"k_rows", kF32, kRequired},
    {"k_up", kOpen, kRequired}, {"v_up", kOpen, kRequired}, // float or float16
    {"rope_cos", kF32, kRequired}, {"rope_sin", kF32, kRequired}, {"cache_rows", kI32, kRequired},
    {"past_lengths", kI32, kRequired}, {"new_lengths", kI32, kRequired}, {"sparse_window", kI32, kRequired},
    {"sparse_top_k", kI32, kRequired}};
// new_v_rows only with attribute v_rows = 1
OrtOpPort const kOutputs[] = {{"attn_out", kF32, kRequired}, {"new_k_rows", kF32, kRequired},
    {"selected", kI32, kRequired}, {"attn_mass", kF32, kRequired}, {"new_v_rows", kF32, INPUT_OUTPUT_OPTIONAL}};
static_assert(portCount(kInputs) == kNumInputs && portCount(kOutputs) == kNumOutputs, "ports");

// with attribute v_rows = 1 input kLatentV holds the cached V rows [R, N_max, kvD] and the node has the fifth output
char const* const kVRowsName = "latent_v (the V rows, v_rows = 1)";

struct Kernel : OwningAttentionAttributes
{
    int64_t vRows;
};

// What one call is: its dimensions and the forms its inputs take
struct Call
{
    CachedAttentionDims d;
    bool flatQ = false;  // q (and attn_out) [B*S, nH*D], as the projection leaves it, not [B, S, nH*D]
    bool vRows = false;  // input latent_v holds the V rows (attribute v_rows = 1)
    size_t outputs = 0;
    ONNXTensorElementDataType keyType = kOpen, upType = kOpen;
};

OrtStatus* checkTypes(NodeInputs const& x, Call* c)
{
    // the indexer keys: FP16, or INT8 codes (decisions "INT8 indexer keys"), the same in both key inputs
    GSM_ORT_TRY(sharedType(kCachedAttentionOp, x.value[kIndexKeys], x.value[kNewIndexKeys], kF16, kI8,
        "inputs index_keys and new_index_keys must both be float16 or both int8 (INT8 key codes)", &c->keyType));
    // U_k and U_v: float32, or float16 when the checkpoint's U lie on the FP16 grid (the builder stores them so)
    return sharedType(kCachedAttentionOp, x.value[kKUp], x.value[kVUp], kF32, kF16,
        "inputs k_up and v_up must both be float or both float16", &c->upType);
}

// B and S from index_q, R, N and the ranks from the cache and U, and the node's outputs against attribute v_rows
OrtStatus* readDims(Kernel const& kn, NodeInputs const& x, OrtKernelContext* ctx, Call* c)
{
    std::vector<int64_t> const* sh = x.shape;
    CachedAttentionDims& d = c->d;
    d.nH = kn.numHeads;
    d.nKV = kn.numKvHeads;
    d.D = kn.headDim;
    d.nI = kn.indexHeads;
    d.dI = kn.indexDim;
    d.sinks = kn.sinkTokens;
    d.topKDivisor = kn.topKDivisor;
    if (sh[kIndexQ].size() != 3)
    {
        return invalidArgument(kCachedAttentionOp,
            "input index_q has shape " + dimsText(sh[kIndexQ]) + ", expected [B, S, index_heads*index_dim]");
    }
    d.B = sh[kIndexQ][0];
    d.S = sh[kIndexQ][1];
    c->flatQ = sh[kQ].size() == 2;
    c->vRows = kn.vRows != 0;
    if (sh[kLatentV].size() != 3 || sh[kKUp].size() != 2 || sh[kVUp].size() != 2)
    {
        return invalidArgument(kCachedAttentionOp, std::string("input ") + (c->vRows ? kVRowsName : "latent_v")
            + " has shape " + dimsText(sh[kLatentV]) + ", k_up " + dimsText(sh[kKUp]) + " and v_up "
            + dimsText(sh[kVUp]) + ", expected [R, N_max, " + (c->vRows ? "kvD" : "rv") + "], [kvD, rk] and [kvD, rv]");
    }
    d.R = sh[kLatentV][0];
    d.N = sh[kLatentV][1];
    d.rv = c->vRows ? sh[kVUp][1] : sh[kLatentV][2];
    d.rk = sh[kKUp][1];
    GSM_ORT_TRY(outputCount(ctx, &c->outputs));
    size_t const want = c->vRows ? kNumOutputs : kNumOutputs - 1;
    if (c->outputs != want)
    {
        return invalidArgument(kCachedAttentionOp, "the node has " + std::to_string(c->outputs)
            + " outputs; attribute v_rows = " + std::to_string(kn.vRows) + " needs " + std::to_string(want)
            + (c->vRows ? " (the fifth: new_v_rows)" : ""));
    }
    return nullptr;
}

OrtStatus* checkShapes(NodeInputs const& x, Call const& c)
{
    CachedAttentionDims const& d = c.d;
    std::vector<int64_t> const* sh = x.shape;
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D;
    OrtOpDescriptor const& op = kCachedAttentionOp;
    if (c.vRows)
    {
        GSM_ORT_TRY(expectShapeAny(op, kLatentV, sh[kLatentV], {-1, -1, kvD}, "[R, N_max, num_kv_heads*head_dim]",
            kVRowsName));
    }
    if (c.flatQ)
    {
        GSM_ORT_TRY(expectShapeAny(op, kQ, sh[kQ], {B * S, d.nH * d.D}, "[B*S, num_heads*head_dim], or [B, S, ...]"));
    }
    else
    {
        GSM_ORT_TRY(expectShapeAny(op, kQ, sh[kQ], {B, S, d.nH * d.D}, "[B, S, num_heads*head_dim], or [B*S, ...]"));
    }
    GSM_ORT_TRY(expectShapeAny(op, kIndexQ, sh[kIndexQ], {B, S, d.nI * d.dI}, "[B, S, index_heads*index_dim]"));
    GSM_ORT_TRY(expectShapeAny(op, kIndexW, sh[kIndexW], {B, S, d.nI}, "[B, S, index_heads]"));
    GSM_ORT_TRY(expectShapeAny(op, kNewLatentK, sh[kNewLatentK], {B, S, d.rk}, "[B, S, rk], rk from k_up"));
    GSM_ORT_TRY(expectShapeAny(op, kNewLatentV, sh[kNewLatentV], {B, S, d.rv},
        c.vRows ? "[B, S, rv], rv from v_up" : "[B, S, rv], rv from latent_v"));
    GSM_ORT_TRY(expectShapeAny(op, kNewIndexKeys, sh[kNewIndexKeys], {B, S, d.dI}, "[B, S, index_dim]"));
    GSM_ORT_TRY(
        expectShapeAny(op, kIndexKeys, sh[kIndexKeys], {d.R, d.N, d.dI}, "[R, N_max, index_dim] as latent_v"));
    GSM_ORT_TRY(expectShapeAny(op, kKRows, sh[kKRows], {d.R, d.N, kvD}, "[R, N_max, num_kv_heads*head_dim]"));
    GSM_ORT_TRY(expectShapeAny(op, kKUp, sh[kKUp], {kvD, d.rk}, "[num_kv_heads*head_dim, rk]"));
    GSM_ORT_TRY(
        expectShapeAny(op, kVUp, sh[kVUp], {kvD, d.rv}, "[num_kv_heads*head_dim, rv], rv from latent_v"));
    GSM_ORT_TRY(expectShapeAny(op, kRopeCos, sh[kRopeCos], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(expectShapeAny(op, kRopeSin, sh[kRopeSin], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(expectShapeAny(op, kCacheRows, sh[kCacheRows], {B}, "[B]"));
    GSM_ORT_TRY(expectShapeAny(op, kPastLengths, sh[kPastLengths], {B}, "[B]"));
    GSM_ORT_TRY(expectShapeAny(op, kNewLengths, sh[kNewLengths], {B}, "[B]"));
    GSM_ORT_TRY(expectShapeAny(op, kSparseWindow, sh[kSparseWindow], {1}, "[1]"));
    return expectShapeAny(op, kSparseTopK, sh[kSparseTopK], {B}, "[B]");
}

CachedAttentionInputs bindInputs(NodeInputs const& x, Call const& c)
{
    CachedAttentionInputs in;
    in.q = x.as<float>(kQ);
    in.indexQ = x.as<float>(kIndexQ);
    in.indexW = x.as<float>(kIndexW);
    in.newLatentK = x.as<float>(kNewLatentK);
    in.newLatentV = x.as<float>(kNewLatentV);
    in.newIndexKeys = x.data[kNewIndexKeys];
    (c.vRows ? in.vRows : in.latentV) = x.as<float>(kLatentV);
    in.indexKeys = x.data[kIndexKeys];
    in.int8Keys = c.keyType == kI8;
    in.kRows = x.as<float>(kKRows);
    in.kUp = x.data[kKUp];
    in.vUp = x.data[kVUp];
    in.halfUp = c.upType == kF16;
    in.ropeCos = x.as<float>(kRopeCos);
    in.ropeSin = x.as<float>(kRopeSin);
    in.cacheRows = x.as<int32_t>(kCacheRows);
    in.pastLengths = x.as<int32_t>(kPastLengths);
    in.newLengths = x.as<int32_t>(kNewLengths);
    in.window = *x.as<int32_t>(kSparseWindow);
    in.topK = x.as<int32_t>(kSparseTopK);
    return in;
}

// The node's outputs for widths k (selected) and L (attn_mass)
OrtStatus* makeOutputs(OrtKernelContext* ctx, Call const& c, int64_t k, int64_t L, CachedAttentionOutputs* out)
{
    CachedAttentionDims const& d = c.d;
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D;
    int64_t const outDims[kNumOutputs][3] = {{B, S, d.nH * d.D}, {B, S, kvD}, {B, S, k}, {B, L, 0}, {B, S, kvD}};
    int64_t const flatOut[2] = {B * S, d.nH * d.D};
    size_t const outRank[kNumOutputs] = {c.flatQ ? size_t{2} : size_t{3}, 3, 3, 2, 3};
    void* o[kNumOutputs] = {};
    for (size_t i = 0; i < c.outputs; ++i)
    {
        GSM_ORT_TRY(makeOutput(ctx, i, i == kAttnOut && c.flatQ ? flatOut : outDims[i], outRank[i], &o[i]));
    }
    out->attnOut = static_cast<float*>(o[kAttnOut]);
    out->newKRows = static_cast<float*>(o[kNewKRows]);
    out->selected = static_cast<int32_t*>(o[kSelected]);
    out->attnMass = static_cast<float*>(o[kAttnMass]);
    out->newVRows = static_cast<float*>(o[kNewVRows]);
    return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    NodeInputs x;
    Call c;
    GSM_ORT_TRY(readInputs(ctx, kCachedAttentionOp, &x));
    GSM_ORT_TRY(checkTypes(x, &c));
    GSM_ORT_TRY(readDims(kn, x, ctx, &c));
    GSM_ORT_TRY(checkShapes(x, c));
    CachedAttentionInputs const in = bindInputs(x, c);
    std::string err;
    int64_t k = 0, L = 0;
    if (!prepareCachedAttention(c.d, in, &k, &L, &err))
    {
        return statusOf(ORT_INVALID_ARGUMENT, err);
    }
    CachedAttentionOutputs out;
    GSM_ORT_TRY(makeOutputs(ctx, c, k, L, &out));
    if (!runCachedAttention(c.d, in, k, L, out, intraOpPool(ctx), &err))
    {
        return statusOf(ORT_FAIL, err);
    }
    return nullptr;
}

OrtStatus* checkAttributes(Kernel const& kn)
{
    OrtOpDescriptor const& op = kCachedAttentionOp;
    if (kn.vRows != 0 && kn.vRows != 1)
    {
        return invalidArgument(op, "attribute v_rows = " + std::to_string(kn.vRows) + " must be 0 or 1 (1: input "
            "latent_v holds the cached V rows [R, N_max, kvD] and the node has a fifth output, new_v_rows)");
    }
    if (kn.numHeads <= 0 || kn.numKvHeads <= 0 || kn.numHeads % kn.numKvHeads != 0)
    {
        return invalidArgument(op, "attributes num_heads = " + std::to_string(kn.numHeads) + ", num_kv_heads = "
            + std::to_string(kn.numKvHeads) + ": both must be positive, num_heads a multiple of num_kv_heads");
    }
    if (kn.headDim <= 0 || kn.headDim % 2 != 0)
    {
        return invalidArgument(op, "attribute head_dim = " + std::to_string(kn.headDim) + " must be positive and even");
    }
    if (kn.indexHeads <= 0 || kn.indexDim <= 0 || kn.sinkTokens < 0)
    {
        return invalidArgument(op, "attributes index_heads, index_dim must be positive and sink_tokens >= 0 (got "
            + std::to_string(kn.indexHeads) + ", " + std::to_string(kn.indexDim) + ", "
            + std::to_string(kn.sinkTokens) + ")");
    }
    if (kn.topKDivisor < 0)
    {
        return invalidArgument(op, "attribute sparse_top_k_divisor = " + std::to_string(kn.topKDivisor)
            + " must be >= 0 (0: a fixed top-k)");
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    OrtOpDescriptor const& op = kCachedAttentionOp;
    Kernel kn{};
    GSM_ORT_TRY(owningAttentionAttributes(op, info, &kn));
    GSM_ORT_TRY(optionalIntAttribute(op, info, "v_rows", 0, &kn.vRows));
    GSM_ORT_TRY(checkAttributes(kn));
    *kernel = new Kernel(kn);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kCachedAttentionOp{"GsmCachedAttention", kInputs, kNumInputs, kOutputs, kNumOutputs, create,
    compute, destroyKernel<Kernel>};

} // namespace ortcpu
} // namespace gsm
