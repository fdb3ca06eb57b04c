#include "gsmPluginCommon.h"

#include <cstdio>
#include <cstring>
#include <set>

namespace gsm
{
namespace trt
{

using namespace nvinfer1;

namespace
{

// ONNX INT attributes reach the creator as kINT32 (the parser narrows them) or kINT64; serialised
// fields are kINT32. Anything else is a type error worth naming.
int64_t readInteger(char const* pluginName, PluginField const& f)
{
    std::string const where = std::string(pluginName) + ": attribute '" + f.name + "'";
    if (f.data == nullptr || f.length != 1)
    {
        throw std::invalid_argument(where + " must be one integer (got length " + std::to_string(f.length) + ")");
    }
    switch (f.type)
    {
    case PluginFieldType::kINT32: return *static_cast<int32_t const*>(f.data);
    case PluginFieldType::kINT64: return *static_cast<int64_t const*>(f.data);
    case PluginFieldType::kINT16: return *static_cast<int16_t const*>(f.data);
    case PluginFieldType::kINT8: return *static_cast<int8_t const*>(f.data);
    default: throw std::invalid_argument(where + " must be an integer (INT) attribute");
    }
}

} // namespace

GsmDims parseAttributes(char const* pluginName, PluginFieldCollection const* fc, std::vector<AttrSpec> const& specs)
{
    GsmDims d{};
    std::set<std::string> seen;
    if (fc != nullptr)
    {
        for (int32_t i = 0; i < fc->nbFields; ++i)
        {
            PluginField const& f = fc->fields[i];
            if (f.name == nullptr)
            {
                continue;
            }
            std::string const name = f.name;
            if (name == "plugin_version" || name == "plugin_namespace")
            {
                continue; // consumed by the ONNX parser to find the creator
            }
            AttrSpec const* spec = nullptr;
            for (AttrSpec const& s : specs)
            {
                if (name == s.name)
                {
                    spec = &s;
                }
            }
            if (spec == nullptr)
            {
                std::string known;
                for (AttrSpec const& s : specs)
                {
                    known += std::string(known.empty() ? "" : ", ") + s.name;
                }
                throw std::invalid_argument(std::string(pluginName) + ": unknown attribute '" + name + "' (known: " + known + ")");
            }
            if (seen.count(spec->name))
            {
                throw std::invalid_argument(std::string(pluginName) + ": attribute '" + spec->name + "' is given twice");
            }
            int64_t const v = readInteger(pluginName, f);
            if (v < spec->minValue || v > spec->maxValue)
            {
                throw std::invalid_argument(std::string(pluginName) + ": attribute '" + name + "' = " + std::to_string(v)
                    + " outside its valid range [" + std::to_string(spec->minValue) + ", " + std::to_string(spec->maxValue)
                    + "] (docs/engine_io.md section 4)");
            }
            d.*(spec->field) = static_cast<int32_t>(v);
            seen.insert(spec->name);
        }
    }
    for (AttrSpec const& s : specs)
    {
        if (!seen.count(s.name))
        {
            if (s.required)
            {
                throw std::invalid_argument(std::string(pluginName) + ": required attribute '" + s.name + "' is missing");
            }
            d.*(s.field) = s.defaultValue;
        }
    }
    return d;
}

void validateLayout(char const* pluginName, GsmDims const& d)
{
    if (d.indexKeyBits != 8 && d.indexKeyBits != 16)
    {
        throw std::invalid_argument(std::string(pluginName) + ": attribute 'index_key_bits' = "
            + std::to_string(d.indexKeyBits) + ", expected 8 (INT8 key codes) or 16 (FP16 keys)");
    }
    int64_t const rows = regionRows(d);
    if (rows < d.nMax)
    {
        throw std::invalid_argument(std::string(pluginName) + ": rows_fp16 + rows_int12 + rows_int8 + rows_int4 = " + std::to_string(rows)
            + " < n_max = " + std::to_string(d.nMax) + " (every cached position needs a row)");
    }
    if (rows > kSlotRowMask + 1)
    {
        throw std::invalid_argument(std::string(pluginName) + ": more than 2^24 pool rows cannot be addressed by kv_slots");
    }
    if (poolBytes(d) > (int64_t{1} << 33))
    {
        throw std::invalid_argument(std::string(pluginName) + ": a latent pool over 8 GiB per sequence is outside v1");
    }
}

void reportError(std::string const& msg) noexcept
{
    IErrorRecorder* rec = getPluginRegistry() ? getPluginRegistry()->getErrorRecorder() : nullptr;
    if (rec != nullptr)
    {
        rec->reportError(ErrorCode::kINVALID_ARGUMENT, msg.c_str());
        return;
    }
    std::fprintf(stderr, "[gsm plugins] %s\n", msg.c_str());
}

GsmPluginBase::GsmPluginBase(std::string name, GsmDims const& dims, std::vector<AttrSpec> const& specs)
    : mName(std::move(name))
    , mDims(dims)
    , mSpecs(specs)
{
    // Serialised fields: every attribute of the spec table with its (validated) value, so
    // createPlugin(kRUNTIME) rebuilds the same plugin.
    mFieldValues.reserve(mSpecs.size());
    for (AttrSpec const& s : mSpecs)
    {
        mFieldValues.push_back(mDims.*(s.field));
    }
    for (size_t i = 0; i < mSpecs.size(); ++i)
    {
        mFields.emplace_back(mSpecs[i].name, &mFieldValues[i], PluginFieldType::kINT32, 1);
    }
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

IPluginCapability* GsmPluginBase::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kBUILD: return static_cast<GsmPluginBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    }
    return nullptr;
}

int32_t GsmPluginBase::configurePlugin(
    DynamicPluginTensorDesc const* /*in*/, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (!inputCountOk(nbInputs) || nbOutputs != getNbOutputs())
    {
        reportError(std::string(getPluginName()) + ": expected " + std::to_string(expectedInputs()) + " inputs and "
            + std::to_string(getNbOutputs()) + " outputs, got " + std::to_string(nbInputs) + " and "
            + std::to_string(nbOutputs) + " (docs/engine_io.md section 4)");
        return 1;
    }
    return 0;
}

bool GsmPluginBase::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!inputCountOk(nbInputs) || nbOutputs != getNbOutputs() || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    DynamicPluginTensorDesc const& t = inOut[pos];
    return t.desc.format == TensorFormat::kLINEAR && allowedType(pos, t.desc.type, inOut, nbInputs);
}

int32_t GsmPluginBase::onShapeChange(
    PluginTensorDesc const* /*in*/, int32_t /*nbInputs*/, PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    return 0; // shapes are read in enqueue; nothing is cached per shape
}

IPluginV3* GsmPluginBase::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* GsmPluginBase::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

} // namespace trt
} // namespace gsm
