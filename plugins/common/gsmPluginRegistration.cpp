/*
 * The one place the GSM creators are registered with TensorRT.
 *
 * Default (GSM_PLUGINS_STATIC_REGISTRATION=ON): REGISTER_TENSORRT_PLUGIN registers the creators
 * when libgsm_trt_plugins.so is loaded (dlopen / ctypes.CDLL before parsing the ONNX file).
 * With the option OFF the library instead exports the entry points of IPluginRegistry::loadLibrary
 * (trtexec --dynamicPlugins, engines that serialise their plugin libraries); doing both would
 * register every creator twice.
 */
#include "../gsmKVCache/gsmKVCachePlugin.h"
#include "../gsmSparseAttention/gsmSparseAttentionPlugin.h"

#include <NvInferRuntime.h>

using gsm::trt::GsmKVCacheUpdateCreator;
using gsm::trt::GsmKVDemoteCreator;
using gsm::trt::GsmSparseAttentionCreator;

#if !defined(GSM_EXPORT_GET_CREATORS)
REGISTER_TENSORRT_PLUGIN(GsmSparseAttentionCreator);
REGISTER_TENSORRT_PLUGIN(GsmKVCacheUpdateCreator);
REGISTER_TENSORRT_PLUGIN(GsmKVDemoteCreator);
#else
extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* /*finder*/)
{
    // errors go through the registry's error recorder or stderr (gsmPluginCommon.cpp)
}

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators)
{
    static GsmSparseAttentionCreator sAttention;
    static GsmKVCacheUpdateCreator sUpdate;
    static GsmKVDemoteCreator sDemote;
    static nvinfer1::IPluginCreatorInterface* const sCreators[] = {&sAttention, &sUpdate, &sDemote};
    nbCreators = 3;
    return sCreators;
}
#endif
