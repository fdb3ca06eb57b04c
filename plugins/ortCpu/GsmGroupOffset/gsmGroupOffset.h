/*
 * gsmGroupOffset.h: the math of the ONNX Runtime CPU op GsmGroupOffset (README.md here), on raw pointers.
 * A weight on a float-zero-point grid (builder/qlinear.py: w = s (u - 2^(bits-1)) + offset per group) runs as
 * MatMulNBits on the symmetric part plus a per-group offset term; this op is that term and what follows it:
 *   y[m, n] = main[m, n] + sum_g (sum_{k in group g} x[m, k]) * offsets[g, n]   (+ residual[m, n])
 * It replaces the portable graph's group-sum MatMul, offset Gemm and residual Add (three nodes, each a fixed
 * dispatch cost and none using a second thread at a decode step's one row) with one node on the intra-op pool.
 * With swiglu (gate and up as one projection) it also takes the SwiGLU product, silu(gate) * up, which the
 * portable graph spells as Split, Sigmoid, Mul, Mul (three nodes more after ONNX Runtime's fusions).
 * With a norm weight (a projection whose residual sum the next RMSNorm reads: o_proj before the post-attention norm,
 * down_proj before the next layer's input norm) it also writes that norm of y, normed = y / sqrt(mean(y^2) + eps) * w
 * per row, the node ONNX Runtime would otherwise run after it.
 * The offsets are float32 or float16 (a Q4_1 source's are float16 values: half the bytes a step reads).
 * Values agree with the portable graph to float32 rounding (blocked, FMA-contracted sums, as MLAS's).
 */
#pragma once

#include <cstdint>

#include "../common/gsmParallel.h"

namespace gsm
{
namespace ortcpu
{

struct GroupOffsetArgs
{
    int64_t M = 0, K = 0, N = 0, block = 0;  // rows, inputs, outputs, inputs per group (G = ceil(K / block))
    float const* x = nullptr;                // [M, K] the projection's input
    float const* main = nullptr;             // [M, N] MatMulNBits' output
    void const* offsets = nullptr;           // [G, N] float32, or float16 bits when halfOffsets; null: main is the
                                             // whole projection (GsmQuantMatMul's), the rest applies as written
    bool halfOffsets = false;
    float const* residual = nullptr;         // [M, N] or null
    bool swiglu = false;                     // y = silu(first N/2 columns) * last N/2 (no residual), [M, N/2]
    float* y = nullptr;                      // [M, N], or [M, N/2] with swiglu
    float const* normWeight = nullptr;       // [N] or null (not with swiglu)
    float normEps = 0.f;
    float* normed = nullptr;                 // [M, N] with a norm weight
};

// Computes y (the shapes are the caller's to check); false if the intra-op pool failed.
bool runGroupOffset(GroupOffsetArgs const& a, ParallelRunner const& par);

} // namespace ortcpu
} // namespace gsm
