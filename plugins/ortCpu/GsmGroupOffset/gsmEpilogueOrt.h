/*
 * gsmEpilogueOrt.h: the ONNX Runtime side of the epilogues GsmGroupOffset and GsmQuantMatMul share (residual,
 * SwiGLU, the next RMSNorm; gsmGroupOffset.h): their attributes and their outputs, y and, with a norm, normed.
 */
#pragma once

#include "../common/gsmOrtGlue.h"
#include "gsmGroupOffset.h"

namespace gsm
{
namespace ortcpu
{

// Attributes swiglu (0 or 1) and norm_epsilon (only with input norm_weight)
struct Epilogue
{
    int64_t swiglu = 0;
    float normEps = 0.f;
    bool hasNormEps = false;
};

// Both op's outputs: y, and normed (optional: with norm_weight)
extern OrtOpPort const kEpilogueOutputs[2];

OrtStatus* epilogueAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info, Epilogue* e);

// Checks the norm's input (norm_weight [N], shape `normShape`; null: no norm) against the attributes and the node's
// outputs, then makes the epilogue's outputs into a: y [M, N] ([M, N / 2] with swiglu) and, with a norm, normed.
OrtStatus* epilogueOutputs(OrtOpDescriptor const& op, OrtKernelContext* ctx, Epilogue const& e,
    float const* normWeight, std::vector<int64_t> const& normShape, GroupOffsetArgs* a);

} // namespace ortcpu
} // namespace gsm
