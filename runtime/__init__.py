"""Runtime: thin bundle loader (TensorRT on a GPU, ONNX Runtime anywhere). Never imports torch.

    import runtime
    rt = runtime.load("out/demo-tiny-orin-agx-64")          # verifies every file's sha256 first
    print(rt.generate("Once upon a time", max_new_tokens=32).text)
    for tok in rt.stream([1, 415, 1781], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=0):
        print(tok.id, repr(tok.text))
"""

from runtime.bundle import BundleError, verify_bundle
from runtime.model import ContextFullError, Generation, Runtime, Sampler, Token, load

__all__ = ["BundleError", "ContextFullError", "Generation", "Runtime", "Sampler", "Token", "load", "verify_bundle"]
