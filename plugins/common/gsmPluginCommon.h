/*
 * Shared glue of the GSM TensorRT plugins (IPluginV3 + IPluginV3OneCore / OneBuildV2 / OneRuntime):
 * attribute tables and their validation, serialisation as plugin fields, and a base class that
 * answers the capability queries, so each plugin only writes its shapes, types and enqueue.
 * Written against TensorRT 10.3+ (IPluginV3OneBuildV2 for in-place cache outputs) and 11.x; compiles
 * against 10.0-10.2 too, where the build capability is IPluginV3OneBuild and cache outputs are copies.
 */
#pragma once

#include "gsm_layout.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

// IPluginV3OneBuildV2 (getAliasedInput, PreviewFeature::kALIASED_PLUGIN_IO_10_03) exists from
// TensorRT 10.3. Older 10.x headers only have IPluginV3OneBuild: the plugins still build, TensorRT
// gives the cache outputs their own buffers, and enqueue's carry-over copy keeps them correct.
#if NV_TENSORRT_MAJOR > 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR >= 3)
#define GSM_TRT_ALIASED_IO 1
#else
#define GSM_TRT_ALIASED_IO 0
#endif

namespace gsm
{
namespace trt
{

#if GSM_TRT_ALIASED_IO
using GsmPluginBuild = nvinfer1::IPluginV3OneBuildV2;
#else
using GsmPluginBuild = nvinfer1::IPluginV3OneBuild;
#endif

// Names shared with the ONNX nodes (docs/engine_io.md section 4).
constexpr char const* kPluginVersion = "3";
constexpr char const* kPluginNamespace = "gsm";

// Where an attribute lands in GsmDims (an alias: nvcc's host pass re-emits a bare member-pointer
// declarator with parentheses, which g++ -Wall then flags).
using GsmDimsField = int32_t GsmDims::*;

// One integer attribute: its ONNX/field name, valid range, and where it lands in GsmDims.
struct AttrSpec
{
    char const* name;
    int32_t minValue;
    int32_t maxValue;
    bool required;
    int32_t defaultValue;
    GsmDimsField field;
};

// Reads `fc` against `specs`: every required attribute present, each an integer within range,
// unknown names rejected (except the ONNX parser's plugin_version / plugin_namespace). Throws
// std::invalid_argument naming the plugin, the attribute, the value and the valid range.
GsmDims parseAttributes(char const* pluginName, nvinfer1::PluginFieldCollection const* fc,
    std::vector<AttrSpec> const& specs);

// Cross-attribute checks shared by the plugins (row counts cover n_max, ...); throws like above.
void validateLayout(char const* pluginName, GsmDims const& d);

// Report an error the way TensorRT plugins should: the registry's error recorder when one is
// set, stderr otherwise.
void reportError(std::string const& msg) noexcept;

// Base of the three GSM plugins. The derived class supplies the attribute specs, the number of
// outputs and the build/runtime specifics; everything generic lives here.
class GsmPluginBase : public nvinfer1::IPluginV3,
                      public nvinfer1::IPluginV3OneCore,
                      public GsmPluginBuild,
                      public nvinfer1::IPluginV3OneRuntime
{
public:
    GsmPluginBase(std::string name, GsmDims const& dims, std::vector<AttrSpec> const& specs);
    ~GsmPluginBase() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

    // IPluginV3OneCore
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

    // IPluginV3OneBuild: all GSM tensors are linear; per-position types come from allowedType().
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

#if !GSM_TRT_ALIASED_IO
    // No aliased plugin I/O before TensorRT 10.3; kept so the plugins' overrides read the same.
    virtual int32_t getAliasedInput(int32_t /*outputIndex*/) noexcept
    {
        return -1;
    }
#endif

protected:
    // Type allowed at I/O position `pos` given the already chosen types of positions < pos.
    virtual bool allowedType(int32_t pos, nvinfer1::DataType type, nvinfer1::DynamicPluginTensorDesc const* inOut,
        int32_t nbInputs) const noexcept = 0;
    // Expected number of inputs for the configured variant.
    virtual int32_t expectedInputs() const noexcept = 0;
    // Whether a node with nbInputs inputs is accepted (a plugin may also take an older form).
    virtual bool inputCountOk(int32_t nbInputs) const noexcept
    {
        return nbInputs == expectedInputs();
    }

    std::string mName;
    GsmDims mDims;
    std::vector<AttrSpec> mSpecs;
    std::vector<int32_t> mFieldValues;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

// Creator shared by the plugins: fields from the spec table, validation, construction.
template <typename Plugin>
class GsmCreatorBase : public nvinfer1::IPluginCreatorV3One
{
public:
    GsmCreatorBase()
    {
        for (AttrSpec const& s : Plugin::attributeSpecs())
        {
            mFields.emplace_back(s.name, nullptr, nvinfer1::PluginFieldType::kINT32, 1);
        }
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.data();
    }

    char const* getPluginName() const noexcept override
    {
        return Plugin::kName;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return &mCollection;
    }

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept override
    {
        try
        {
            GsmDims const d = parseAttributes(Plugin::kName, fc, Plugin::attributeSpecs());
            Plugin::validate(d);
            return new Plugin(name ? name : "", d);
        }
        catch (std::exception const& e)
        {
            reportError(e.what());
        }
        return nullptr;
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

// Helpers for enqueue: element counts and dims of plugin tensors.
inline int64_t dim(nvinfer1::PluginTensorDesc const& t, int32_t i)
{
    return static_cast<int64_t>(t.dims.d[i]);
}

} // namespace trt
} // namespace gsm
