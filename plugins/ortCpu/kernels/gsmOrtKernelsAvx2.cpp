// The kernels compiled for AVX2 + FMA + F16C (this file only gets -mavx2 -mfma -mf16c; cpuKernels() calls
// them only when the CPU has the three).
#define GSM_KNS avx2_isa
#define GSM_KNAME avx2KernelsImpl
#define GSM_KNAME_STR "avx2+fma+f16c"
#include "gsmOrtKernels.inc"

namespace gsm
{
namespace ortcpu
{

Kernels const& avx2Kernels()
{
    return avx2_isa::avx2KernelsImpl();
}

} // namespace ortcpu
} // namespace gsm
