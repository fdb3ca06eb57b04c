/*
 * gsmParallel.h: the intra-op thread pool as the ops' math sees it, with no ONNX Runtime types: the glue hands
 * every op a ParallelRunner over KernelContext_ParallelFor (common/gsmOrtGlue.h), the ISA check harnesses run the
 * same math with none (a plain loop).
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace gsm
{
namespace ortcpu
{

// A parallel-for the caller provides (ONNX Runtime's KernelContext_ParallelFor): calls fn(data, i) for
// every i < total, in any order, on any threads, and returns when all are done; false on failure.
// run == nullptr: a plain loop on the calling thread.
struct ParallelRunner
{
    bool (*run)(void* ctx, void (*fn)(void*, size_t), size_t total, void* data) = nullptr;
    void* ctx = nullptr;
};

template <class F>
void parallelTrampoline(void* data, size_t i)
{
    (*static_cast<F*>(data))(static_cast<int64_t>(i));
}

inline bool runSerially(void*, void (*fn)(void*, size_t), size_t total, void* data)
{
    for (size_t i = 0; i < total; ++i)
    {
        fn(data, i);
    }
    return true;
}

// f(i) for every i < total through `par`; a single item (or no runner) stays on the calling thread, where a
// hand-off would only add the pool's wake-up.
template <class F>
bool parallelFor(ParallelRunner const& par, int64_t total, F&& f)
{
    if (total <= 0)
    {
        return true;
    }
    using Fn = std::remove_reference_t<F>;
    if (total == 1 || par.run == nullptr)
    {
        return runSerially(nullptr, &parallelTrampoline<Fn>, static_cast<size_t>(total), &f);
    }
    return par.run(par.ctx, &parallelTrampoline<Fn>, static_cast<size_t>(total), &f);
}

} // namespace ortcpu
} // namespace gsm
