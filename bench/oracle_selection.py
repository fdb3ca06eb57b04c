"""How far a selection of a few rows can go at all: the dense model with each layer's attention restricted to
sinks + window + the rows its own dense attention weighs most (an oracle no indexer can beat), chosen once per
layer for all heads (`shared`, what GSM's format holds today), per KV group (`group`) or per query head (`head`).

    python bench/oracle_selection.py --dense ../shared/data/SmolLM2-135M-Instruct.Q4_1.gguf \
        --tokenizer CK/tokenizer.json --eval-text ../shared/data/tinystories_eval.txt --length 8192 --sequences 2 \
        [--modes dense,shared,group,head] [--floor 512] [--divisor 16]

Rows per query at position t: R(t) = min(t + 1, max(floor, (t + 1) // divisor)), sinks and window included (the
issue's budget: 1/16 of dense at 8K with floor 512). The oracle of layer i scores rows by the softmax of that layer's
queries over every causal row (the mean over heads for `shared`, over a group's heads for `group`), given the
hidden states the restricted layers below produced; the selected rows' logits are then softmaxed alone, as GSM
attends over Sel(t). Held-out windows are bench/quality_real.py's (paragraphs of the evaluation text, BOS first).
Perplexity per model over the windows and by position bucket; each window is a chunked prefill of `--chunk` queries
at a time (gsm.convert.quality.token_nll), so memory holds [heads, chunk, T] scores, never [heads, T, T].
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from quality_real import eval_stream, windows  # noqa: E402

from gsm.convert.quality import token_nll  # noqa: E402
from gsm.dense import DenseLlama  # noqa: E402

MODES = ("dense", "shared", "group", "head")
BUCKETS = ((0, 1024), (1024, 2048), (2048, 4096), (4096, 8192))


def row_budget(pos: torch.Tensor, floor: int, divisor: int) -> torch.Tensor:
    """Rows a query at each position reads: min(t + 1, max(floor, (t + 1) // divisor)) (divisor 0: floor)."""
    grown = (pos + 1) // divisor if divisor else torch.zeros_like(pos)
    return torch.minimum(pos + 1, torch.clamp(grown, min=floor))


def oracle_mask(probs: torch.Tensor, pos: torch.Tensor, mode: str, group: int, budget: torch.Tensor, sinks: int,
                window: int) -> torch.Tensor:
    """Which rows each head of each query reads: probs [nH, Tq, S] (dense, causal), pos [Tq] the queries'
    positions, budget [Tq] rows per query -> bool [nH, Tq, S]. Sinks and the last `window` positions first, then
    the rows of the highest score (the heads' mean for `shared`, each group's mean for `group`, each head's own
    for `head`); a selection never reaches past the query."""
    nH, _, S = probs.shape
    cols = torch.arange(S)[None, :]
    causal = cols <= pos[:, None]
    forced = causal & ((cols < sinks) | (cols > pos[:, None] - window))
    score = {"shared": lambda: probs.mean(0, keepdim=True),
             "group": lambda: probs.view(nH // group, group, *probs.shape[1:]).mean(1),
             "head": lambda: probs}[mode]()
    score = score.masked_fill(forced[None], 2.0).masked_fill(~causal[None], -1.0)  # forced first, future last
    idx = score.topk(min(int(budget.max()), S), dim=-1).indices  # [g, Tq, k] by descending score
    keep = (torch.arange(idx.shape[-1])[None, None, :] < budget[None, :, None]).expand(idx.shape)
    sel = torch.zeros(score.shape, dtype=torch.bool).scatter_(-1, idx, keep) & causal[None]
    return sel.expand(nH, -1, -1) if mode == "shared" else sel.repeat_interleave(nH // sel.shape[0], 0)


class OracleModel(DenseLlama):
    """DenseLlama (its weights, not a copy) whose attention reads only the rows `oracle_mask` selects (mode `dense`:
    every causal row). Score it a chunk of queries at a time (gsm.convert.quality.token_nll), so the oracle's dense
    probabilities are [heads, chunk, T], never [heads, T, T]."""

    def __init__(self, dense: DenseLlama, mode: str, *, floor: int, divisor: int, sinks: int, window: int) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        vars(self).update(vars(dense))  # config, origin, the weight tensors themselves
        self.mode, self.floor, self.divisor, self.sinks, self.window = mode, floor, divisor, sinks, window

    def attention_probs(self, scores: torch.Tensor, causal: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        probs = super().attention_probs(scores, causal, pos)  # [B, nH, T, S]
        if self.mode == "dense":
            return probs
        group, budget = self.config.gqa_group, row_budget(pos, self.floor, self.divisor)
        sel = torch.stack([oracle_mask(p, pos, self.mode, group, budget, self.sinks, self.window) for p in probs])
        return scores.masked_fill(~sel, float("-inf")).softmax(-1)


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from gsm.sources import read_source

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", type=Path, required=True, help="the dense source (GGUF, HF or llama2.c)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json (a converted checkpoint's)")
    ap.add_argument("--eval-text", type=Path, required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--modes", default="dense,shared,group")
    ap.add_argument("--floor", type=int, default=512)
    ap.add_argument("--divisor", type=int, default=16)
    ap.add_argument("--sinks", type=int, default=1)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512, help="queries scored at a time (a chunked prefill)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dense = DenseLlama(read_source(a.dense))
    L = a.length
    seqs = windows(eval_stream(a.eval_text, Tokenizer.from_file(str(a.tokenizer)), a.sequences * (L - 1)), L,
                   a.sequences, dense.config.bos_token_id)
    res: dict[str, dict] = {}
    base = None
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        model = OracleModel(dense, mode, floor=a.floor, divisor=a.divisor, sinks=a.sinks, window=a.window)
        nll = torch.stack([token_nll(model, None, seqs[b], a.chunk) for b in range(a.sequences)])  # [n, L - 1]
        ppl = math.exp(float(nll.mean()))
        base = ppl if mode == "dense" else base
        res[mode] = {"perplexity": ppl, "vs_dense": None if base is None else ppl / base - 1,
                     "buckets": {f"{lo}-{hi}": math.exp(float(nll[:, lo:min(hi, L - 1)].mean()))
                                 for lo, hi in BUCKETS if lo < L - 1},
                     "seconds": time.perf_counter() - t0}
        rel = "" if base is None else f" ({ppl / base - 1:+.2%})"
        print(f"[oracle] {L} {mode}: {ppl:.4f}{rel} {res[mode]['buckets']} ({res[mode]['seconds']:.0f} s)",
              flush=True)
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
