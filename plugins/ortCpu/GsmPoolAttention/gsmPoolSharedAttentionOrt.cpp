// GsmPoolSharedAttention's ONNX Runtime binding: a KV-sharing layer over its source layer's pool, after the source's
// GsmPoolAttention wrote the call's rows there (runPoolSharedAttention, gsmPoolRows.h).
#include "gsmPoolOrt.h"
#include "gsmPoolSharedAttention.h"

namespace gsm
{
namespace ortcpu
{
namespace
{

enum Input : size_t
{
    kQ, kPool, kSlots, kQuant, kRowCache, kRowTags, kProjW, kProjB, kRopeCos, kRopeSin, kSelected, kCacheRows,
    kPastLengths, kNewLengths, kNumInputs
};

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto kRequired = INPUT_OUTPUT_REQUIRED;

OrtOpPort const kInputs[] = {{"q", kF32, kRequired}, {"kv_pool", kI32, kRequired}, {"kv_slots", kI32, kRequired},
    {"quant", kF32, kRequired}, {"row_cache", kF32, kRequired}, {"row_cache_tags", kI32, kRequired},
    {"kv_proj_weight", kF32, kRequired}, {"kv_proj_bias", kF32, kRequired}, {"rope_cos", kF32, kRequired},
    {"rope_sin", kF32, kRequired}, {"selected", kI32, kRequired}, {"cache_rows", kI32, kRequired},
    {"past_lengths", kI32, kRequired}, {"new_lengths", kI32, kRequired}};
OrtOpPort const kOutputs[] = {{"attn_out", kF32, kRequired}, {"row_cache_misses", kI32, INPUT_OUTPUT_OPTIONAL}};
static_assert(portCount(kInputs) == kNumInputs, "ports");

struct Kernel
{
    int64_t numHeads, numKvHeads, headDim, rankK;
    int64_t rows[4];
};

struct Call
{
    CachedAttentionDims d;
    GsmDims g{};
    bool flatQ = false;
    int64_t C = 0; // row cache capacity
};

OrtStatus* readDims(Kernel const& kn, NodeInputs const& x, Call* c)
{
    OrtOpDescriptor const& op = kPoolSharedAttentionOp;
    std::vector<int64_t> const* sh = x.shape;
    if (sh[kSelected].size() != 3 || sh[kProjW].size() != 2 || sh[kSlots].size() != 2 || sh[kPool].size() != 2
        || sh[kRowCache].size() != 3)
    {
        return invalidArgument(op, "inputs selected " + dimsText(sh[kSelected]) + ", kv_proj_weight "
            + dimsText(sh[kProjW]) + ", kv_slots " + dimsText(sh[kSlots]) + ", kv_pool " + dimsText(sh[kPool])
            + ", row_cache " + dimsText(sh[kRowCache]) + ": expected [B, S, k], [2*kvD, r], [B, N_max], [R, P32], "
            "[R, C, kvD]");
    }
    CachedAttentionDims& d = c->d;
    d.nH = kn.numHeads;
    d.nKV = kn.numKvHeads;
    d.D = kn.headDim;
    d.B = sh[kSelected][0];
    d.S = sh[kSelected][1];
    d.N = sh[kSlots][1];
    d.R = sh[kPool][0];
    d.rk = kn.rankK;
    d.rv = sh[kProjW][1] - kn.rankK;
    c->C = sh[kRowCache][1];
    if (d.rv <= 0)
    {
        return invalidArgument(op, "kv_proj_weight has " + std::to_string(sh[kProjW][1]) + " columns, not more than "
            "attribute rank_k = " + std::to_string(kn.rankK));
    }
    c->g = poolLayout(d.rk, d.rv, d.N, kn.rows);
    c->flatQ = sh[kQ].size() == 2;
    return nullptr;
}

OrtStatus* checkShapes(NodeInputs const& x, Call const& c)
{
    OrtOpDescriptor const& op = kPoolSharedAttentionOp;
    CachedAttentionDims const& d = c.d;
    std::vector<int64_t> const* sh = x.shape;
    int64_t const B = d.B, S = d.S, kvD = d.nKV * d.D;
    GSM_ORT_TRY(expectShape(op, kQ, sh[kQ],
        c.flatQ ? std::vector<int64_t>{B * S, d.nH * d.D} : std::vector<int64_t>{B, S, d.nH * d.D},
        "[B, S, num_heads*head_dim] or [B*S, ...]"));
    GSM_ORT_TRY(expectShape(op, kPool, sh[kPool], {d.R, poolWords(c.g)}, "[R, P32] of the rows_* attributes"));
    GSM_ORT_TRY(expectShape(op, kSlots, sh[kSlots], {B, d.N}, "[B, N_max]"));
    GSM_ORT_TRY(expectShape(op, kQuant, sh[kQuant], {5, d.rk + d.rv}, "[5, r] of the source layer"));
    GSM_ORT_TRY(expectShape(op, kRowCache, sh[kRowCache], {d.R, c.C, kvD}, "[R, C, num_kv_heads*head_dim]"));
    GSM_ORT_TRY(expectShape(op, kRowTags, sh[kRowTags], {d.R, kTagRows, c.C}, "[R, 3, C]"));
    GSM_ORT_TRY(expectShape(op, kProjW, sh[kProjW], {2 * kvD, d.rk + d.rv}, "[2*num_kv_heads*head_dim, r]"));
    GSM_ORT_TRY(expectShape(op, kProjB, sh[kProjB], {2 * kvD}, "[2*num_kv_heads*head_dim]"));
    GSM_ORT_TRY(expectShape(op, kRopeCos, sh[kRopeCos], {d.N, d.D}, "[N_max, head_dim]"));
    GSM_ORT_TRY(expectShape(op, kRopeSin, sh[kRopeSin], {d.N, d.D}, "[N_max, head_dim]"));
    for (size_t i : {kCacheRows, kPastLengths, kNewLengths})
    {
        GSM_ORT_TRY(expectShape(op, i, sh[i], {B}, "[B]"));
    }
    return nullptr;
}

SharedAttentionInputs bindInputs(NodeInputs const& x, PoolSource const* ps)
{
    SharedAttentionInputs in;
    in.q = x.as<float>(kQ);
    in.selected = x.as<int32_t>(kSelected);
    in.k = x.shape[kSelected][2];
    in.projW = x.as<float>(kProjW);
    in.projB = x.as<float>(kProjB);
    in.ropeCos = x.as<float>(kRopeCos);
    in.ropeSin = x.as<float>(kRopeSin);
    in.cacheRows = x.as<int32_t>(kCacheRows);
    in.pastLengths = x.as<int32_t>(kPastLengths);
    in.newLengths = x.as<int32_t>(kNewLengths);
    in.pool = ps;
    return in;
}

// attn_out, and the row cache's misses (into ps) where the node asks for them
OrtStatus* makeOutputs(OrtKernelContext* ctx, Call const& c, float** attnOut, PoolSource* ps)
{
    size_t outputs = 0;
    GSM_ORT_TRY(outputCount(ctx, &outputs));
    int64_t const B = c.d.B, S = c.d.S, width = c.d.nH * c.d.D;
    int64_t const outDims[3] = {B, S, width};
    int64_t const flatOut[2] = {B * S, width};
    void* out = nullptr;
    GSM_ORT_TRY(makeOutput(ctx, 0, c.flatQ ? flatOut : outDims, c.flatQ ? 2 : 3, &out));
    *attnOut = static_cast<float*>(out);
    if (outputs > 1)
    {
        int64_t const bDims[1] = {B};
        void* m = nullptr;
        GSM_ORT_TRY(makeOutput(ctx, 1, bDims, 1, &m));
        ps->misses = static_cast<int32_t*>(m);
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* opKernel, OrtKernelContext* ctx)
{
    Kernel const& kn = *static_cast<Kernel const*>(opKernel);
    NodeInputs x;
    Call c;
    GSM_ORT_TRY(readInputs(ctx, kPoolSharedAttentionOp, &x));
    GSM_ORT_TRY(readDims(kn, x, &c));
    GSM_ORT_TRY(checkShapes(x, c));
    PoolSource ps = poolSource(c.g, x.data[kPool], x.data[kSlots], x.data[kQuant], x.data[kRowCache],
        x.data[kRowTags], c.C);
    SharedAttentionInputs const in = bindInputs(x, &ps);
    float* attnOut = nullptr;
    GSM_ORT_TRY(makeOutputs(ctx, c, &attnOut, &ps));
    std::string err;
    if (!runPoolSharedAttention(c.d, in, attnOut, intraOpPool(ctx), &err))
    {
        return statusOf(ORT_INVALID_ARGUMENT, err);
    }
    return nullptr;
}

OrtStatus* ORT_API_CALL create(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const* info, void** kernel)
{
    OrtOpDescriptor const& op = kPoolSharedAttentionOp;
    Kernel kn{};
    GSM_ORT_TRY(intAttribute(op, info, "num_heads", &kn.numHeads));
    GSM_ORT_TRY(intAttribute(op, info, "num_kv_heads", &kn.numKvHeads));
    GSM_ORT_TRY(intAttribute(op, info, "head_dim", &kn.headDim));
    GSM_ORT_TRY(intAttribute(op, info, "rank_k", &kn.rankK));
    GSM_ORT_TRY(poolRowsAttributes(op, info, kn.rows));
    if (kn.numHeads <= 0 || kn.numKvHeads <= 0 || kn.numHeads % kn.numKvHeads != 0 || kn.headDim <= 0
        || kn.headDim % 2 != 0 || kn.rankK <= 0)
    {
        return invalidArgument(op, "attributes num_heads, num_kv_heads (a divisor of num_heads), head_dim (even) and "
            "rank_k must be positive");
    }
    *kernel = new Kernel(kn);
    return nullptr;
}

} // namespace

OrtOpDescriptor const kPoolSharedAttentionOp{"GsmPoolSharedAttention", kInputs, kNumInputs, kOutputs, 2, create,
    compute, destroyKernel<Kernel>};

} // namespace ortcpu
} // namespace gsm
