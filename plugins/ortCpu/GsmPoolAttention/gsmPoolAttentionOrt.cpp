// GsmPoolAttention's ONNX Runtime binding: the attention core (../GsmCachedAttention/gsmCachedAttention.h) over the
// plugins' pools (gsmPoolRows.h): the cache the reference and TensorRT backends hold, read and written in place
// (kv_pool, index_keys, the row cache and its tags are the runtime's buffers, bound without a copy; ONNX Runtime
// 1.17's custom ops cannot declare an output aliasing an input, so the op writes its inputs, as the TensorRT plugins
// write their aliased pools).
#include "../GsmCachedAttention/gsmCachedAttention.h"
#include "gsmPoolOrt.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kQ, kIndexQ, kIndexW, kNewLatentK, kNewLatentV, kNewIndexKeys, kPool, kIndexKeys, kSlots, kQuant, kRowCache,
    kRowTags, kKUp, kVUp, kRopeCos, kRopeSin, kCacheRows, kPastLengths, kNewLengths, kSparseWindow, kSparseTopK,
    kLogitRows, kSelections, kNumInputs
};
// attn_out, selected, attn_mass, then optional: row_cache_misses, query_mass (needs input logit_rows)
enum Output : size_t
{
    kAttnOut, kSelected, kAttnMass, kMisses, kQueryMass, kNumOutputs
};

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto kOpen = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; // more than one type, checked per call
constexpr auto kRequired = INPUT_OUTPUT_REQUIRED;
constexpr auto kOptional = INPUT_OUTPUT_OPTIONAL;

OrtOpPort const kInputs[] = {{"q", kF32, kRequired}, {"index_q", kF32, kRequired}, {"index_w", kF32, kRequired},
    {"new_latent_k", kF32, kRequired}, {"new_latent_v", kF32, kRequired}, {"new_index_keys", kOpen, kRequired},
    {"kv_pool", kI32, kRequired}, {"index_keys", kOpen, kRequired}, {"kv_slots", kI32, kRequired},
    {"quant", kF32, kRequired}, {"row_cache", kF32, kRequired}, {"row_cache_tags", kI32, kRequired},
    {"k_up", kOpen, kRequired}, {"v_up", kOpen, kRequired}, {"rope_cos", kF32, kRequired},
    {"rope_sin", kF32, kRequired}, {"cache_rows", kI32, kRequired}, {"past_lengths", kI32, kRequired},
    {"new_lengths", kI32, kRequired}, {"sparse_window", kI32, kRequired}, {"sparse_top_k", kI32, kRequired},
    {"logit_rows", kI32, kOptional}, {"selections", kI32, kOptional}};
OrtOpPort const kOutputs[] = {{"attn_out", kF32, kRequired}, {"selected", kI32, kRequired},
    {"attn_mass", kF32, kRequired}, {"row_cache_misses", kI32, kOptional}, {"query_mass", kF32, kOptional}};
static_assert(portCount(kInputs) == kNumInputs && portCount(kOutputs) == kNumOutputs, "ports");

struct Kernel : OwningAttentionAttributes
{
    int64_t rows[4]; // rows_fp16, rows_int12, rows_int8, rows_int4
};

// What one call is: its dimensions, the pool's layout and the forms its inputs take
struct Call
{
    CachedAttentionDims d;
    GsmDims g{};
    bool int8Keys = false; // INT8 key codes (index_keys: int32 words of them), else float16 keys
    bool halfUp = false;
    bool flatQ = false;    // q (and attn_out) [B*S, nH*D], as the projection leaves it
    int64_t keyWidth = 0;  // index_keys' last axis
    int64_t C = 0;         // row cache capacity
    int64_t J = 0;         // logit_rows per sequence (0: none; -1: not [B, J])
};

OrtStatus* checkTypes(NodeInputs const& x, Call* c)
{
    ONNXTensorElementDataType newKeyType = kOpen, keyType = kOpen, kUpType = kOpen, vUpType = kOpen;
    GSM_ORT_TRY(elementType(x.value[kNewIndexKeys], &newKeyType));
    GSM_ORT_TRY(elementType(x.value[kIndexKeys], &keyType));
    GSM_ORT_TRY(elementType(x.value[kKUp], &kUpType));
    GSM_ORT_TRY(elementType(x.value[kVUp], &vUpType));
    c->int8Keys = newKeyType == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    if (!(c->int8Keys && keyType == kI32) && !(newKeyType == kF16 && keyType == newKeyType))
    {
        return invalidArgument(kPoolAttentionOp,
            "new_index_keys and index_keys must be int8 codes and int32 words of them, or both float16");
    }
    if (kUpType != vUpType || (kUpType != kF32 && kUpType != kF16))
    {
        return invalidArgument(kPoolAttentionOp, "inputs k_up and v_up must both be float or both float16");
    }
    c->halfUp = kUpType == kF16;
    return nullptr;
}

