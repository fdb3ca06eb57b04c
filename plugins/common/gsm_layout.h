/*
 * gsm_layout.h: shapes, attributes and the latent pool layout of docs/engine_io.md (sections 3, 4).
 *
 * Shared by the CPU reference, the CUDA kernels and the TensorRT wrappers, so the byte layout of
 * a pool row and the slot-table encoding exist in one place only.
 */
#pragma once

#include "gsm_math.h"

#include <cstdint>

namespace gsm
{

// Attributes of the GSM nodes (docs/engine_io.md 4.1-4.3). Plain C layout: the Python binding
// mirrors it with ctypes.Structure, field for field.
struct GsmDims
{
    int32_t layerKind;       // 0 owning, 1 sharing (GsmSparseAttention only)
    int32_t numHeads;        // nH
    int32_t numKvHeads;      // nKV
    int32_t headDim;         // D
    int32_t rankK;           // r_k (sharing: of the source)
    int32_t rankV;           // r_v
    int32_t indexHeads;      // nI
    int32_t indexDim;        // dI
    int32_t sinkTokens;      // spec 2 sink_tokens
    int32_t maxTopK;         // the largest per-sequence sparse_top_k a call may use (fixes K_sel)
    int32_t maxSparseWindow; // spec 2 max_sparse_window (fixes K_sel)
    int32_t nMax;            // N_max
    int32_t rowsFP16;        // C16
    int32_t rowsINT12;       // C12
    int32_t rowsINT8;        // C8
    int32_t rowsINT4;        // C4 (0: no INT4 region)
    int32_t indexKeyBits;    // 8: INT8 indexer-key codes; 16 (or 0, a node without the attribute): FP16 keys
    int32_t sparseTopKDivisor; // > 0: a query's top-k grows to (t + 1) / this (queryTopK); 0: a fixed top-k
};

// Where call entry b's cache lives in the [R, ...] pools and indexer keys: the `cache_rows` input [B], each
// sequence keeps its row while other sequences come and go. A direct caller of the reference without rows
// (rows == nullptr) has one pool row per call entry: row base + b.
struct CacheRows
{
    int32_t const* rows; // [B] or nullptr
    int32_t count;       // R: rows of the pools; an entry outside 0..R-1 is refused (CPU) or writes nothing (CUDA)
    int32_t base;        // first call entry's row when rows == nullptr (a launch over sequences b0.. passes b0)

    GSM_HD int32_t of(int32_t b) const
    {
        return rows ? rows[b] : base + b;
    }

    GSM_HD bool valid(int32_t b) const
    {
        int32_t const r = of(b);
        return r >= 0 && r < count;
    }

