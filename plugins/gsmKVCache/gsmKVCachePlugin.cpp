#include "gsmKVCachePlugin.h"

#include "gsmKVCacheKernels.h"

#include <cuda_fp16.h>

namespace gsm
{
namespace trt
{

using namespace nvinfer1;

namespace
{
enum : int32_t
{
    kCk = 0,
    kCv,
    kKey,
    kPool,
    kKeys,
    kSlots,
    kPast,
    kNew,
    kRows // cache_rows [B]
};
enum : int32_t
{
    kList = 0,
    kQuant = 1,
    kDemotePool = 2
};

// The pool/keys outputs alias their inputs; if TensorRT ever hands separate buffers, carry the
// untouched contents over first so the node still behaves as "write these rows in place".
cudaError_t carryOver(void* dst, void const* src, size_t bytes, cudaStream_t stream)
{
    return dst == src ? cudaSuccess : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

int32_t fail(char const* plugin, cudaError_t e)
{
    reportError(std::string(plugin) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
    return 1;
}

std::vector<AttrSpec> cacheSpecs()
{
    return {
        {"rank_k", 1, 4096, true, 0, &GsmDims::rankK},
        {"rank_v", 1, 4096, true, 0, &GsmDims::rankV},
        {"index_dim", 1, 512, true, 0, &GsmDims::indexDim},
        {"n_max", 1, 1 << 24, true, 0, &GsmDims::nMax},
        {"rows_fp16", 0, 1 << 24, true, 0, &GsmDims::rowsFP16},
        {"rows_int12", 0, 1 << 24, true, 0, &GsmDims::rowsINT12},
        {"rows_int8", 0, 1 << 24, true, 0, &GsmDims::rowsINT8},
        {"rows_int4", 0, 1 << 24, true, 0, &GsmDims::rowsINT4},
        {"index_key_bits", 8, 16, false, 16, &GsmDims::indexKeyBits}, // 8 or 16; absent: FP16 keys
    };
}
} // namespace

// ---- GsmKVCacheUpdate ----------------------------------------------------------------------------
std::vector<AttrSpec> const& GsmKVCacheUpdatePlugin::attributeSpecs()
{
    static std::vector<AttrSpec> const specs = cacheSpecs();
    return specs;
}

void GsmKVCacheUpdatePlugin::validate(GsmDims const& d)
{
    validateLayout(kName, d);
}

GsmKVCacheUpdatePlugin::GsmKVCacheUpdatePlugin(std::string name, GsmDims const& d)
    : GsmPluginBase(std::move(name), d, attributeSpecs())
{
}

IPluginV3* GsmKVCacheUpdatePlugin::clone() noexcept
{
    try
    {
        return new GsmKVCacheUpdatePlugin(mName, mDims);
    }
    catch (std::exception const& e)
    {
        reportError(e.what());
    }
    return nullptr;
}

bool GsmKVCacheUpdatePlugin::allowedType(
    int32_t pos, DataType type, DynamicPluginTensorDesc const* inOut, int32_t nbInputs) const noexcept
{
    if (pos == kCk)
    {
        return type == DataType::kFLOAT || type == DataType::kHALF;
    }
    if (pos == kCv || pos == kKey)
    {
        return type == inOut[kCk].desc.type;
    }
    if (pos == kKeys || pos == nbInputs + 1) // FP16 keys, or INT8 codes in int32 words
    {
        return type == (int8Keys(mDims) ? DataType::kINT32 : DataType::kHALF);
    }
    return type == DataType::kINT32; // pool, slots, lengths, pool output
}

int32_t GsmKVCacheUpdatePlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (!inputCountOk(nbInputs) || nbOutputs != 2)
    {
        return 1;
    }
    outputTypes[0] = inputTypes[kPool];
    outputTypes[1] = inputTypes[kKeys];
    return 0;
}

int32_t GsmKVCacheUpdatePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& /*exprBuilder*/) noexcept
{
    if (!inputCountOk(nbInputs) || nbOutputs != 2)
    {
        return 1;
    }
    outputs[0] = inputs[kPool]; // [R, P32]: the whole pools, R >= the call's B
    outputs[1] = inputs[kKeys];
    return 0;
}

int32_t GsmKVCacheUpdatePlugin::getAliasedInput(int32_t outputIndex) noexcept
{
    return outputIndex == 0 ? kPool : (outputIndex == 1 ? kKeys : -1);
}

int32_t GsmKVCacheUpdatePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    int32_t const B = static_cast<int32_t>(dim(inputDesc[kCk], 0));
    int32_t const S = static_cast<int32_t>(dim(inputDesc[kCk], 1));
    if (dim(inputDesc[kPool], 1) != poolWords(mDims))
    {
        reportError(std::string(kName) + ": kv_pool has " + std::to_string(dim(inputDesc[kPool], 1))
            + " words per sequence, the attributes give " + std::to_string(poolWords(mDims)));
        return 1;
    }
    int32_t const R = static_cast<int32_t>(dim(inputDesc[kPool], 0));
    CacheRows const rows = cacheRowsOf(static_cast<int32_t const*>(inputs[kRows]), R, B);
    auto* pool = static_cast<int32_t*>(outputs[0]);
    void* keys = outputs[1];
    cudaError_t e = carryOver(pool, inputs[kPool], static_cast<size_t>(R) * poolWords(mDims) * 4, stream);
    if (e == cudaSuccess)
    {
        e = carryOver(keys, inputs[kKeys], static_cast<size_t>(R) * mDims.nMax * indexKeyBytes(mDims), stream);
    }
    auto const* slots = static_cast<int32_t const*>(inputs[kSlots]);
    auto const* past = static_cast<int32_t const*>(inputs[kPast]);
    auto const* nNew = static_cast<int32_t const*>(inputs[kNew]);
    if (e == cudaSuccess)
    {
        if (inputDesc[kCk].type == DataType::kFLOAT)
        {
            e = cuda::launchKVCacheUpdate<float>(mDims, B, S, static_cast<float const*>(inputs[kCk]),
                static_cast<float const*>(inputs[kCv]), static_cast<float const*>(inputs[kKey]), pool, keys, slots,
                past, nNew, rows, stream);
        }
        else
        {
            e = cuda::launchKVCacheUpdate<__half>(mDims, B, S, static_cast<__half const*>(inputs[kCk]),
                static_cast<__half const*>(inputs[kCv]), static_cast<__half const*>(inputs[kKey]), pool, keys, slots,
                past, nNew, rows, stream);
        }
    }
    return e == cudaSuccess ? 0 : fail(kName, e);
}

// ---- GsmKVDemote ---------------------------------------------------------------------------------
std::vector<AttrSpec> const& GsmKVDemotePlugin::attributeSpecs()
{
    static std::vector<AttrSpec> const specs = cacheSpecs();
    return specs;
}

void GsmKVDemotePlugin::validate(GsmDims const& d)
{
    validateLayout(kName, d);
}

GsmKVDemotePlugin::GsmKVDemotePlugin(std::string name, GsmDims const& d)
    : GsmPluginBase(std::move(name), d, attributeSpecs())
{
}

IPluginV3* GsmKVDemotePlugin::clone() noexcept
{
    try
    {
        return new GsmKVDemotePlugin(mName, mDims);
    }
    catch (std::exception const& e)
    {
        reportError(e.what());
    }
    return nullptr;
}

bool GsmKVDemotePlugin::allowedType(
    int32_t pos, DataType type, DynamicPluginTensorDesc const* /*inOut*/, int32_t /*nbInputs*/) const noexcept
{
    return pos == kQuant ? type == DataType::kFLOAT : type == DataType::kINT32;
}

int32_t GsmKVDemotePlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != 3 || nbOutputs != 1)
    {
        return 1;
    }
    outputTypes[0] = inputTypes[kDemotePool];
    return 0;
}

