"""Runtime: thin bundle loader (TensorRT on a GPU, ONNX Runtime anywhere). Never imports torch.

    import runtime
    rt = runtime.load("out/demo-tiny-orin-agx-64")          # verifies every file's sha256 first
    print(rt.generate("Once upon a time", max_new_tokens=32).text)
    s = rt.stream([1, 415, 1781], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=0)
    for tok in s:                                             # one request: its own state
        print(tok.id, repr(tok.text))
    print(s.finish_reason, s.text)
    print(rt.chat([{"role": "user", "content": "Hi"}]).text)  # bundles with a chat template
    gens = rt.generate_batch(["Once upon", "The dog"], 16)   # one backend call per step, max_batch at a time
    print(rt.capabilities.max_resident)                       # sequences alive at once: the plan's max_batch
    a, b = rt.new_sequence(), rt.new_sequence()               # the step API a scheduler drives (max_batch >= 2)
    logits = rt.prefill_batch([a, b], [[1, 415], [1, 9, 33, 7]]); logits = rt.decode_batch([a, b], [5, 6])
"""

from runtime.backend import CacheFullError, Capabilities
from runtime.bundle import BundleError, verify_bundle
from runtime.facade import Runtime
from runtime.loader import load
from runtime.request import TokenStream
from runtime.request_options import RequestOptions
from runtime.request_state import Generation, RequestState, Token
from runtime.sampling import RequestError, Sampler, SamplingParams
from runtime.step_worker import ContextFullError
from runtime.text import ChatTemplateError

__all__ = ["BundleError", "CacheFullError", "Capabilities", "ChatTemplateError", "ContextFullError", "Generation",
           "RequestError", "RequestOptions", "RequestState", "Runtime", "Sampler", "SamplingParams", "Token",
           "TokenStream", "load", "verify_bundle"]