    // The same mapping for the call entries from b0 on (a launch that sees sequence b0 as b = 0).
    GSM_HD CacheRows from(int32_t b0) const
    {
        return rows ? CacheRows{rows + b0, count, 0} : CacheRows{nullptr, count, base + b0};
    }
};

// cache_rows [B] into pools of poolRows rows; nullptr (a node without the input): entry b in row b of B.
GSM_HD CacheRows cacheRowsOf(int32_t const* rows, int32_t poolRows, int32_t B)
{
    return rows ? CacheRows{rows, poolRows, 0} : CacheRows{nullptr, B, 0};
}

constexpr int32_t kSlotEmpty = -1;
constexpr int32_t kSlotTierShift = 24;
constexpr int32_t kSlotRowMask = 0xFFFFFF;

GSM_HD int32_t slotTier(int32_t entry)
{
    return entry >> kSlotTierShift;
}

GSM_HD int32_t slotRow(int32_t entry)
{
    return entry & kSlotRowMask;
}

GSM_HD int32_t makeSlot(int32_t tier, int32_t row)
{
    return (tier << kSlotTierShift) | row;
}

GSM_HD int32_t kvDim(GsmDims const& d)
{
    return d.numKvHeads * d.headDim;
}

GSM_HD int32_t latentRank(GsmDims const& d)
{
    return d.rankK + d.rankV;
}

// K_sel: the most positions one query can select (sparse: exactly sinks + window + top_k[b] <= this;
// dense: t + 1 <= that budget).
GSM_HD int32_t maxSelected(GsmDims const& d)
{
    return d.sinkTokens + d.maxSparseWindow + d.maxTopK;
}

// Top-k of the query at absolute position t whose sequence's budget is seqTopK (spec 4.1; sparse_top_k_divisor
// > 0: max(seqTopK, (t + 1) / divisor), a budget that grows with the context). Clamped to [0, max_top_k]: the
// build sizes max_top_k for the growth at n_max, and a kernel must never select more than K_sel whatever it is
// handed.
GSM_HD int32_t queryTopK(GsmDims const& d, int32_t seqTopK, int32_t t)
{
    int32_t k = seqTopK;
    if (d.sparseTopKDivisor > 0)
    {
        int32_t const grown = static_cast<int32_t>((static_cast<int64_t>(t) + 1) / d.sparseTopKDivisor);
        k = grown > k ? grown : k;
    }
    k = k < 0 ? 0 : k;
    return k > d.maxTopK ? d.maxTopK : k;
}

// Bytes of one row of each region. A wider region must hold any narrower tier's row, and with
// tiny odd ranks the padded INT12 row (3*ceil(r_k/2) + 3*ceil(r_v/2)) exceeds 2r (r < 6), hence
// the max.
GSM_HD int64_t rowBytesINT12(GsmDims const& d)
{
    return packedINT12Bytes(d.rankK) + packedINT12Bytes(d.rankV);
}

GSM_HD int64_t rowBytesFP16(GsmDims const& d)
{
    int64_t const fp16 = 2 * static_cast<int64_t>(latentRank(d));
    return fp16 > rowBytesINT12(d) ? fp16 : rowBytesINT12(d);
}

GSM_HD int64_t rowBytesINT8(GsmDims const& d)
{
    return latentRank(d);
}

// ceil(r_k/2) + ceil(r_v/2) <= r = W8, so an INT8 row always holds an INT4 row.
GSM_HD int64_t rowBytesINT4(GsmDims const& d)
{
    return packedINT4Bytes(d.rankK) + packedINT4Bytes(d.rankV);
}

// Rows of all four regions: the global rows a slot entry may name.
GSM_HD int64_t regionRows(GsmDims const& d)
{
    return static_cast<int64_t>(d.rowsFP16) + d.rowsINT12 + d.rowsINT8 + d.rowsINT4;
}

GSM_HD int64_t poolBytes(GsmDims const& d)
{
    return d.rowsFP16 * rowBytesFP16(d) + d.rowsINT12 * rowBytesINT12(d) + d.rowsINT8 * rowBytesINT8(d)
        + d.rowsINT4 * rowBytesINT4(d);
}

// Pool of one sequence in int32 words (the graph tensor's last dimension).
GSM_HD int64_t poolWords(GsmDims const& d)
{
    return (poolBytes(d) + 3) / 4;
}

// Indexer keys: FP16 values, or INT8 codes (index_key_bits 8) packed four to an int32 word,
// so one position's key is indexKeyBytes(d) bytes at indexKeyOffset(d, row, p) of `index_keys` [R, N_max, ...].
GSM_HD bool int8Keys(GsmDims const& d)
{
    return d.indexKeyBits == 8;
}

GSM_HD int64_t indexKeyBytes(GsmDims const& d)
{
    return int8Keys(d) ? 4 * ((static_cast<int64_t>(d.indexDim) + 3) / 4) : 2 * static_cast<int64_t>(d.indexDim);
}

GSM_HD int64_t indexKeyOffset(GsmDims const& d, int32_t row, int32_t p)
{
    return (static_cast<int64_t>(row) * d.nMax + p) * indexKeyBytes(d);
}

// The INT8 code of a key the graph already coded (clip(round(e / s), -127, 127), integers in float32): rint and
// the clamp keep any other value in range, as a store must.
GSM_HD int8_t keyCode(float x)
{
    return static_cast<int8_t>(quantize(x, 1.0f, 127));
}

// Narrowest tier a row of region containing global row g can hold (0 FP16 region, ...).
GSM_HD int32_t regionOf(GsmDims const& d, int32_t g)
{
    int64_t const end12 = static_cast<int64_t>(d.rowsFP16) + d.rowsINT12;
    return g < d.rowsFP16 ? kTierFP16 : (g < end12 ? kTierINT12 : (g < end12 + d.rowsINT8 ? kTierINT8 : kTierINT4));
}

GSM_HD int64_t rowOffset(GsmDims const& d, int32_t g)
{
    if (g < d.rowsFP16)
    {
        return g * rowBytesFP16(d);
    }
    int64_t const base12 = d.rowsFP16 * rowBytesFP16(d);
    int64_t const first8 = static_cast<int64_t>(d.rowsFP16) + d.rowsINT12;
    if (g < first8)
    {
        return base12 + (g - d.rowsFP16) * rowBytesINT12(d);
    }
    int64_t const base8 = base12 + d.rowsINT12 * rowBytesINT12(d);
    if (g < first8 + d.rowsINT8)
    {
        return base8 + (g - first8) * rowBytesINT8(d);
    }
    return base8 + d.rowsINT8 * rowBytesINT8(d) + (g - first8 - d.rowsINT8) * rowBytesINT4(d);
}

// A slot entry is well formed when its row exists and its region is wide enough for its tier.
GSM_HD bool slotValid(GsmDims const& d, int32_t entry)
{
    if (entry < 0)
    {
        return false;
    }
    int32_t const tier = slotTier(entry);
    int32_t const g = slotRow(entry);
    return tier >= kTierFP16 && tier <= kTierINT4 && g < regionRows(d) && regionOf(d, g) <= tier;
}

// Quant table of a layer: float32 [5, r]: rows s12, s8, comp8, s4, comp4; columns k channels then v channels.
// Rows 3 and 4 are read for INT4 rows only, so the [3, r] table of a graph without INT4 rows reads the same.
struct QuantView
{
    float const* table;
    int32_t r;
    GSM_HD float s12(int32_t c) const
    {
        return table[c];
    }
    GSM_HD float s8(int32_t c) const
    {
        return table[r + c];
    }
    GSM_HD float comp8(int32_t c) const
    {
        return table[2 * r + c];
    }
    GSM_HD float s4(int32_t c) const
    {
        return table[3 * r + c];
    }
    GSM_HD float comp4(int32_t c) const
    {
        return table[4 * r + c];
    }
};

// Dequantised latent value c (0..r-1: k channels then v channels) of a row encoded with `tier`.
GSM_HD float loadLatent(GsmDims const& d, uint8_t const* row, int32_t tier, QuantView const& qv, int32_t c)
{
    if (tier == kTierFP16)
    {
        uint16_t h = static_cast<uint16_t>(row[2 * c]) | (static_cast<uint16_t>(row[2 * c + 1]) << 8);
        return f16BitsToF32(h);
    }
    if (tier == kTierINT12)
    {
        int32_t const q = c < d.rankK ? unpackINT12(row, c) : unpackINT12(row + packedINT12Bytes(d.rankK), c - d.rankK);
        return dequantINT12(q, qv.s12(c));
    }
    if (tier == kTierINT8)
    {
        int32_t const q = static_cast<int8_t>(row[c]);
        return dequantINT8(q, qv.s8(c), qv.comp8(c));
    }
    int32_t const q = c < d.rankK ? unpackINT4(row, c) : unpackINT4(row + packedINT4Bytes(d.rankK), c - d.rankK);
    return dequantINT4(q, qv.s4(c), qv.comp4(c));
}

// Store one value of a row in `tier` (INT12 and INT4 values come in pairs: see int12PairPtr, int4PairPtr).
GSM_HD void storeFP16(uint8_t* row, int32_t c, float v)
{
    uint16_t const h = f32ToF16Bits(v);
    row[2 * c] = static_cast<uint8_t>(h & 0xFFu);
    row[2 * c + 1] = static_cast<uint8_t>(h >> 8);
}

// Pair p of the k part (part 0) or v part (part 1): codes of channels 2p and 2p + 1 of that part.
GSM_HD uint8_t* int12PairPtr(GsmDims const& d, uint8_t* row, int32_t part, int32_t p)
{
    return row + (part ? packedINT12Bytes(d.rankK) : 0) + 3 * p;
}

// Byte of pair p of the k part (part 0) or v part (part 1) of an INT4 row: channels 2p and 2p + 1 of that part.
GSM_HD uint8_t* int4PairPtr(GsmDims const& d, uint8_t* row, int32_t part, int32_t p)
{
    return row + (part ? packedINT4Bytes(d.rankK) : 0) + p;
}

} // namespace gsm
