"""Decode speed: the portable bundle on ONNX Runtime vs the golden model (deployed mode), same machine.

    python bench/decode_speed.py --checkpoint out/stories-gsm [--tokens 128] [--threads 1]

Builds a bundle of the checkpoint for `--device` into a temp dir (or takes `--bundle`), then runs the
same greedy decode on both after the same prompt and prints tokens/s of each, their ratio, and whether
the greedy tokens agree. A figure for this machine's CPU, not a device figure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def timed_greedy(prefill, decode, prompt: list[int], n: int) -> tuple[list[int], float]:
    logits = prefill(prompt)
    out: list[int] = []
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = decode(tok)
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, help="an existing bundle of that checkpoint (default: build one)")
    ap.add_argument("--device", default="orin")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", default="Once upon a time")
    args = ap.parse_args()

    import torch

    import runtime
    from gsm.golden.model import GoldenModel

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            bundle = Path(tmp) / "bundle"
            subprocess.run([sys.executable, "-m", "builder", "build", "--device", args.device, "--checkpoint",
                            str(args.checkpoint), "--output", str(bundle)], check=True, capture_output=True)
        rt = runtime.load(bundle, backend="onnxruntime", threads=args.threads)
        prompt = rt.encode(args.prompt)
        seq = rt.new_sequence()
        ort_ids, ort_s = timed_greedy(seq.prefill, seq.decode, prompt,
                                      args.tokens)
        gm = GoldenModel.from_checkpoint(args.checkpoint, mode="deployed")
        cache = gm.new_cache()
        with torch.no_grad():
            gold_ids, gold_s = timed_greedy(lambda p: gm.prefill(cache, p).logits[-1].numpy(),
                                            lambda t: gm.decode(cache, t).logits[-1].numpy(), prompt, args.tokens)
    n = args.tokens
    same = next((i for i, (a, b) in enumerate(zip(ort_ids, gold_ids)) if a != b), n)
    print(f"checkpoint {args.checkpoint}  prompt {len(prompt)} tokens  decode {n} tokens  threads {args.threads}")
    print(f"ONNX Runtime (portable bundle): {n / ort_s:8.1f} tokens/s")
    print(f"golden model (deployed, torch): {n / gold_s:8.1f} tokens/s")
    print(f"ratio ORT / golden: {gold_s / ort_s:.2f}x;  identical greedy tokens: {same} of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
