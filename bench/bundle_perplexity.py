"""Held-out perplexity through built bundles (ONNX Runtime, GSM sparse attention on), one line of JSON each.

    python bench/bundle_perplexity.py B1 [B2 ...] [--text ../shared/data/tinystories_eval.txt] [--windows 4]

Each bundle reads the same `--windows` consecutive windows of `--window` tokens of the text (encoded
once with `Runtime.encode`, the bundle's tokenizer), prefilled as the runtime prefills a prompt, and scores every
next token. Bundles must be built with `--logits all`. With `--max-input WINDOW` a window is one prefill call:
how docs/weights.md compares weight formats through the whole deployed path (SmolLM2: fp32 weights vs INT8 /
INT4 bundles). With a smaller `--max-input` (64) the runtime prefills in chunks of that many tokens, each call
followed by the re-tier pass, so later chunks read rows the KV tiers have demoted: the engines' own KV tiers
measured end to end (docs/quality.md "Protocol", the protocol of bench/kv_frontier.py's `tiers:` rows).

`--genai DIR` scores the same windows through ONNX Runtime GenAI's INT4 model of the same GGUF
(DIR/smollm2-int4/model.onnx, built by ../shared/tools/ort_genai.sh; one session call per window on our
onnxruntime, its own tokenizer.json): the quality at which that speed anchor runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

import runtime

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_eval.txt"


def window_nll(rt: runtime.Runtime, win: list[int]) -> float:
    """Summed negative log-likelihood of win[1:] given its prefix, from the runtime's prefill of the window (in
    chunks of the bundle's max-input, each followed by a re-tier pass)."""
    total = 0.0

    def score(first: int, logits: np.ndarray) -> None:  # logits [n, V] of positions first .. first + n - 1
        nonlocal total
        lg = np.asarray(logits, np.float64)
        lg = lg - lg.max(axis=1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        total -= float(sum(lp[i, win[first + i + 1]] for i in range(lg.shape[0]) if first + i + 1 < len(win)))

    rt.new_sequence().prefill(win, scorer=score)
    return total


def genai_perplexity(model_dir: Path, text: str, windows: int, window: int, threads: int) -> dict:
    """Perplexity of GenAI's model.onnx (inputs input_ids, attention_mask, empty past_key_values.*; output logits
    [1, T, V]) over the text's first `windows` windows, encoded with the folder's tokenizer.json as the bundles
    encode (BOS first when its tokenizer_config.json asks for one)."""
    import onnx
    import onnxruntime as ort
    import tokenizers

    path = model_dir / "smollm2-int4" / "model.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (../shared/tools/ort_genai.sh builds it)")
    tok = tokenizers.Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    tcfg = json.loads((path.parent / "tokenizer_config.json").read_text())
    if tcfg.get("add_bos_token") and tcfg.get("bos_token"):
        ids = [tok.token_to_id(tcfg["bos_token"])] + ids
    if len(ids) < windows * window:
        raise ValueError(f"{len(ids)} tokens of text, fewer than {windows} x {window}")
    dec = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    past = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input
            if i.name.startswith("past_key_values")]
    empty = np.zeros((1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
    nll, count = 0.0, 0
    for w in range(windows):
        win = ids[w * window:(w + 1) * window]
        feeds = {"input_ids": np.array([win], np.int64), "attention_mask": np.ones((1, len(win)), np.int64),
                 **{n: empty for n in past}}
        lg = np.asarray(sess.run(["logits"], feeds)[0][0], np.float64)
        lg = lg - lg.max(axis=1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        nll -= float(lp[np.arange(len(win) - 1), win[1:]].sum())
        count += len(win) - 1
    return {"genai": str(path), "perplexity": math.exp(nll / count), "tokens": count, "window": window,
            "first_ids": ids[:4]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", type=Path, nargs="*")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--genai", type=Path, default=None,
                    help="also score ONNX Runtime GenAI's INT4 model in this folder (../shared/tools/ort_genai.sh)")
    a = ap.parse_args(argv)
    text = a.text.read_text(encoding="utf-8")
    if a.genai is not None:
        print(json.dumps(genai_perplexity(a.genai, text, a.windows, a.window, a.threads)), flush=True)
    for b in a.bundles:
        rt = runtime.load(b, backend="onnxruntime", threads=a.threads)
        if rt.cfg.logits != "all":
            print(f"error: {b}: build it with --logits all (and --max-input {a.window} for one prefill call per "
                  "window)", file=sys.stderr)
            return 2
        ids = rt.encode(text)
        if len(ids) < a.windows * a.window:
            print(f"error: {a.text}: {len(ids)} tokens, fewer than {a.windows} x {a.window}", file=sys.stderr)
            return 2
        nll, count = 0.0, 0
        for w in range(a.windows):
            win = ids[w * a.window:(w + 1) * a.window]
            nll += window_nll(rt, win)
            count += len(win) - 1
        q = rt.cfg.kv_quantization
        plan = json.loads((b / "plan.json").read_text())
        print(json.dumps({"bundle": str(b), "perplexity": math.exp(nll / count), "tokens": count, "first_ids": ids[:4],
                          "window": a.window, "max_input": rt.max_input, "weights": rt.cfg.weights,
                          "tier_fractions": list(q.tier_fractions), "index_key_bits": q.index_key_bits,
                          "kv_bytes_per_position": plan["kv_bytes_per_position"],
                          "vs_dense_fp16": plan["kv_bytes_per_position"] / plan["dense_fp16_bytes_per_position"]}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
