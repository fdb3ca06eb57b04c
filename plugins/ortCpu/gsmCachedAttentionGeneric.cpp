// The kernels for the build's baseline ISA (NEON on aarch64 / Jetson Orin, SSE2 on x86-64), and the choice.
#define GSM_KNS generic_isa
#define GSM_KNAME genericKernelsImpl
#define GSM_KNAME_STR "generic"
#include "gsmCachedAttentionKernels.inc"

namespace gsm
{
namespace ortcpu
{

Kernels const& genericKernels()
{
    return generic_isa::genericKernelsImpl();
}

Kernels const& cpuKernels()
{
#if defined(__x86_64__) || defined(_M_X64)
    static Kernels const& k = (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                                  && __builtin_cpu_supports("f16c"))
        ? avx2Kernels()
        : genericKernels();
    return k;
#else
    return genericKernels();
#endif
}

} // namespace ortcpu
} // namespace gsm
