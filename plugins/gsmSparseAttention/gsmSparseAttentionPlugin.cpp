#include "gsmSparseAttentionPlugin.h"

#include "gsmSparseAttentionKernels.h"

#include <cuda_fp16.h>

namespace gsm
{
namespace trt
{

using namespace nvinfer1;

namespace
{
// I/O positions (docs/engine_io.md 4.2)
enum : int32_t
{
    kQ = 0,
    kPool,
    kSlots,
    kPast,
    kNew,
    kQuant,
    kCos,
    kSin,
    kW0,
    kW1,
    kIndexQOrSelected, // owning: index_q; sharing: selected of the source
    kIndexW,           // owning only from here
    kIndexKeys,
    kWindow,
    kTopK,       // owning: sparse_top_k [B]
    kRowsOwning, // cache_rows [B] (sharing: input 11)
    kLogitRows,  // owning: logit_rows [B, J], the rows whose queries' own mass output 3 returns
};
constexpr int32_t kOwningInputs = 17;
constexpr int32_t kSharingInputs = 12;
constexpr int32_t kOwningOutputs = 4; // attn_out, selected, attn_mass, query_mass
constexpr int32_t kMaxI = 1 << 30;
} // namespace

std::vector<AttrSpec> const& GsmSparseAttentionPlugin::attributeSpecs()
{
    static std::vector<AttrSpec> const specs{
        {"layer_kind", 0, 1, true, 0, &GsmDims::layerKind},
        {"num_heads", 1, 1024, true, 0, &GsmDims::numHeads},
        {"num_kv_heads", 1, 1024, true, 0, &GsmDims::numKvHeads},
        {"head_dim", 2, 256, true, 0, &GsmDims::headDim},
        {"rank_k", 1, 4096, true, 0, &GsmDims::rankK},
        {"rank_v", 1, 4096, true, 0, &GsmDims::rankV},
        {"index_heads", 1, 64, false, 1, &GsmDims::indexHeads},
        {"index_dim", 1, 512, false, 1, &GsmDims::indexDim},
        {"sink_tokens", 0, kMaxI, true, 0, &GsmDims::sinkTokens},
        {"max_top_k", 0, kMaxI, true, 0, &GsmDims::maxTopK},
        {"max_sparse_window", 1, kMaxI, true, 0, &GsmDims::maxSparseWindow},
        {"n_max", 1, 1 << 24, true, 0, &GsmDims::nMax},
        {"rows_fp16", 0, 1 << 24, true, 0, &GsmDims::rowsFP16},
        {"rows_int12", 0, 1 << 24, true, 0, &GsmDims::rowsINT12},
        {"rows_int8", 0, 1 << 24, true, 0, &GsmDims::rowsINT8},
        {"rows_int4", 0, 1 << 24, true, 0, &GsmDims::rowsINT4},
        {"index_key_bits", 8, 16, false, 16, &GsmDims::indexKeyBits}, // 8 or 16; absent: FP16 keys
        // optional: a node without it selects a fixed top-k
        {"sparse_top_k_divisor", 0, kMaxI, false, 0, &GsmDims::sparseTopKDivisor},
    };
    return specs;
}

void GsmSparseAttentionPlugin::validate(GsmDims const& d)
{
    if (d.numHeads % d.numKvHeads != 0)
    {
        throw std::invalid_argument(std::string(kName) + ": num_heads " + std::to_string(d.numHeads)
            + " is not a multiple of num_kv_heads " + std::to_string(d.numKvHeads));
    }
    if (d.headDim % 2 != 0)
    {
        throw std::invalid_argument(std::string(kName) + ": head_dim " + std::to_string(d.headDim) + " must be even (RoPE)");
    }
    if (static_cast<int64_t>(d.sinkTokens) + d.maxSparseWindow + d.maxTopK > (int64_t{1} << 24))
    {
        throw std::invalid_argument(std::string(kName) + ": sink_tokens + max_sparse_window + max_top_k exceeds 2^24");
    }
    validateLayout(kName, d);
}

GsmSparseAttentionPlugin::GsmSparseAttentionPlugin(std::string name, GsmDims const& d)
    : GsmPluginBase(std::move(name), d, attributeSpecs())
{
}

IPluginV3* GsmSparseAttentionPlugin::clone() noexcept
{
    try
    {
        return new GsmSparseAttentionPlugin(mName, mDims);
    }
    catch (std::exception const& e)
    {
        reportError(e.what());
    }
    return nullptr;
}

int32_t GsmSparseAttentionPlugin::expectedInputs() const noexcept
{
    return mDims.layerKind == 0 ? kOwningInputs : kSharingInputs;
}

int32_t GsmSparseAttentionPlugin::rowsInput() const noexcept
{
    return mDims.layerKind == 0 ? static_cast<int32_t>(kRowsOwning) : kSharingInputs - 1;
}

int32_t GsmSparseAttentionPlugin::getNbOutputs() const noexcept
{
    return mDims.layerKind == 0 ? kOwningOutputs : 1;
}

bool GsmSparseAttentionPlugin::allowedType(
    int32_t pos, DataType type, DynamicPluginTensorDesc const* inOut, int32_t nbInputs) const noexcept
{
    bool const owning = mDims.layerKind == 0;
    DataType const act = inOut[kQ].desc.type; // decided first (pos 0)
    if (pos == kQ)
    {
        return type == DataType::kFLOAT || type == DataType::kHALF;
    }
    if (pos >= nbInputs) // outputs: attn_out like q, selected int32, attn_mass and query_mass float
    {
        int32_t const o = pos - nbInputs;
        return o == 0 ? type == act : (o == 1 ? type == DataType::kINT32 : type == DataType::kFLOAT);
    }
    if (pos == rowsInput() || (owning && pos == kLogitRows))
    {
        return type == DataType::kINT32; // cache_rows, logit_rows
    }
    switch (pos)
    {
    case kPool:
    case kSlots:
    case kPast:
    case kNew: return type == DataType::kINT32;
    case kQuant:
    case kCos:
    case kSin:
    case kW0:
    case kW1: return type == DataType::kFLOAT;
    case kIndexQOrSelected: return owning ? type == act : type == DataType::kINT32;
    case kIndexW: return type == act;
    case kIndexKeys: return type == (int8Keys(mDims) ? DataType::kINT32 : DataType::kHALF); // INT8 codes in words
    case kWindow:
    case kTopK: return type == DataType::kINT32;
    default: return false;
    }
}

int32_t GsmSparseAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (!inputCountOk(nbInputs) || nbOutputs != getNbOutputs())
    {
        return 1;
    }
    outputTypes[0] = inputTypes[kQ];
    if (nbOutputs == kOwningOutputs)
    {
        outputTypes[1] = DataType::kINT32;
        outputTypes[2] = DataType::kFLOAT;
        outputTypes[3] = DataType::kFLOAT;
    }
    return 0;
}

int32_t GsmSparseAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    bool const owning = mDims.layerKind == 0;
    if (!inputCountOk(nbInputs) || nbOutputs != getNbOutputs() || inputs[kQ].nbDims != 3
        || (owning && inputs[kLogitRows].nbDims != 2))
    {
        reportError(std::string(kName) + ": q must be [B, S, num_heads*head_dim] (owning: logit_rows [B, J]) with the "
            "documented inputs");
        return 1;
    }
    outputs[0] = inputs[kQ]; // attn_out [B, S, nH*D]
    if (owning)
    {
        outputs[1].nbDims = 3; // selected [B, S, K_sel]
        outputs[1].d[0] = inputs[kQ].d[0];
        outputs[1].d[1] = inputs[kQ].d[1];
        outputs[1].d[2] = exprBuilder.constant(maxSelected(mDims));
        outputs[2].nbDims = 2; // attn_mass [B, N_max]
        outputs[2].d[0] = inputs[kQ].d[0];
        outputs[2].d[1] = exprBuilder.constant(mDims.nMax);
        outputs[3].nbDims = 3; // query_mass [B, J, N_max]
        outputs[3].d[0] = inputs[kLogitRows].d[0];
        outputs[3].d[1] = inputs[kLogitRows].d[1];
        outputs[3].d[2] = exprBuilder.constant(mDims.nMax);
    }
    return 0;
}

size_t GsmSparseAttentionPlugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const* /*outputs*/,
    int32_t /*nbOutputs*/) const noexcept
{
    if (nbInputs < 1 || inputs[kQ].max.nbDims != 3)
    {
        return 0;
    }
    int64_t const maxRows = static_cast<int64_t>(inputs[kQ].max.d[0]) * inputs[kQ].max.d[1];
    return cuda::sparseAttentionWorkspaceBytes(mDims, maxRows);
}

template <typename T>
int32_t GsmSparseAttentionPlugin::enqueueImpl(PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* workspace, size_t workspaceBytes, cudaStream_t stream) noexcept
{
    bool const owning = mDims.layerKind == 0;
    int32_t const B = static_cast<int32_t>(dim(inputDesc[kQ], 0));
    int32_t const S = static_cast<int32_t>(dim(inputDesc[kQ], 1));
    cuda::AttnDeviceArgs a{};
    a.q = inputs[kQ];
    a.pool = static_cast<int32_t const*>(inputs[kPool]);
    a.slots = static_cast<int32_t const*>(inputs[kSlots]);
    a.pastLengths = static_cast<int32_t const*>(inputs[kPast]);
    a.newLengths = static_cast<int32_t const*>(inputs[kNew]);
    a.quant = static_cast<float const*>(inputs[kQuant]);
    a.ropeCos = static_cast<float const*>(inputs[kCos]);
    a.ropeSin = static_cast<float const*>(inputs[kSin]);
    a.w0 = static_cast<float const*>(inputs[kW0]);
    a.w1 = static_cast<float const*>(inputs[kW1]);
    // sequence b's cache is row cache_rows[b] of the [R, ...] pools
    a.rows = cacheRowsOf(static_cast<int32_t const*>(inputs[rowsInput()]), static_cast<int32_t>(dim(inputDesc[kPool], 0)),
        B);
    a.out = outputs[0];
    if (owning)
    {
        a.indexQ = inputs[kIndexQOrSelected];
        a.indexW = inputs[kIndexW];
        a.indexKeys = inputs[kIndexKeys];
        a.sparseWindow = static_cast<int32_t const*>(inputs[kWindow]);
        a.sparseTopK = static_cast<int32_t const*>(inputs[kTopK]);
        a.selectedOut = static_cast<int32_t*>(outputs[1]);
        a.mass = static_cast<float*>(outputs[2]);
        a.logitRows = static_cast<int32_t const*>(inputs[kLogitRows]);
        a.logitRowCount = static_cast<int32_t>(dim(inputDesc[kLogitRows], 1));
        a.queryMass = static_cast<float*>(outputs[3]);
    }
    else
    {
        a.selectedIn = static_cast<int32_t const*>(inputs[kIndexQOrSelected]);
    }
    cudaError_t const e = cuda::launchSparseAttention<T>(mDims, B, S, a, workspace, workspaceBytes, stream);
    if (e != cudaSuccess)
    {
        reportError(std::string(kName) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
        return 1;
    }
    return 0;
}

int32_t GsmSparseAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    // The workspace TensorRT hands out is what getWorkspaceSize asked for at the profile maximum.
    int64_t const rows = dim(inputDesc[kQ], 0) * dim(inputDesc[kQ], 1);
    size_t const wsBytes = cuda::sparseAttentionWorkspaceBytes(mDims, rows);
    switch (inputDesc[kQ].type)
    {
    case DataType::kFLOAT: return enqueueImpl<float>(inputDesc, inputs, outputs, workspace, wsBytes, stream);
    case DataType::kHALF: return enqueueImpl<__half>(inputDesc, inputs, outputs, workspace, wsBytes, stream);
    default: reportError(std::string(kName) + ": q must be float32 or float16"); return 1;
    }
}

} // namespace trt
} // namespace gsm
