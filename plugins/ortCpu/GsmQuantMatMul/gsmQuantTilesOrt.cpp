// Attributes and inputs of a tiled weight (gsmQuantTilesOrt.h).
#include "gsmQuantTilesOrt.h"

#include <utility>

#include "gsmQuantMatMul.h"

namespace gsm
{
namespace ortcpu
{

OrtStatus* tileAttributes(OrtOpDescriptor const& op, OrtKernelInfo const* info, TileAttributes* t)
{
    for (auto [name, dst] : {std::pair<char const*, int64_t*>{"K", &t->K}, {"N", &t->N}, {"bits", &t->bits},
             {"block_size", &t->block}})
    {
        GSM_ORT_TRY(intAttribute(op, info, name, dst));
        if (*dst <= 0)
        {
            return invalidArgument(op, std::string("attribute ") + name + " = " + std::to_string(*dst) + " must be positive");
        }
    }
    if (t->bits != 4 && t->bits != 8)
    {
        return invalidArgument(op, "attribute bits = " + std::to_string(t->bits) + " must be 4 or 8");
    }
    if (t->block % kQSubBlock != 0)
    {
        return invalidArgument(op, "attribute block_size = " + std::to_string(t->block) + " must be a multiple of 32");
    }
    return nullptr;
}

OrtStatus* tileInputs(OrtOpDescriptor const& op, TileAttributes const& t, NodeInputs const& x, size_t codes,
    size_t scales, size_t offs, ONNXTensorElementDataType* scaleType, ONNXTensorElementDataType* offType)
{
    std::vector<int64_t> const* sh = x.shape;
    *scaleType = *offType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    GSM_ORT_TRY(elementType(x.value[scales], scaleType));
    bool const offsets = x.has(offs);
    if (offsets)
    {
        GSM_ORT_TRY(elementType(x.value[offs], offType));
    }
    for (auto type : {*scaleType, offsets ? *offType : *scaleType})
    {
        if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
        {
            return invalidArgument(op, "inputs scales and offsets must be float32 or float16");
        }
    }
    int64_t const G = (t.K + t.block - 1) / t.block, NT = (t.N + kQTileRows - 1) / kQTileRows;
    std::vector<int64_t> const codesWant{NT, G * t.block / kQSubBlock, quantSubBlockBytes(t.bits)};
    std::vector<int64_t> const paramWant{NT, G, kQTileRows};
    if (sh[codes] != codesWant || sh[scales] != paramWant || (offsets && sh[offs] != paramWant))
    {
        return invalidArgument(op, "inputs codes " + dimsText(sh[codes]) + ", scales " + dimsText(sh[scales])
            + (offsets ? ", offsets " + dimsText(sh[offs]) : std::string()) + ": expected " + dimsText(codesWant)
            + " and " + dimsText(paramWant) + " (K = " + std::to_string(t.K) + ", N = " + std::to_string(t.N)
            + ", bits = " + std::to_string(t.bits) + ", block_size = " + std::to_string(t.block)
            + ": tiles of 16 rows, sub-blocks of 32 inputs)");
    }
    return nullptr;
}

} // namespace ortcpu
} // namespace gsm
