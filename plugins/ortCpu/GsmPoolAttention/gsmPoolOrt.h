/*
 * gsmPoolOrt.h: the ONNX Runtime side both pool ops share (GsmPoolAttention, GsmPoolSharedAttention): the pool
 * layout's attributes and a PoolSource over the node's buffers.
 */
#pragma once

#include "../common/gsmOrtGlue.h"
#include "gsmPoolRows.h"

namespace gsm
{
namespace ortcpu
{

// The pool's region sizes: attributes rows_fp16, rows_int12, rows_int8, rows_int4 (engine_io section 3).
OrtStatus* poolRowsAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info, int64_t rows[4]);

// The layout of a pool of latent ranks rk, rv over N positions with the attributes' regions.
GsmDims poolLayout(int64_t rk, int64_t rv, int64_t N, int64_t const rows[4]);

// A pool, its slot table, quant table and a row cache of capacity C, from the node's input buffers.
PoolSource poolSource(GsmDims const& g, void* pool, void* slots, void* quant, void* rowCache, void* rowTags, int64_t C);

} // namespace ortcpu
} // namespace gsm
