"""Held-out perplexity of a dense GGUF model with weight-only quantised projections (issue 11).

    OMP_NUM_THREADS=1 python bench/weight_quant_quality.py [--gguf ../shared/data/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--windows 8] [--window 512] [--settings fp32,fp16,int8,rtn4-g128,awq4-g128,...] [--json out.json]
    ... --settings fp32,tied:int8-g64,tied:rtn4-g32,head:rtn4-g32,embed:rtn4-g32,head:rtn4f-g32,tied:gptq4f-g32

The projections q, k, v, o, gate, up, down are quantised and dequantised (builder/wquant.py, the
numbers the ONNX graphs compute with); embeddings, norms and the tied head stay float32. A setting
prefixed `tied:`, `head:` or `embed:` quantises the embedding matrix instead (the projections float32):
both its uses, only the LM head's logits, or only the embedding lookup (RTN, or `gptq4f`: GPTQ on the asym-f
grid, builder/gptq.py, with the head inputs' moment over the calibration windows; no AWQ). AWQ scales
(calibration/awq.py) and the GPTQ moment come from tinystories_calib.txt; perplexity is measured on
tinystories_eval.txt only: contiguous windows of `--window` tokens, no BOS (SmolLM2's
add_bos_token is false), exp(mean next-token NLL) over all windows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from builder.gptq import gptq_factor, gptq_quantize
from builder.wquant import WeightQuantConfig, fake_quantize, quantize_chunks
from calibration.awq import GROUP_OF, awq_model_scales, collect_inputs, quantized_dense_weights
from gsm import names
from gsm.dense import DenseLlama
from gsm.sources.gguf import read_gguf
from gsm.tokenizer import tokenizer_from_json

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_SETTINGS = ("fp32,fp16,int8,int8-g32,rtn4f-g32,rtn4-g32,rtn4-g64,rtn4-g128,rtn4a-g128,"
                    "awq4-g32,awq4-g64,awq4-g128")


def parse_setting(s: str) -> tuple[WeightQuantConfig | None, bool, str]:
    """'fp32' | 'fp16' | 'int8' (per channel) | 'int8-g128' (INT8 per group of 128 inputs) | 'rtn4-g128' |
    'rtn4a-g128' (asymmetric, integer zero point) | 'rtn4f-g32' (asymmetric min/max grid, float zero point:
    `--int4-grid asym-f`) | 'awq4-g64' -> (cfg, awq, name)."""
    if s in ("fp32", "fp16"):
        return None, False, s
    if s == "int8":
        return WeightQuantConfig(8, None), False, s
    if s.startswith("int8-g"):
        return WeightQuantConfig(8, int(s.removeprefix("int8-g"))), False, s
    kind, g = s.split("-g")
    if kind == "gptq4f":  # the embedding settings only (see main)
        return WeightQuantConfig(4, int(g), symmetric=False, float_zero_point=True), False, s
    awq = kind.startswith("awq")
    if kind.endswith("f"):
        return WeightQuantConfig(4, int(g), symmetric=False, float_zero_point=True), awq, s
    return WeightQuantConfig(4, int(g), symmetric=not kind.endswith("a")), awq, s


HEAD_USES = {"tied": ("embed", "head"), "head": ("head",), "embed": ("embed",)}


def split_use(s: str) -> tuple[tuple[str, ...], str]:
    """'head:rtn4-g32' -> (("head",), 'rtn4-g32'); a setting without a prefix -> ((), s)."""
    use, sep, rest = s.partition(":")
    if not sep:
        return (), s
    if use not in HEAD_USES:
        raise SystemExit(f"error: --settings {s!r}: the prefix must be one of {', '.join(HEAD_USES)}")
    return HEAD_USES[use], rest


def windows(tok, path: Path, n: int, length: int) -> list[torch.Tensor]:
    ids = tok.encode(path.read_text()).ids
    if len(ids) < n * length:
        raise SystemExit(f"error: {path} has {len(ids)} tokens, fewer than {n} windows of {length}")
    return [torch.tensor(ids[i * length:(i + 1) * length]) for i in range(n)]


def head_input_moment(model: DenseLlama, wins: list[torch.Tensor]) -> np.ndarray:
    """Mean x x^T [H, H] of the LM head's input (the final normed hidden state) over every position of `wins`."""
    gram, rows = torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=torch.float64), 0
    linear = torch.nn.functional.linear

    def tap(x, w, b=None):
        nonlocal gram, rows
        if w is model.lm_head:
            x2 = x.reshape(-1, x.shape[-1]).double()
            gram, rows = gram + x2.T @ x2, rows + x2.shape[0]
        return linear(x, w, b)

    torch.nn.functional.linear = tap
    try:
        for w in wins:
            model.nll(w)
    finally:
        torch.nn.functional.linear = linear
    return (gram / rows).numpy()


