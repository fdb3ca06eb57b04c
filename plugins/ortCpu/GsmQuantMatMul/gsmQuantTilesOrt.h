/*
 * gsmQuantTilesOrt.h: the ONNX Runtime side of a weight stored as GsmQuantMatMul's tiles (gsmQuantMatMul.h), shared by
 * GsmQuantMatMul and GsmTileGather: attributes K, N, bits, block_size, and the codes / scales / offsets inputs.
 */
#pragma once

#include "../common/gsmOrtGlue.h"

namespace gsm
{
namespace ortcpu
{

struct TileAttributes
{
    int64_t K, N, bits, block;
};

// K, N, bits (4 or 8) and block_size (a multiple of 32)
OrtStatus* tileAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info, TileAttributes* t);

// Inputs codes, scales and (optional) offsets at the given indices: their parameters' element types (float32 or
// float16) and shapes for the attributes' K, N, bits and block_size
OrtStatus* tileInputs(OrtOpDescriptor const& op, TileAttributes const& t, NodeInputs const& x, size_t codes,
    size_t scales, size_t offs, ONNXTensorElementDataType* scaleType, ONNXTensorElementDataType* offType);

} // namespace ortcpu
} // namespace gsm
