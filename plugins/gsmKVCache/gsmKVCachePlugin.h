/*
 * GsmKVCacheUpdate and GsmKVDemote TensorRT plugins (docs/engine_io.md 4.1, 4.3). Both write the
 * latent pool in place: their pool output is aliased to the pool input (IPluginV3OneBuildV2::
 * getAliasedInput; the builder turns on PreviewFeature::kALIASED_PLUGIN_IO_10_03 on TensorRT 10.x).
 */
#pragma once

#include "../common/gsmPluginCommon.h"

namespace gsm
{
namespace trt
{

class GsmKVCacheUpdatePlugin : public GsmPluginBase
{
public:
    static constexpr char const* kName = "GsmKVCacheUpdate";
    static std::vector<AttrSpec> const& attributeSpecs();
    static void validate(GsmDims const& d);

    GsmKVCacheUpdatePlugin(std::string name, GsmDims const& d);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override
    {
        return kName;
    }
    int32_t getNbOutputs() const noexcept override
    {
        return 2;
    }
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

protected:
    bool allowedType(int32_t pos, nvinfer1::DataType type, nvinfer1::DynamicPluginTensorDesc const* inOut,
        int32_t nbInputs) const noexcept override;
    int32_t expectedInputs() const noexcept override
    {
        return 9; // input 8: cache_rows [B]
    }
};

class GsmKVDemotePlugin : public GsmPluginBase
{
public:
    static constexpr char const* kName = "GsmKVDemote";
    static std::vector<AttrSpec> const& attributeSpecs();
    static void validate(GsmDims const& d);

    GsmKVDemotePlugin(std::string name, GsmDims const& d);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override
    {
        return kName;
    }
    int32_t getNbOutputs() const noexcept override
    {
        return 1;
    }
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

protected:
    bool allowedType(int32_t pos, nvinfer1::DataType type, nvinfer1::DynamicPluginTensorDesc const* inOut,
        int32_t nbInputs) const noexcept override;
    int32_t expectedInputs() const noexcept override
    {
        return 3;
    }
};

using GsmKVCacheUpdateCreator = GsmCreatorBase<GsmKVCacheUpdatePlugin>;
using GsmKVDemoteCreator = GsmCreatorBase<GsmKVDemotePlugin>;

} // namespace trt
} // namespace gsm