// The call's dimensions from the attributes and the shapes of index_q, U, the slot table, the pool and the row cache
OrtStatus* readDims(Kernel const& kn, NodeInputs const& x, Call* c)
{
    std::vector<int64_t> const* sh = x.shape;
    if (sh[kIndexQ].size() != 3 || sh[kKUp].size() != 2 || sh[kVUp].size() != 2 || sh[kSlots].size() != 2
        || sh[kPool].size() != 2 || sh[kRowCache].size() != 3)
    {
        return invalidArgument(kPoolAttentionOp, "inputs index_q " + dimsText(sh[kIndexQ]) + ", k_up "
            + dimsText(sh[kKUp]) + ", v_up " + dimsText(sh[kVUp]) + ", kv_slots " + dimsText(sh[kSlots]) + ", kv_pool "
            + dimsText(sh[kPool]) + ", row_cache " + dimsText(sh[kRowCache]) + ": expected [B, S, nI*dI], [kvD, rk], "
            "[kvD, rv], [B, N_max], [R, P32], [R, C, kvD]");
    }
    CachedAttentionDims& d = c->d;
    d.nH = kn.numHeads;
    d.nKV = kn.numKvHeads;
    d.D = kn.headDim;
    d.nI = kn.indexHeads;
    d.dI = kn.indexDim;
    d.sinks = kn.sinkTokens;
    d.topKDivisor = kn.topKDivisor;
    d.B = sh[kIndexQ][0];
    d.S = sh[kIndexQ][1];
    d.N = sh[kSlots][1];
    d.R = sh[kPool][0];
    d.rk = sh[kKUp][1];
    d.rv = sh[kVUp][1];
    c->C = sh[kRowCache][1];
    c->g = poolLayout(d.rk, d.rv, d.N, kn.rows);
    c->g.indexDim = static_cast<int32_t>(d.dI);
    c->g.indexKeyBits = c->int8Keys ? 8 : 16;
    c->keyWidth = c->int8Keys ? (d.dI + 3) / 4 : d.dI;
    c->flatQ = sh[kQ].size() == 2;
    c->J = !x.has(kLogitRows) ? 0 : (sh[kLogitRows].size() == 2 ? sh[kLogitRows][1] : -1);
    return nullptr;
}

