/*
 * GsmSparseAttention TensorRT plugin (docs/engine_io.md 4.2). Owning variant (layer_kind 0): 17
 * inputs (input 14 sparse_top_k [B], input 15 cache_rows [B], input 16 logit_rows [B, J]), outputs attn_out,
 * selected, attn_mass, query_mass [B, J, N_max]. Sharing variant (layer_kind 1): 12 inputs (input 11 cache_rows [B]),
 * output attn_out. One node form each (plugin_version "3"). The math is gsmSparseAttentionKernels.cu; this file is
 * shapes, types and dispatch.
 */
#pragma once

#include "../common/gsmPluginCommon.h"

namespace gsm
{
namespace trt
{

class GsmSparseAttentionPlugin : public GsmPluginBase
{
public:
    static constexpr char const* kName = "GsmSparseAttention";
    static std::vector<AttrSpec> const& attributeSpecs();
    static void validate(GsmDims const& d); // throws std::invalid_argument

    GsmSparseAttentionPlugin(std::string name, GsmDims const& d);

    // IPluginV3
    nvinfer1::IPluginV3* clone() noexcept override;
    // IPluginV3OneCore
    char const* getPluginName() const noexcept override
    {
        return kName;
    }
    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    // IPluginV3OneBuildV2: attention writes no cache, nothing is aliased
    int32_t getAliasedInput(int32_t /*outputIndex*/) noexcept override
    {
        return -1;
    }
    // IPluginV3OneRuntime
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

protected:
    bool allowedType(int32_t pos, nvinfer1::DataType type, nvinfer1::DynamicPluginTensorDesc const* inOut,
        int32_t nbInputs) const noexcept override;
    int32_t expectedInputs() const noexcept override;
    int32_t rowsInput() const noexcept; // position of cache_rows

private:

    template <typename T>
    int32_t enqueueImpl(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
        void* workspace, size_t workspaceBytes, cudaStream_t stream) noexcept;
};

using GsmSparseAttentionCreator = GsmCreatorBase<GsmSparseAttentionPlugin>;

} // namespace trt
} // namespace gsm