def gptq_dequantized(w: np.ndarray, cfg: WeightQuantConfig, moment: np.ndarray) -> np.ndarray:
    """W quantised by GPTQ on `moment` (builder/gptq.py), as the graphs compute with it: signed codes x scale plus
    the group offset."""
    q = quantize_chunks(w.shape, iter([w.reshape(-1)]), cfg,
                        quantize_rows=functools.partial(gptq_quantize, factor=gptq_factor(moment)))
    sig = q.signed_codes().astype(np.float32).reshape(q.n, q.n_blocks, q.block)
    return (sig * q.scales[..., None] + q.group_offsets()[..., None]).reshape(q.n, -1)[:, : q.k]


def perplexity(model: DenseLlama, wins: list[torch.Tensor]) -> float:
    nll = [model.nll(w) for w in wins]  # equal lengths: the mean of means is the mean over tokens
    return math.exp(sum(nll) / len(nll))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=DATA / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-sequences", type=int, default=16)
    ap.add_argument("--calib-rows", type=int, default=32, help="activation rows sampled per calibration sequence")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    src = read_gguf(a.gguf)
    model = DenseLlama(src)
    tok = tokenizer_from_json(src.tokenizer_json)
    evals = windows(tok, DATA / "tinystories_eval.txt", a.windows, a.window)
    calib = windows(tok, DATA / "tinystories_calib.txt", a.calib_sequences, a.window)
    original = {n: model.w[n] for k in GROUP_OF for n in [names.layer_name(k, i)
                                                             for i in range(model.config.num_hidden_layers)]}
    stats = moment = None
    rows = []
    embed = model.w[names.EMBED]
    for s in a.settings.split(","):
        uses, rest = split_use(s)
        cfg, awq, name = parse_setting(rest)
        t0 = time.perf_counter()
        extra = {}
        if uses:
            if not model.config.tie_word_embeddings:
                raise SystemExit(f"error: --settings {s!r}: {a.gguf.name} has no tied embedding / LM head")
            if awq or cfg is None:
                raise SystemExit(f"error: --settings {s!r}: the embedding takes an RTN setting (int8-gN, rtn4-gN, ...)")
            if rest.startswith("gptq"):
                if moment is None:
                    moment = head_input_moment(model, calib)
                q = torch.from_numpy(gptq_dequantized(embed.numpy(), cfg, moment))
            else:
                q = torch.from_numpy(fake_quantize(embed.numpy(), cfg, name=names.EMBED).astype(np.float32))
            model.w[names.EMBED] = q if "embed" in uses else embed
            model.lm_head = q if "head" in uses else embed
            ppl = perplexity(model, evals)
            model.w[names.EMBED] = model.lm_head = embed
            rows.append({"setting": s, "perplexity": ppl, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if name.startswith("gptq"):
            raise SystemExit(f"error: --settings {s!r}: GPTQ here is for the embedding matrix (tied:, head:, embed:)")
        if name == "fp32":
            new = original
        elif name == "fp16":
            new = {n: w.half().float() for n, w in original.items()}
        else:
            scales = None
            if awq:
                if stats is None:
                    stats = collect_inputs(model, calib, rows_per_sequence=a.calib_rows)
                scales = awq_model_scales(model, stats, cfg)
                alphas = [r.alpha for r in scales.values()]
                gain = [r.error / r.error_rtn for r in scales.values() if r.error_rtn > 0]
                extra = {"alpha_mean": float(np.mean(alphas)), "search_error_vs_rtn_mean": float(np.mean(gain))}
            new = quantized_dense_weights(model, cfg, scales)
        model.w.update(new)
        ppl = perplexity(model, evals)
        model.w.update(original)
        rows.append({"setting": name, "perplexity": ppl, "seconds": round(time.perf_counter() - t0, 1), **extra})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["perplexity"] for r in rows if r["setting"] == "fp16"), rows[0]["perplexity"])
    print(f"\n{a.gguf.name}: {a.windows} windows x {a.window} tokens of tinystories_eval.txt, no BOS")
    print(f"{'setting':<18} {'ppl':>9} {'vs fp16':>9}")
    for r in rows:
        print(f"{r['setting']:<18} {r['perplexity']:9.4f} {r['perplexity'] / base - 1:+9.2%}")
    if a.json:
        a.json.write_text(json.dumps({"windows": a.windows, "window": a.window, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