OrtStatus* checkShapes(NodeInputs const& x, Call const& c)
{
    OrtOpDescriptor const& op = kPoolAttentionOp;
    CachedAttentionDims const& d = c.d;
    std::vector<int64_t> const* sh = x.shape;
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D;
    GSM_ORT_TRY(expectShape(op, kQ, sh[kQ],
        c.flatQ ? std::vector<int64_t>{B * S, d.nH * d.D} : std::vector<int64_t>{B, S, d.nH * d.D},
        "[B, S, num_heads*head_dim] or [B*S, ...]"));
    GSM_ORT_TRY(expectShape(op, kIndexQ, sh[kIndexQ], {B, S, d.nI * d.dI}, "[B, S, index_heads*index_dim]"));
    GSM_ORT_TRY(expectShape(op, kIndexW, sh[kIndexW], {B, S, d.nI}, "[B, S, index_heads]"));
    GSM_ORT_TRY(expectShape(op, kNewLatentK, sh[kNewLatentK], {B, S, d.rk}, "[B, S, rk], rk from k_up"));
    GSM_ORT_TRY(expectShape(op, kNewLatentV, sh[kNewLatentV], {B, S, d.rv}, "[B, S, rv], rv from v_up"));
    GSM_ORT_TRY(expectShape(op, kNewIndexKeys, sh[kNewIndexKeys], {B, S, d.dI}, "[B, S, index_dim]"));
    GSM_ORT_TRY(expectShape(op, kPool, sh[kPool], {d.R, poolWords(c.g)}, "[R, P32] of the rows_* attributes"));
    GSM_ORT_TRY(expectShape(op, kIndexKeys, sh[kIndexKeys], {d.R, d.N, c.keyWidth},
        "[R, N_max, index_dim] float16, or [R, N_max, ceil(index_dim / 4)] int32 words of INT8 codes"));
    GSM_ORT_TRY(expectShape(op, kSlots, sh[kSlots], {B, d.N}, "[B, N_max]"));
    GSM_ORT_TRY(expectShape(op, kQuant, sh[kQuant], {5, d.rk + d.rv}, "[5, rk + rv]: s12, s8, comp8, s4, comp4"));
    GSM_ORT_TRY(expectShape(op, kRowCache, sh[kRowCache], {d.R, c.C, kvD}, "[R, C, num_kv_heads*head_dim]"));
    GSM_ORT_TRY(expectShape(op, kRowTags, sh[kRowTags], {d.R, kTagRows, c.C}, "[R, 3, C]"));
    GSM_ORT_TRY(expectShape(op, kKUp, sh[kKUp], {kvD, d.rk}, "[num_kv_heads*head_dim, rk]"));
    GSM_ORT_TRY(expectShape(op, kVUp, sh[kVUp], {kvD, d.rv}, "[num_kv_heads*head_dim, rv]"));
    GSM_ORT_TRY(expectShape(op, kRopeCos, sh[kRopeCos], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(expectShape(op, kRopeSin, sh[kRopeSin], {d.N, d.D}, "[N_max, head_dim]"));
    for (size_t i : {kCacheRows, kPastLengths, kNewLengths, kSparseTopK})
    {
        GSM_ORT_TRY(expectShape(op, i, sh[i], {B}, "[B]"));
    }
    GSM_ORT_TRY(expectShape(op, kSparseWindow, sh[kSparseWindow], {1}, "[1]"));
    if (x.has(kLogitRows))
    {
        GSM_ORT_TRY(expectShape(op, kLogitRows, sh[kLogitRows], {B, c.J}, "[B, J]"));
    }
    if (x.has(kSelections))
    {
        GSM_ORT_TRY(expectShape(op, kSelections, sh[kSelections], {1}, "[1]"));
    }
    return nullptr;
}

// What the shapes cannot say: a row for every position, logit_rows within the call's rows, selections 0 or 1
OrtStatus* checkValues(NodeInputs const& x, Call const& c)
{
    OrtOpDescriptor const& op = kPoolAttentionOp;
    if (x.has(kSelections) && (*x.as<int32_t>(kSelections) & ~1) != 0)
    {
        return invalidArgument(op, "selections = " + std::to_string(*x.as<int32_t>(kSelections))
            + " is neither 1 (return the selection) nor 0");
    }
    if (c.g.rowsFP16 + static_cast<int64_t>(c.g.rowsINT12) + c.g.rowsINT8 + c.g.rowsINT4 < c.d.N)
    {
        return invalidArgument(op, "attributes rows_fp16 + rows_int12 + rows_int8 + rows_int4 are below N_max = "
            + std::to_string(c.d.N) + " (one row per position)");
    }
    int32_t const* logitRows = x.as<int32_t>(kLogitRows);
    for (int64_t i = 0; i < c.d.B * c.J; ++i)
    {
        if (logitRows[i] < 0 || logitRows[i] >= c.d.S)
        {
            return invalidArgument(op, "logit_rows[" + std::to_string(i / c.J) + ", " + std::to_string(i % c.J)
                + "] = " + std::to_string(logitRows[i]) + " is outside [0, S = " + std::to_string(c.d.S) + ")");
        }
    }
    return nullptr;
}

CachedAttentionInputs bindInputs(NodeInputs const& x, Call const& c, PoolSource const* ps)
{
    CachedAttentionInputs in;
    in.q = x.as<float>(kQ);
    in.indexQ = x.as<float>(kIndexQ);
    in.indexW = x.as<float>(kIndexW);
    in.newLatentK = x.as<float>(kNewLatentK);
    in.newLatentV = x.as<float>(kNewLatentV);
    in.newIndexKeys = x.data[kNewIndexKeys];
    in.indexKeys = x.data[kIndexKeys];
    in.int8Keys = c.int8Keys;
    in.keyStride = c.int8Keys ? 4 * c.keyWidth : c.d.dI;
    in.kUp = x.data[kKUp];
    in.vUp = x.data[kVUp];
    in.halfUp = c.halfUp;
    in.ropeCos = x.as<float>(kRopeCos);
    in.ropeSin = x.as<float>(kRopeSin);
    in.cacheRows = x.as<int32_t>(kCacheRows);
    in.pastLengths = x.as<int32_t>(kPastLengths);
    in.newLengths = x.as<int32_t>(kNewLengths);
    in.window = *x.as<int32_t>(kSparseWindow);
    in.topK = x.as<int32_t>(kSparseTopK);
    in.pool = ps;
    in.massRows = x.as<int32_t>(kLogitRows);
    in.J = c.J;
    return in;
}

// The node's outputs for widths k (selected) and L (attn_mass); the call's new K rows go to scratch (the row cache
// keeps them) and the row cache's misses to ps. With selections = 0 the selection is made in scratch too and
// `selected` is [B, S, 0]: ONNX Runtime keeps every node output to the end of a run, read or not, and a prefill
// chunk's selections of every layer were megabytes there
OrtStatus* makeOutputs(OrtKernelContext* ctx, NodeInputs const& x, Call const& c, int64_t k, int64_t L,
    CachedAttentionOutputs* out, PoolSource* ps)
{
    bool const keep = !x.has(kSelections) || *x.as<int32_t>(kSelections) != 0;
    size_t outputs = 0;
    GSM_ORT_TRY(outputCount(ctx, &outputs));
    if (outputs > kQueryMass && !x.has(kLogitRows))
    {
        return invalidArgument(kPoolAttentionOp,
            "output query_mass needs input logit_rows (the rows whose queries it measures)");
    }
    CachedAttentionDims const& d = c.d;
    int64_t const B = d.B, S = d.S;
    int64_t const outDims[kNumOutputs][3] = {{B, S, d.nH * d.D}, {B, S, keep ? k : 0}, {B, L, 0}, {B, 0, 0},
        {B, c.J, L}};
    int64_t const flatOut[2] = {B * S, d.nH * d.D};
    size_t const outRank[kNumOutputs] = {c.flatQ ? size_t{2} : size_t{3}, 3, 2, 1, 3};
    void* o[kNumOutputs] = {};
    for (size_t i = 0; i < outputs && i < kNumOutputs; ++i)
    {
        GSM_ORT_TRY(makeOutput(ctx, i, i == kAttnOut && c.flatQ ? flatOut : outDims[i], outRank[i], &o[i]));
    }
    ps->misses = static_cast<int32_t*>(o[kMisses]);
    static thread_local std::vector<float> newKRows;
    newKRows.resize(static_cast<size_t>(B * S * d.nKV * d.D));
    out->attnOut = static_cast<float*>(o[kAttnOut]);
    out->newKRows = newKRows.data();
    static thread_local std::vector<int32_t> selected;
    if (!keep)
    {
        selected.resize(static_cast<size_t>(B * S * k));
    }
    out->selected = keep ? static_cast<int32_t*>(o[kSelected]) : selected.data();
    out->attnMass = static_cast<float*>(o[kAttnMass]);
    out->queryMass = static_cast<float*>(o[kQueryMass]);
    return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    NodeInputs x;
    Call c;
    GSM_ORT_TRY(readInputs(ctx, kPoolAttentionOp, &x));
    GSM_ORT_TRY(checkTypes(x, &c));
    GSM_ORT_TRY(readDims(kn, x, &c));
    GSM_ORT_TRY(checkShapes(x, c));
    GSM_ORT_TRY(checkValues(x, c));
    PoolSource ps = poolSource(c.g, x.data[kPool], x.data[kSlots], x.data[kQuant], x.data[kRowCache],
        x.data[kRowTags], c.C);
    ps.indexKeys = x.data[kIndexKeys];
    CachedAttentionInputs const in = bindInputs(x, c, &ps);
    std::string err;
    int64_t k = 0, L = 0;
    if (!prepareCachedAttention(c.d, in, &k, &L, &err))
    {
        return statusOf(ORT_INVALID_ARGUMENT, err);
    }
    CachedAttentionOutputs out;
    GSM_ORT_TRY(makeOutputs(ctx, x, c, k, L, &out, &ps));
    if (!runCachedAttention(c.d, in, k, L, out, intraOpPool(ctx), &err))
    {
        return statusOf(ORT_FAIL, err);
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    OrtOpDescriptor const& op = kPoolAttentionOp;
    Kernel kn{};
    GSM_ORT_TRY(owningAttentionAttributes(op, info, &kn));
    GSM_ORT_TRY(poolRowsAttributes(op, info, kn.rows));
    if (kn.numHeads <= 0 || kn.numKvHeads <= 0 || kn.numHeads % kn.numKvHeads != 0 || kn.headDim <= 0
        || kn.headDim % 2 != 0 || kn.indexHeads <= 0 || kn.indexDim <= 0 || kn.sinkTokens < 0 || kn.topKDivisor < 0)
    {
        return invalidArgument(op, "attributes num_heads, num_kv_heads (a divisor of num_heads), head_dim (even), "
            "index_heads and index_dim must be positive, sink_tokens and sparse_top_k_divisor >= 0");
    }
    *kernel = new Kernel(kn);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kPoolAttentionOp{"GsmPoolAttention", kInputs, kNumInputs, kOutputs, kNumOutputs, create,
    compute, destroyKernel<Kernel>};

} // namespace ortcpu
} // namespace gsm
