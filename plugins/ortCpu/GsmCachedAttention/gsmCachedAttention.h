/*
 * gsmCachedAttention.h: the math of the ONNX Runtime CPU op GsmCachedAttention (op_spec: README.md here),
 * on raw pointers, with no ONNX Runtime types. One call is one owning GSM layer's attention for a batch:
 * index scores, sink + window + top-k selection, RoPE, softmax attention over the selected K rows, the V
 * sum, attention mass, and the call's new K rows. The V sum reads cached V rows (U_v c, made once per row: the
 * call's new ones are an output) where the caller keeps them; else the held latents (decode: float64 latent sum,
 * then U_v; prefill: V rebuilt once per distinct row). It replaces the standard-op subgraph of
 * builder/graph_portable.py (PortableOps.attention), which is the normative definition.
 *
 * Not the plugins' bit-exact numerics contract: sums are blocked and FMA-contracted (like ONNX Runtime's
 * MLAS), so values agree with the portable graph to float32 rounding; the selection is the same.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../GsmPoolAttention/gsmPoolRows.h"
#include "../common/gsmParallel.h"

namespace gsm
{
namespace ortcpu
{

struct CachedAttentionDims
{
    int64_t B = 0, S = 0;                 // batch, new rows per sequence
    int64_t nH = 0, nKV = 0, D = 0;       // query heads, key heads, head dim (even, nH % nKV == 0)
    int64_t nI = 0, dI = 0;               // indexer heads and dim
    int64_t rk = 0, rv = 0;               // latent ranks
    int64_t R = 0, N = 0;                 // cache rows, positions per row (N_max)
    int64_t sinks = 0;                    // sink_tokens attribute
    int64_t topKDivisor = 0;              // sparse_top_k_divisor attribute (0: a fixed top-k; see queryTopK)
};

struct CachedAttentionInputs
{
    float const* q = nullptr;              // [B,S,nH*D]
    float const* indexQ = nullptr;         // [B,S,nI*dI]
    float const* indexW = nullptr;         // [B,S,nI]
    float const* newLatentK = nullptr;     // [B,S,rk]
    float const* newLatentV = nullptr;     // [B,S,rv]
    void const* newIndexKeys = nullptr;    // [B,S,dI] float16 bits, or int8 codes when int8Keys
    float const* latentV = nullptr;        // [R,N,rv]; unused when vRows is given
    float const* vRows = nullptr;          // [R,N,nKV*D]: the V rows U_v c of the held latents, or null (V from latentV)
    void const* indexKeys = nullptr;       // [R,N,dI] as newIndexKeys
    bool int8Keys = false;                 // INT8 key codes (index_q scaled by their scale already)
    float const* kRows = nullptr;          // [R,N,nKV*D]
    void const* kUp = nullptr;             // [nKV*D,rk] float32, or float16 bits when halfUp
    void const* vUp = nullptr;             // [nKV*D,rv] as kUp
    bool halfUp = false;                   // U_k and U_v as float16 (a checkpoint whose U lie on the FP16 grid)
    float const* ropeCos = nullptr;        // [N,D]
    float const* ropeSin = nullptr;        // [N,D]
    int32_t const* cacheRows = nullptr;    // [B]
    int32_t const* pastLengths = nullptr;  // [B]
    int32_t const* newLengths = nullptr;   // [B]
    int32_t window = 0;                    // sparse_window[0]
    int32_t const* topK = nullptr;         // [B]
    int64_t keyStride = 0;                 // elements from one position's key to the next in indexKeys (0: dI)
    PoolSource const* pool = nullptr;      // GsmPoolAttention: the cache is the plugins' pools (../GsmPoolAttention/gsmPoolRows.h);
                                           // latentV, vRows and kRows are then unused and newKRows is scratch
    int32_t const* massRows = nullptr;     // [B,J]: rows (0..S-1) whose query's own mass queryMass gets, or null
    int64_t J = 0;
};

struct CachedAttentionOutputs
{
    float* attnOut = nullptr;   // [B,S,nH*D]
    float* newKRows = nullptr;  // [B,S,nKV*D]
    float* newVRows = nullptr;  // [B,S,nKV*D], written when in.vRows is given
    int32_t* selected = nullptr;// [B,S,k]
    float* attnMass = nullptr;  // [B,L]
    float* queryMass = nullptr; // [B,J,L]: the attention mass of query massRows[b,i] alone (0 for a padding row)
};

// Top-k of sequence b's query at absolute position t: top_k[b], grown to (t + 1) / topKDivisor when the node
// has a divisor (a budget that follows the context). Everything that reads a query's budget goes through this.
int64_t queryTopK(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t b, int64_t t);

// Checks the run-time values (lengths, rows, budgets; the shapes are the caller's) and gives the output
// widths: k = min(max over the queries (b, t) of sinks + window + queryTopK(b, t), Tc + S) and L = Tc + S,
// Tc = max_b past[b]. Every one of the S rows of a sequence is a query (padding rows too), and the budget
// grows with t, so the last row of each sequence, t = past[b] + S - 1, has its largest.
// Returns false with a message naming the input.
bool prepareCachedAttention(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t* k,
    int64_t* L, std::string* error);

// Computes every output (call prepareCachedAttention first; k and L are its widths).
bool runCachedAttention(CachedAttentionDims const& d, CachedAttentionInputs const& in, int64_t k, int64_t L,
    CachedAttentionOutputs const& out, ParallelRunner const& par, std::string* error);

} // namespace ortcpu
} // namespace gsm
