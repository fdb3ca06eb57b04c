/*
 * gsmSideSplit.h: the math of the ONNX Runtime CPU op GsmSideSplit (README.md here), on raw pointers.
 * An owning layer's GSM-side projection (in_proj: the K and V latents, the indexer's key, query and weights, one
 * row block each) leaves MatMulNBits as one [M, W] tensor; before the attention reads them, the portable graph
 * scales it by its column scale (the latent scales, the INT8 key scale), splits it, rounds the latents to FP16 and
 * back and the key to FP16 or to INT8 codes (Mul, Reshape, Split, Cast x 5, Round, Clip: ten nodes per layer, each
 * a fixed dispatch cost at a decode step's single row). This op is those ten nodes:
 *   v = y[m, c] * scale[c]                     (float32, one rounding, as the graph's Mul)
 *   latent_k, latent_v = float32(float16(v))   (round to nearest even, PortableOps.kv_update)
 *   index_key = float16(v), or INT8 codes clip(rint(v), -127, 127)  (decisions "INT8 indexer keys")
 *   index_q, index_w = v
 * Bit for bit the graph's values (every step is one IEEE rounding).
 */
#pragma once

#include <cstdint>

#include "../common/gsmParallel.h"

namespace gsm
{
namespace ortcpu
{

// the row blocks of y, in order (builder/network.py GSM_SIDE)
enum SideBlock : int
{
    kSideLatentK, kSideLatentV, kSideIndexKey, kSideIndexQ, kSideIndexW, kSideBlocks
};

struct SideSplitArgs
{
    int64_t M = 0, W = 0;              // rows (B*S), columns (the sum of widths)
    int64_t widths[kSideBlocks] = {};  // rk, rv, dI, nI*dI, nI
    float const* y = nullptr;          // [M, W]
    float const* scale = nullptr;      // [W]
    bool int8Keys = false;             // index_key as INT8 codes (else float16 bits)
    float* out[kSideBlocks] = {};      // [M, widths[b]] each; out[kSideIndexKey] unused
    void* keys = nullptr;              // [M, dI] int8 codes or float16 bits
};

// Computes every output (the shapes are the caller's to check); false if the intra-op pool failed.
bool runSideSplit(SideSplitArgs const& a, ParallelRunner const& par);

} // namespace ortcpu
} // namespace gsm