int32_t GsmKVDemotePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs != 3 || nbOutputs != 1)
    {
        return 1;
    }
    outputs[0] = inputs[kDemotePool];
    return 0;
}

size_t GsmKVDemotePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return nbInputs == 3 ? cuda::kvDemoteWorkspaceBytes(mDims, inputs[kList].max.d[0]) : 0;
}

int32_t GsmKVDemotePlugin::getAliasedInput(int32_t outputIndex) noexcept
{
    return outputIndex == 0 ? kDemotePool : -1;
}

int32_t GsmKVDemotePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    int32_t const M = static_cast<int32_t>(dim(inputDesc[kList], 0));
    int32_t const B = static_cast<int32_t>(dim(inputDesc[kDemotePool], 0));
    auto* pool = static_cast<int32_t*>(outputs[0]);
    cudaError_t e = carryOver(pool, inputs[kDemotePool], static_cast<size_t>(B) * poolWords(mDims) * 4, stream);
    if (e == cudaSuccess)
    {
        e = cuda::launchKVDemote(mDims, B, M, static_cast<int32_t const*>(inputs[kList]), pool,
            static_cast<float const*>(inputs[kQuant]), workspace, stream);
    }
    return e == cudaSuccess ? 0 : fail(kName, e);
}

} // namespace trt
} // namespace gsm
