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
Perplexity per model over the windows and by position bucket; queries are taken `--block` at a time, so memory
holds [heads, block, T] scores, never [heads, T, T].
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from quality_real import eval_stream, windows  # noqa: E402

from gsm import names  # noqa: E402
from gsm.dense import DenseLlama  # noqa: E402
from gsm.golden.blocks import rms_norm, swiglu_mlp  # noqa: E402
from gsm.golden.rope import apply_rope, rope_tables  # noqa: E402

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


class OracleModel:
    """DenseLlama's weights, attention restricted per layer by `oracle_mask` (mode `dense`: not restricted)."""

    def __init__(self, dense: DenseLlama, mode: str, *, floor: int, divisor: int, sinks: int, window: int,
                 block: int) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.m, self.mode, self.block = dense, mode, block
        self.floor, self.divisor, self.sinks, self.window = floor, divisor, sinks, window

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [nH, T, D], k, v [nKV, T, D] (RoPE'd) -> head outputs [nH, T, D]."""
        nH, T, D = q.shape
        group = nH // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out = torch.empty_like(q)
        for s0 in range(0, T, self.block):
            s1 = min(T, s0 + self.block)
            pos = torch.arange(s0, s1)
            logits = (q[:, s0:s1] @ k[:, :s1].transpose(1, 2)) / math.sqrt(D)
            logits = logits.masked_fill(~(torch.arange(s1)[None, :] <= pos[:, None])[None], float("-inf"))
            p = logits.softmax(-1)
            if self.mode != "dense":
                sel = oracle_mask(p, pos, self.mode, group, row_budget(pos, self.floor, self.divisor), self.sinks,
                                  self.window)
                p = logits.masked_fill(~sel, float("-inf")).softmax(-1)
            out[:, s0:s1] = p @ v[:, :s1]
        return out

    @torch.no_grad()
    def token_nll(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T - 1] next-token NLL (the head applied 1,024 rows at a time)."""
        m, cfg = self.m, self.m.config
        T = ids.shape[0]
        nH, nKV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = rope_tables(torch.arange(T), D, cfg.rope_theta)
        h = m.w[names.EMBED][ids]
        for i in range(cfg.num_hidden_layers):
            def w(key: str, i: int = i) -> torch.Tensor:
                return m.w[names.layer_name(key, i)]

            x = rms_norm(h, w("input_norm"), cfg.rms_norm_eps)
            q = apply_rope(F.linear(x, w("q_proj")).view(T, nH, D).transpose(0, 1), cos, sin)
            k = apply_rope(F.linear(x, w("k_proj")).view(T, nKV, D).transpose(0, 1), cos, sin)
            v = F.linear(x, w("v_proj")).view(T, nKV, D).transpose(0, 1)
            h = h + F.linear(self.attention(q, k, v).transpose(0, 1).reshape(T, nH * D), w("o_proj"))
            h = h + swiglu_mlp(rms_norm(h, w("post_norm"), cfg.rms_norm_eps), w("gate_proj"), w("up_proj"),
                               w("down_proj"))
        hn = rms_norm(h, m.w[names.FINAL_NORM], cfg.rms_norm_eps)
        out = torch.empty(T - 1)
        for s0 in range(0, T - 1, 1024):
            s1 = min(T - 1, s0 + 1024)
            out[s0:s1] = F.cross_entropy(F.linear(hn[s0:s1], m.lm_head), ids[s0 + 1:s1 + 1], reduction="none")
        return out


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
    ap.add_argument("--block", type=int, default=512, help="queries scored at a time")
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
        model = OracleModel(dense, mode, floor=a.floor, divisor=a.divisor, sinks=a.sinks, window=a.window,
                            block=a.block)
        nll = torch.stack([model.token_nll(seqs[b]) for b in range(a.sequences)])  # [n, L - 1]
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
