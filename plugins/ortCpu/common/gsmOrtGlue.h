/*
 * gsmOrtGlue.h: what every op of libgsm_ort_ops.so needs from ONNX Runtime's C API, written once: the API table,
 * errors as an OrtStatus that names the op (and the input or attribute), a node's inputs with their shapes, types
 * and data, attributes, outputs, and the intra-op pool as a ParallelRunner. The ops' math never sees these types:
 * each op's folder has its math on raw pointers and a gsm<Op>Ort.cpp that binds it here.
 */
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gsmOrtOpTable.h"
#include "gsmParallel.h"

#define GSM_ORT_TRY(expr)                                                                                            \
    do                                                                                                               \
    {                                                                                                                \
        OrtStatus* _st = (expr);                                                                                     \
        if (_st != nullptr)                                                                                          \
        {                                                                                                            \
            return _st;                                                                                              \
        }                                                                                                            \
    } while (0)

namespace gsm
{
namespace ortcpu
{

// The API ONNX Runtime handed RegisterCustomOps (version kOrtApiVersion)
extern OrtApi const* gOrtApi;

// "<op>: <message>" as ORT_INVALID_ARGUMENT: a node or a call the op refuses
OrtStatus* invalidArgument(OrtOpDescriptor const& op, std::string const& message);
// a message that already names the op (the math's own, or the pool failing)
OrtStatus* statusOf(OrtErrorCode code, std::string const& message);

// "[2, 3]"
std::string dimsText(std::vector<int64_t> const& dims);

// The most inputs an op has (GsmPoolAttention's 22)
constexpr size_t kMaxOpInputs = 24;

// A node's inputs in one call: value, shape and data of each (null and empty where the node leaves an optional
// input out)
struct NodeInputs
{
    OrtValue const* value[kMaxOpInputs] = {};
    std::vector<int64_t> shape[kMaxOpInputs];
    void* data[kMaxOpInputs] = {};

    bool has(size_t i) const
    {
        return value[i] != nullptr;
    }
    template <class T>
    T const* as(size_t i) const
    {
        return static_cast<T const*>(data[i]);
    }
};

// Every input of op `op` in this call; a required one missing is an error naming it.
OrtStatus* readInputs(OrtKernelContext* ctx, OrtOpDescriptor const& op, NodeInputs* in);

OrtStatus* elementType(OrtValue const* value, ONNXTensorElementDataType* type);

// The element type inputs x and y share, `a` or `b`; else an error with `message` (naming the inputs and what is
// allowed).
OrtStatus* sharedType(OrtOpDescriptor const& op, OrtValue const* x, OrtValue const* y, ONNXTensorElementDataType a,
    ONNXTensorElementDataType b, char const* message, ONNXTensorElementDataType* type);

// Input i has exactly the shape `want`, else "input <name> has shape [..], expected [..] (<meaning>)".
OrtStatus* expectShape(OrtOpDescriptor const& op, size_t i, std::vector<int64_t> const& got,
    std::vector<int64_t> const& want, char const* meaning);
// The same where entries of `want` below 0 take any size (written "*"); `name` in place of the input's own where it
// holds something else (GsmCachedAttention's V rows).
OrtStatus* expectShapeAny(OrtOpDescriptor const& op, size_t i, std::vector<int64_t> const& got,
    std::vector<int64_t> const& want, char const* meaning, char const* name = nullptr);

// An int64 attribute the node must have
OrtStatus* intAttribute(OrtOpDescriptor const& op, OrtKernelInfo const* info, char const* name, int64_t* value);
// An int64 attribute a node may leave out (`fallback` then); present with another type it is an error.
OrtStatus* optionalIntAttribute(OrtOpDescriptor const& op, OrtKernelInfo const* info, char const* name,
    int64_t fallback, int64_t* value);

// The attributes an owning layer's attention node (GsmCachedAttention, GsmPoolAttention) selects and attends with;
// each op checks them with its own message.
struct OwningAttentionAttributes
{
    int64_t numHeads, numKvHeads, headDim, indexHeads, indexDim, sinkTokens, topKDivisor;
};
OrtStatus* owningAttentionAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info,
    OwningAttentionAttributes* a);

OrtStatus* outputCount(OrtKernelContext* ctx, size_t* count);
// Output i made with the given shape and its data (null where the node leaves an optional output out)
OrtStatus* makeOutput(OrtKernelContext* ctx, size_t i, int64_t const* dims, size_t rank, void** data);

// The intra-op pool of this call (KernelContext_ParallelFor)
ParallelRunner intraOpPool(OrtKernelContext* ctx);

} // namespace ortcpu
} // namespace gsm
