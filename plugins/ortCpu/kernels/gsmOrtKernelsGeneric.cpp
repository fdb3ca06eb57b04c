// The kernels for the build's baseline ISA (NEON on aarch64 / Jetson Orin, SSE2 on x86-64), and the choice.
#include <cstdlib>
#include <cstring>

#define GSM_KNS generic_isa
#define GSM_KNAME genericKernelsImpl
#define GSM_KNAME_STR "generic"
#include "gsmOrtKernels.inc"

namespace gsm
{
namespace ortcpu
{

Kernels const& genericKernels()
{
    return generic_isa::genericKernelsImpl();
}

#if defined(__x86_64__) || defined(_M_X64)
namespace
{
// GSM_ORT_KERNELS=baseline keeps the baseline kernels on an AVX2 CPU, so that an x86 machine can compare the two
// builds of the kernels (scripts/check_ortcpu_aarch64.sh)
bool avx2Allowed()
{
    char const* const v = std::getenv("GSM_ORT_KERNELS");
    return v == nullptr || std::strcmp(v, "baseline") != 0;
}
} // namespace
#endif

Kernels const& cpuKernels()
{
#if defined(__x86_64__) || defined(_M_X64)
    static Kernels const& k = (avx2Allowed() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
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
