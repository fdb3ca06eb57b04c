/*
 * gsmOrtOpTable.h: how an op of libgsm_ort_ops.so declares itself to ONNX Runtime. Each op's folder defines one
 * OrtOpDescriptor (name, inputs, outputs, kernel create / compute / destroy); common/gsmOrtRegistration.cpp turns
 * each into an OrtCustomOp whose metadata callbacks are one generic set reading the descriptor, and registers the
 * table below in the domain "ai.gsm_edge.cpu", version 1.
 */
#pragma once

#include <onnxruntime_c_api.h>

#include <cstddef>

namespace gsm
{
namespace ortcpu
{

// ORT 1.17: the first C API with KernelContext_ParallelFor. The op structs say the same version, so ONNX Runtime
// reads only the OrtCustomOp fields that version has.
constexpr uint32_t kOrtApiVersion = 17;
constexpr char const* kOrtDomain = "ai.gsm_edge.cpu";

// One input or output: its name (error messages name it), its element type (UNDEFINED: more than one is accepted
// and the op checks it per call; for an output, ONNX Runtime's type inference then gives it the type of the last
// input whose type is open) and whether a node may leave it out.
struct OrtOpPort
{
    char const* name;
    ONNXTensorElementDataType type;
    OrtCustomOpInputOutputCharacteristic kind;
};

struct OrtOpDescriptor
{
    char const* name;
    OrtOpPort const* inputs;
    size_t inputCount;
    OrtOpPort const* outputs;
    size_t outputCount;
    OrtStatus*(ORT_API_CALL* create)(OrtCustomOp const*, OrtApi const*, OrtKernelInfo const*, void** kernel);
    OrtStatus*(ORT_API_CALL* compute)(void* kernel, OrtKernelContext* ctx);
    void(ORT_API_CALL* destroy)(void* kernel);
};

template <size_t N>
constexpr size_t portCount(OrtOpPort const (&)[N])
{
    return N;
}

// A kernel state made with new T by the op's create
template <class T>
void ORT_API_CALL destroyKernel(void* kernel)
{
    delete static_cast<T*>(kernel);
}

// The ops, each defined in its folder (registered in this order)
extern OrtOpDescriptor const kCachedAttentionOp;     // GsmCachedAttention/
extern OrtOpDescriptor const kGroupOffsetOp;         // GsmGroupOffset/
extern OrtOpDescriptor const kQuantMatMulOp;         // GsmQuantMatMul/
extern OrtOpDescriptor const kSideSplitOp;           // GsmSideSplit/
extern OrtOpDescriptor const kPoolAttentionOp;       // GsmPoolAttention/
extern OrtOpDescriptor const kPoolSharedAttentionOp; // GsmPoolAttention/ (the sharing layer's form)
extern OrtOpDescriptor const kTileGatherOp;          // GsmTileGather/

} // namespace ortcpu
} // namespace gsm
