"""Quality of a GSM checkpoint at real scale, on held-out text (issue 12, "Quality at real scale").

    python bench/quality_real.py long  --checkpoint C --dense SRC --eval-text EVAL [--lengths 1024,2048,4096]
    python bench/quality_real.py curve --checkpoint C [C2 ...] --dense SRC --eval-text EVAL [--fractions ...]
    python bench/quality_real.py chat  --checkpoint C --dense SRC [--prompt "..."]
    python bench/quality_real.py keys  --checkpoint C --dense SRC --eval-text EVAL --calib-text CALIB [--lengths ...]
    python bench/quality_real.py topk  --checkpoint C --dense SRC --eval-text EVAL [--ks 64,128,...] [--lengths ...]

`long`: mask hit rate of the checkpoint's indexer against a random indexer and a recency window of the
SAME budget (sinks + window + top-k), under the dense model's causal attention (as the converter's
quality report scores it), per layer and averaged, at several context lengths; then perplexity of
dense, GSM exact and GSM deployed (FP16 rows; and INT tiers on a decoded tail) at one length.
`curve`: KV bytes per position (spec 6) against held-out perplexity for each checkpoint (rank
tolerance / budget / sharing variants) and each tier-fraction setting (its own calibration scales).
`topk`: the selection budget as a variable: hit rate of the checkpoint's indexer and of recency for every
top-k of a ladder (one dense pass per sequence, gsm.convert.budget's curve), and perplexity at one length of
GSM exact at each top-k and of recency (top-k 0, window + top-k) at the same budget.
`chat`: greedy chat answer of the GSM model (golden, exact mode) next to the dense one.
`keys`: 8-bit indexer keys against the deployed FP16 ones (golden, deployed mode, one prefill per sequence):
the share of the indexer's top-k picks that change where the selection is sparse, and the perplexity, for
INT8 keys with one scale per channel (absmax over calibration text, `--calib-text`) or one per position.

Held-out text only: sequences are cut from EVAL (paragraphs joined by a blank line, tokenised as one
stream, non-overlapping windows from the start). BOS is prepended only when the checkpoint's
tokenizer_config.json says add_bos_token (SmolLM2: no). Writes one JSON (`--out`) and prints a table.
Memory is bounded by scoring one layer and one block of query rows at a time: a [heads, block, T]
slice of attention instead of the [heads, T, T] matrix (600 MB per layer at 4K for SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gsm import checkpoint
from gsm.config import ModelConfig
from gsm.dense import DenseLlama
from gsm.golden import attention as A
from gsm.golden.model import GoldenModel
from gsm.golden.selection import index_scores, select
from gsm.golden.weights import OwningKV
from gsm.sources import read_source

BASELINES = ("indexer", "random", "recency")
README_PROMPT = "Describe a scratch defect on a steel plate in one sentence."


# -- data ------------------------------------------------------------------------------------------
def tokenizer_config(ckpt: Path) -> dict[str, Any]:
    p = Path(ckpt) / "tokenizer_config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def eval_stream(text_path: Path, tokenizer: Any, max_tokens: int) -> list[int]:
    """Paragraphs (blank-line separated) joined by a blank line, tokenised in order, first max_tokens ids."""
    paras = [" ".join(p.split()) for p in Path(text_path).read_text(encoding="utf-8").split("\n\n")]
    stream: list[int] = []
    for k, para in enumerate(p for p in paras if p):
        stream.extend(tokenizer.encode(("\n\n" if k else "") + para, add_special_tokens=False).ids)
        if len(stream) >= max_tokens:
            break
    return stream[:max_tokens]


def windows(stream: list[int], seq_len: int, n: int, bos_id: int | None) -> torch.Tensor:
    """[n', seq_len] non-overlapping windows from the start (n' <= n); BOS first when the model wants one."""
    body = seq_len - (bos_id is not None)
    n = min(n, len(stream) // body)
    if n == 0:
        raise ValueError(f"the evaluation text has {len(stream)} tokens, fewer than one window of {seq_len}")
    rows = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
    if bos_id is not None:
        rows = torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), rows], dim=1)
    return rows


class Setup:
    """The dense source, the GSM checkpoint (exact golden model) and the held-out sequences' rules."""

    def __init__(self, ckpt: Path, dense_path: Path, eval_text: Path | None) -> None:
        from tokenizers import Tokenizer

        self.ckpt = Path(ckpt)
        self.src = read_source(Path(dense_path))
        self.dense = DenseLlama(self.src)
        self.gsm = GoldenModel.from_checkpoint(self.ckpt, mode="exact")
        self.cfg: ModelConfig = self.gsm.cfg
        self.tok_cfg = tokenizer_config(self.ckpt)
        self.tokenizer = Tokenizer.from_file(str(self.ckpt / "tokenizer.json"))
        add_bos = bool(self.tok_cfg.get("add_bos_token", True))
        self.bos_id = self.cfg.bos_token_id if add_bos else None
        self.eval_text = eval_text

    def sequences(self, seq_len: int, n: int) -> torch.Tensor:
        body = seq_len - (self.bos_id is not None)
        return windows(eval_stream(self.eval_text, self.tokenizer, n * body), seq_len, n, self.bos_id)


# -- mask hit rate ---------------------------------------------------------------------------------
def owner_of(cfg: ModelConfig, i: int, weights: Any) -> int:
    """The layer whose indexer (and mask) layer i uses: itself, or its sharing source (spec 4.2)."""
    return i if cfg.is_owning(i) else weights.layers[i].kv.source


@torch.no_grad()
def layer_hit_rates(cfg: ModelConfig, kv: OwningKV, x_own: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *,
                    block: int = 512, seed: int = 0) -> dict[str, float]:
    """Mean dense attention mass of Sel(t) over the sparse query rows of one sequence, per selector.

    x_own: [T, H] normalised input of the owning layer (the indexer's input); q: [nH, T, D] and
    k: [nKV, T, D] RoPE'd dense queries/keys of the scored layer. Query rows are taken `block` at a
    time, so memory is [nH, block, T] rather than [nH, T, T]. Selectors share the budget of the
    checkpoint's gsm_config: sinks + window always, top-k chosen by the indexer / uniform random
    scores / position (recency: = a window of window + top-k).
    """
    p = cfg.gsm
    T = x_own.shape[0]
    keys = x_own @ kv.idx_k.T  # [T, dI]
    gen = torch.Generator().manual_seed(seed)
    sums = dict.fromkeys(BASELINES, 0.0)
    rows = 0
    first_sparse = p.sink_tokens + p.sparse_window + p.sparse_top_k  # rows t >= this are sparse
    for a in range(first_sparse, T, block):
        q_pos = torch.arange(a, min(a + block, T))
        dense = A.attention_probs(q[:, q_pos], k, A.causal_mask(q_pos, T))  # [nH, b, T]
        scores = {
            "indexer": index_scores(x_own[q_pos], kv.idx_q, kv.idx_w, keys, p.indexer_heads),
            "random": torch.rand(q_pos.numel(), T, generator=gen),
            "recency": torch.arange(T, dtype=torch.float32)[None].expand(q_pos.numel(), T),
        }
        for name, sc in scores.items():
            sel = select(sc, q_pos, p)  # [b, T]
            sums[name] += float((dense * sel[None]).sum(-1).mean(0).sum())
        rows += q_pos.numel()
    return {name: s / max(rows, 1) for name, s in sums.items()} | {"rows": rows}


@torch.no_grad()
def sequence_hit_rates(setup: Setup, ids: torch.Tensor, *, block: int = 512, seed: int = 0) -> dict[int, dict]:
    """Layer -> hit rates of one sequence ids [T], under the dense model's attention."""
    cfg, dense = setup.cfg, setup.dense
    _, cap = dense.forward(ids[None], capture=True)  # x, q, k per layer; no [T, T] kept
    T, nH, nKV, D = ids.numel(), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = A.rope_tables(torch.arange(T), D, cfg.rope_theta)
    out = {}
    for i in range(cfg.num_hidden_layers):
        own = owner_of(cfg, i, setup.gsm.w)
        lc = cap.layers[i]
        q = A.apply_rope(lc.q[0].view(T, nH, D).transpose(0, 1), cos, sin)
        k = A.apply_rope(lc.k[0].view(T, nKV, D).transpose(0, 1), cos, sin)
        out[i] = layer_hit_rates(cfg, setup.gsm.w.layers[own].kv, cap.layers[own].x[0], q, k, block=block,
                                 seed=seed + i)
    return out


@torch.no_grad()
def gsm_own_hit_rates(setup: Setup, ids: torch.Tensor) -> dict[int, float]:
    """Layer -> spec 4.3 hit rate under the GSM model's own attention (golden exact-mode trace), mean over
    the sparse query rows. The trace keeps every layer's [nH, T, T] probabilities: 1.1 GB at 1K for SmolLM2."""
    tr = setup.gsm.forward(setup.gsm.new_cache(), ids, trace=True).trace
    p = setup.cfg.gsm
    sparse = torch.arange(ids.numel()) >= p.sink_tokens + p.sparse_window + p.sparse_top_k
    return {i: float(hr[sparse].mean()) for i, hr in tr.hit_rate.items()}


def average_layers(per_seq: list[dict[int, dict]]) -> dict[str, Any]:
    layers = sorted(per_seq[0])
    per_layer = {i: {b: float(np.mean([s[i][b] for s in per_seq])) for b in BASELINES} for i in layers}
    mean = {b: float(np.mean([per_layer[i][b] for i in layers])) for b in BASELINES}
    return {"per_layer": per_layer, "mean_over_layers": mean, "sequences": len(per_seq)}


# -- perplexity ------------------------------------------------------------------------------------
@torch.no_grad()
def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none")


@torch.no_grad()
def perplexities(setup: Setup, seqs: torch.Tensor, *, deployed_fp16: bool = True,
                 full_selection: bool = False) -> dict[str, Any]:
    """Dense, GSM exact and GSM deployed-prefill (FP16 rows, spec 5) perplexity on the same tokens.

    One prefill per sequence: deployed mode's INT tiers only take effect after the end-of-prefill
    re-tier, so this deployed figure isolates the FP16 rounding; `tiered_tail` measures the tiers.
    full_selection: also GSM exact with top-k = the sequence length (every position selected), which
    isolates the latents' (rank, sharing) cost from the sparse selection's."""
    sums = {"dense": 0.0, "gsm_exact": 0.0, "gsm_deployed_fp16_prefill": 0.0}
    n_tok = 0
    dep = GoldenModel(setup.gsm.w, mode="deployed", quant=setup.gsm.quant, calibration=setup.gsm.calib)
    full = GoldenModel(setup.gsm.w, mode="exact", params=replace(setup.cfg.gsm, sparse_top_k=int(seqs.shape[1])))
    if full_selection:
        sums["gsm_exact_full_selection"] = 0.0
    for row in seqs:
        sums["dense"] += float(token_nll(setup.dense.forward(row[None])[0], row).sum())
        sums["gsm_exact"] += float(token_nll(setup.gsm.forward(setup.gsm.new_cache(), row).logits, row).sum())
        if deployed_fp16:
            sums["gsm_deployed_fp16_prefill"] += float(token_nll(dep.forward(dep.new_cache(), row).logits, row).sum())
        if full_selection:
            sums["gsm_exact_full_selection"] += float(token_nll(full.forward(full.new_cache(), row).logits, row).sum())
        n_tok += row.numel() - 1
    if not deployed_fp16:
        sums.pop("gsm_deployed_fp16_prefill")
    ppl = {k: math.exp(v / n_tok) for k, v in sums.items()}
    return {"perplexity": ppl, "relative_to_dense": {k: v / ppl["dense"] - 1 for k, v in ppl.items()},
            "sequences": int(seqs.shape[0]), "seq_len": int(seqs.shape[1]), "tokens": n_tok}


def tiered_tail(weights: Any, quant: Any, calib: Any, seqs: torch.Tensor, fractions: list[tuple[float, ...]],
                decode_steps: int, adaptation_rate: int = 16) -> dict[str, Any]:
    """Deployed mode with INT tiers: prefill T - 1 - decode_steps tokens, decode the rest teacher-forced
    (calibration.measure's protocol, lockstep), score only the decoded tokens; exact on the same tokens."""
    from calibration.measure import Evaluator, Protocol, kv_bytes_per_position

    prefill = int(seqs.shape[1]) - 1 - decode_steps
    ev = Evaluator(weights, quant, seqs, Protocol(prefill_len=prefill, adaptation_rate=adaptation_rate))
    scores = ev.deployed_many([(calib, tuple(f)) for f in fractions])
    rows = [{"tier_fractions": list(f), "kv_bytes_per_position": kv_bytes_per_position(weights, tuple(f)),
             "perplexity": s.perplexity, "relative_to_exact": ev.relative_increase(s),
             "relative_upper_bound_z2": ev.relative_increase(s, 2.0), "mean_kl": s.mean_kl}
            for f, s in zip(fractions, scores)]
    return {"prefill_len": prefill, "decoded_tokens": ev.exact.n_tokens, "exact_perplexity": ev.exact.perplexity,
            "adaptation_rate": adaptation_rate, "rows": rows}


# -- top-k ladder ----------------------------------------------------------------------------------
@torch.no_grad()
def topk_curve(setup: Setup, seqs: torch.Tensor, ks: list[int], block: int = 256) -> dict[str, Any]:
    """gsm.convert.budget's hit-rate curve (indexer and recency) over sequences [B, T] at the checkpoint's
    sinks and window, every k of `ks` from one dense pass per sequence."""
    from gsm.convert.budget import HitRateCurve, add_layer, rope_qk
    from gsm.convert.indexer import Indexer

    cfg = setup.cfg
    p = cfg.gsm
    curve = HitRateCurve(tuple(ks), cfg.num_hidden_layers)
    for row in seqs:
        _, cap = setup.dense.forward(row[None], capture=True)
        for i in range(cfg.num_hidden_layers):
            own = owner_of(cfg, i, setup.gsm.w)
            kv = setup.gsm.w.layers[own].kv
            q, k = rope_qk(cap.layers[i].q[0], cap.layers[i].k[0], cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta)
            add_layer(curve, i, cap.layers[own].x[0], Indexer(kv.idx_q, kv.idx_k, kv.idx_w), p.indexer_heads, q, k,
                      p.sink_tokens, p.sparse_window, block=block)
        del cap
    return {"rows": curve.to_json(), "sequences": int(seqs.shape[0]), "seq_len": int(seqs.shape[1])}


@torch.no_grad()
def topk_perplexities(setup: Setup, seqs: torch.Tensor, ks: list[int], recency: bool,
                      dense: bool = True, indexer: bool = True) -> dict[str, Any]:
    """Perplexity of dense, GSM exact at each top-k, and (recency) GSM exact with the same budget as a window."""
    p = setup.cfg.gsm
    models: dict[str, GoldenModel | None] = {"dense": None} if dense else {}
    for k in ks:
        if indexer:
            models[f"top_k={k}"] = GoldenModel(setup.gsm.w, mode="exact", params=replace(p, sparse_top_k=k))
        if recency:
            # the checkpoint's max_sparse_window bounds a deployed ring buffer; exact mode keeps every row
            w = p.sparse_window + k
            rp = replace(p, sparse_top_k=0, sparse_window=w, max_sparse_window=max(p.max_sparse_window, w))
            models[f"recency_window={w}"] = GoldenModel(replace(setup.gsm.w, cfg=setup.cfg.replace(gsm=rp)),
                                                        mode="exact")
    sums = dict.fromkeys(models, 0.0)
    n_tok = 0
    for b, row in enumerate(seqs):
        for name, m in models.items():
            t0 = time.perf_counter()
            logits = setup.dense.forward(row[None])[0] if m is None else m.forward(m.new_cache(), row).logits
            nll = float(token_nll(logits, row).sum())
            sums[name] += nll
            # per sequence, so that a run stopped early still gives its finished sequences
            print(f"[topk] seq {b} {name}: ppl {math.exp(nll / (row.numel() - 1)):.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        n_tok += row.numel() - 1
    return {"perplexity": {k: math.exp(v / n_tok) for k, v in sums.items()}, "tokens": n_tok,
            "sequences": int(seqs.shape[0]), "seq_len": int(seqs.shape[1])}


def cmd_topk(a: argparse.Namespace) -> dict[str, Any]:
    s = Setup(a.checkpoint, a.dense, a.eval_text)
    p = s.cfg.gsm
    res: dict[str, Any] = {"checkpoint": str(a.checkpoint), "sinks": p.sink_tokens, "window": p.sparse_window,
                           "checkpoint_top_k": p.sparse_top_k, "hit_rate": {}}
    for L in a.lengths:
        t0 = time.perf_counter()
        res["hit_rate"][L] = topk_curve(s, s.sequences(L, a.sequences), a.ks, block=a.block)
        res["hit_rate"][L]["seconds"] = time.perf_counter() - t0
        rows = ", ".join(f"k={r['sparse_top_k']} {r['hit_rate']:.4f}/{r['recency_hit_rate']:.4f}"
                         for r in res["hit_rate"][L]["rows"])
        print(f"[topk] {L}: {rows} ({res['hit_rate'][L]['seconds']:.0f} s)", flush=True)
        if a.out:  # after each length: a long run stopped early keeps what it measured
            a.out.write_text(json.dumps(res, indent=1, default=str))
    if a.ppl_len:
        t0 = time.perf_counter()
        res["perplexity"] = topk_perplexities(s, s.sequences(a.ppl_len, a.ppl_sequences), a.ppl_ks or [],
                                              a.recency, dense=not a.no_dense, indexer=not a.recency_only)
        res["perplexity"]["seconds"] = time.perf_counter() - t0
        print(f"[topk] perplexity at {a.ppl_len}: {res['perplexity']['perplexity']}", flush=True)
    return res


# -- 8-bit indexer keys ------------------------------------------------------------------------------
KEY_FORMATS = ("int8-channel", "int8-token")  # compared with the deployed FP16 keys


def int8_keys(keys: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Dequantised INT8 keys: symmetric, `scale` [dI] per channel, or None: one FP16 scale per position."""
    from gsm.golden.quant import round_fp16

    if scale is None:
        scale = round_fp16(keys.abs().amax(dim=1, keepdim=True) / 127)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(keys / scale), -127, 127) * scale


class KeyHooks:
    """Patches the golden model's index_scores (keys quantised per layer, absmax recorded) and select (masks
    recorded in call order, i.e. owning-layer order) for the duration of a `with`."""

    def __init__(self, gsm: GoldenModel) -> None:
        self.layer_of = {id(lw.kv.idx_q): i for i, lw in enumerate(gsm.w.layers) if isinstance(lw.kv, OwningKV)}
        self.fmt: str | None = None
        self.scales: dict[int, torch.Tensor] = {}
        self.absmax: dict[int, torch.Tensor] = {}
        self.masks: list[torch.Tensor] = []
        self.record = True  # keep select's masks (False: only quantise and take absmax)

    def __enter__(self) -> KeyHooks:
        import gsm.golden.model as gm

        self._orig = (gm.index_scores, gm.select)

        def scores(x, idx_q, idx_w, keys, n_heads, key_scale=None):
            if key_scale is not None:
                raise RuntimeError("KeyHooks simulates INT8 keys over FP16 ones: run the model with index_key_bits 16")
            i = self.layer_of[id(idx_q)]
            m = keys.abs().amax(dim=0)
            self.absmax[i] = m if i not in self.absmax else torch.maximum(self.absmax[i], m)
            if self.fmt is not None:
                keys = int8_keys(keys, self.scales[i] if self.fmt == "int8-channel" else None)
            return self._orig[0](x, idx_q, idx_w, keys, n_heads)

        def sel(sc, q_pos, p):
            mask = self._orig[1](sc, q_pos, p)
            if self.record:
                self.masks.append(mask)
            return mask

        gm.index_scores, gm.select = scores, sel
        return self

    def __exit__(self, *exc: Any) -> None:
        import gsm.golden.model as gm

        gm.index_scores, gm.select = self._orig


@torch.no_grad()
def key_quant(setup: Setup, calib: torch.Tensor, seqs: torch.Tensor) -> dict[str, Any]:
    from gsm.golden.quant import round_fp16

    p = setup.cfg.gsm
    budget = p.sink_tokens + p.sparse_window + p.sparse_top_k
    dep = GoldenModel(setup.gsm.w, mode="deployed", quant=setup.gsm.quant.replace(index_key_bits=16),
                      calibration=setup.gsm.calib)  # FP16 keys, quantised by the hooks below
    with KeyHooks(dep) as h:
        for row in calib:  # FP16 keys on calibration text: per-channel absmax
            dep.forward(dep.new_cache(), row)
        h.scales = {i: round_fp16(m / 127) for i, m in h.absmax.items()}
        nll = {f: 0.0 for f in ("fp16", *KEY_FORMATS)}
        changed: dict[str, list[float]] = {f: [] for f in KEY_FORMATS}
        n_tok = 0
        for b, row in enumerate(seqs):
            h.fmt, h.masks = None, []
            nll["fp16"] += float(token_nll(dep.forward(dep.new_cache(), row).logits, row).sum())
            base = h.masks
            for f in KEY_FORMATS:
                h.fmt, h.masks = f, []
                nll[f] += float(token_nll(dep.forward(dep.new_cache(), row).logits, row).sum())
                for a_, b_ in zip(base, h.masks):
                    # query rows whose selection is not every position; both pick `budget` positions there, of
                    # which sinks + window are fixed: the share of the indexer's top-k picks that moved
                    rows = a_.shape[0] - budget
                    if rows > 0:
                        moved = float((a_[budget:] & ~b_[budget:]).sum())
                        changed[f].append(moved / (rows * p.sparse_top_k))
            n_tok += row.numel() - 1
            print(f"[keys] seq {b}: " + ", ".join(f"{k} {math.exp(v / n_tok):.4f}" for k, v in nll.items()), flush=True)
    ppl = {k: math.exp(v / n_tok) for k, v in nll.items()}
    return {"perplexity": ppl, "relative_to_fp16_keys": {k: v / ppl["fp16"] - 1 for k, v in ppl.items()},
            "selection_changed": {f: {"mean": float(np.mean(v)) if v else 0.0, "max_layer": float(np.max(v))
                                      if v else 0.0} for f, v in changed.items()},
            "key_bytes_per_position_per_layer": {"fp16": 2 * p.indexer_dim, "int8-channel": p.indexer_dim,
                                                 "int8-token": p.indexer_dim + 2},
            "tokens": n_tok, "sequences": int(seqs.shape[0]), "seq_len": int(seqs.shape[1]),
            "calibration_sequences": int(calib.shape[0])}


def cmd_keys(a: argparse.Namespace) -> dict[str, Any]:
    s = Setup(a.checkpoint, a.dense, a.eval_text)
    calib = windows(eval_stream(a.calib_text, s.tokenizer, a.calib_sequences * a.calib_len), a.calib_len,
                    a.calib_sequences, s.bos_id)
    res: dict[str, Any] = {"checkpoint": str(a.checkpoint), "by_length": {}}
    for L in a.lengths:
        t0 = time.perf_counter()
        res["by_length"][L] = key_quant(s, calib, s.sequences(L, a.sequences)) | {"seconds": time.perf_counter() - t0}
        r = res["by_length"][L]
        print(f"[keys] {L}: " + ", ".join(f"{f} {r['relative_to_fp16_keys'][f]:+.3%} ppl, "
                                         f"{r['selection_changed'][f]['mean']:.4f} of top-k picks moved"
                                         for f in KEY_FORMATS), flush=True)
        if a.out:
            a.out.write_text(json.dumps(res, indent=1, default=str))
    return res


# -- chat ------------------------------------------------------------------------------------------
def chat_prompt_ids(ckpt: Path, prompt: str) -> tuple[list[int], list[int]]:
    """The ChatML prompt rendered by transformers' apply_chat_template; and the stop ids (EOS, end of turn)."""
    from transformers import PreTrainedTokenizerFast

    tc = tokenizer_config(ckpt)
    if not tc.get("chat_template"):
        raise ValueError(f"{ckpt}: tokenizer_config.json has no chat_template (the model is not a chat model)")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(ckpt) / "tokenizer.json"),
                                  bos_token=tc.get("bos_token"), eos_token=tc.get("eos_token"))
    tok.chat_template = tc["chat_template"]
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    stops = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int) and t >= 0}
    return ids, sorted(stops)


@torch.no_grad()
def greedy_until(step_first: Any, step_next: Any, n: int, stops: list[int]) -> list[int]:
    logits = step_first()
    out: list[int] = []
    for _ in range(n):
        tok = int(torch.argmax(logits))
        out.append(tok)
        if tok in stops:
            break
        logits = step_next(tok)
    return out


def chat(setup: Setup, prompt: str, max_new: int) -> dict[str, Any]:
    ids, stops = chat_prompt_ids(setup.ckpt, prompt)
    g = setup.gsm
    cache = g.new_cache()
    gsm_ids = greedy_until(lambda: g.prefill(cache, ids).logits[-1], lambda t: g.decode(cache, t).logits[-1],
                           max_new, stops)
    dense_ids = setup.dense.greedy(ids, max_new)
    if any(t in stops for t in dense_ids):
        dense_ids = dense_ids[: next(k for k, t in enumerate(dense_ids) if t in stops) + 1]
    same = next((k for k, (a, b) in enumerate(zip(gsm_ids, dense_ids)) if a != b), min(len(gsm_ids), len(dense_ids)))
    dec = setup.tokenizer.decode
    return {"prompt": prompt, "prompt_tokens": len(ids), "dense": dec(dense_ids), "gsm_exact": dec(gsm_ids),
            "dense_ids": dense_ids, "gsm_ids": gsm_ids, "identical_prefix_tokens": same}


# -- commands --------------------------------------------------------------------------------------
def cmd_long(a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(a.seed)
    s = Setup(a.checkpoint, a.dense, a.eval_text)
    p = s.cfg.gsm
    res: dict[str, Any] = {"checkpoint": str(a.checkpoint), "budget": {
        "sinks": p.sink_tokens, "window": p.sparse_window, "top_k": p.sparse_top_k,
        "positions": p.sink_tokens + p.sparse_window + p.sparse_top_k}, "hit_rate": {}}
    for L in a.lengths:
        t0 = time.perf_counter()
        seqs = s.sequences(L, a.sequences)
        per = [sequence_hit_rates(s, row, block=a.block, seed=a.seed + 1000 * b) for b, row in enumerate(seqs)]
        res["hit_rate"][L] = average_layers(per) | {"seconds": time.perf_counter() - t0}
        if a.gsm_trace:
            own = [gsm_own_hit_rates(s, row) for row in seqs]
            per_layer = {i: float(np.mean([o[i] for o in own])) for i in own[0]}
            res["hit_rate"][L]["gsm_own"] = {"per_layer": per_layer, "mean_over_layers": float(np.mean(list(
                per_layer.values())))}
            print(f"[long] {L}: GSM's own hit rate {res['hit_rate'][L]['gsm_own']['mean_over_layers']:.4f}", flush=True)
        m = res["hit_rate"][L]["mean_over_layers"]
        print(f"[long] {L}: hit rate indexer {m['indexer']:.4f} random {m['random']:.4f} recency {m['recency']:.4f}"
              f" ({len(per)} seq, {time.perf_counter() - t0:.0f} s)", flush=True)
    if a.ppl_len:
        t0 = time.perf_counter()
        seqs = s.sequences(a.ppl_len, a.ppl_sequences)
        res["perplexity"] = perplexities(s, seqs, full_selection=a.full_selection)
        res["perplexity"]["seconds"] = time.perf_counter() - t0
        print(f"[long] perplexity at {a.ppl_len}: {res['perplexity']['perplexity']}", flush=True)
        if a.tail_steps:
            t0 = time.perf_counter()
            fr = [tuple(float(x) for x in f.split(",")) for f in a.fractions]
            res["tiered_tail"] = tiered_tail(s.gsm.w, s.gsm.quant, s.gsm.calib, seqs, fr, a.tail_steps) | {
                "seconds": time.perf_counter() - t0, "calibrated": checkpoint.load_kv_calibration(s.ckpt) is not None}
            print(f"[long] tiered tail: {json.dumps(res['tiered_tail']['rows'])}", flush=True)
    return res


def cmd_curve(a: argparse.Namespace) -> dict[str, Any]:
    from calibration.measure import kv_bytes_per_position

    rows = []
    for ck in a.checkpoint:
        t0 = time.perf_counter()
        s = Setup(ck, a.dense, a.eval_text)
        seqs = s.sequences(a.seq_len, a.sequences)
        pp = perplexities(s, seqs, deployed_fp16=False)
        dense_b = float(s.cfg.num_hidden_layers * 2 * s.cfg.kv_dim * 2)
        base = {"checkpoint": str(ck), "owning_layers": len(s.cfg.owning_layers),
                "ranks": {i: list(r) for i, r in s.gsm.w.ranks.items()}, "dense_fp16_bytes": dense_b,
                "dense_perplexity": pp["perplexity"]["dense"],
                "calibrated": checkpoint.load_kv_calibration(ck) is not None}
        b16 = kv_bytes_per_position(s.gsm.w, (1.0, 0.0, 0.0))
        rows.append(base | {"mode": "exact (FP16 bytes)", "tier_fractions": [1.0, 0.0, 0.0],
                            "kv_bytes_per_position": b16,
                            "ratio_to_dense": b16 / dense_b, "perplexity": pp["perplexity"]["gsm_exact"],
                            "relative_to_dense": pp["relative_to_dense"]["gsm_exact"], "tokens": pp["tokens"]})
        print(f"[curve] {ck}: {b16:.0f} B/pos ({b16 / dense_b:.3f}x) ppl {pp['perplexity']['gsm_exact']:.4f} "
              f"dense {pp['perplexity']['dense']:.4f}", flush=True)
        if a.fractions and a.tail_steps:
            fr = [tuple(float(x) for x in f.split(",")) for f in a.fractions]
            tail = tiered_tail(s.gsm.w, s.gsm.quant, s.gsm.calib, seqs, fr, a.tail_steps)
            for r in tail["rows"]:
                # tiers change the decoded tail only: apply the tail's increase over exact to the exact ppl
                est = pp["perplexity"]["gsm_exact"] * (1 + r["relative_to_exact"])
                rows.append(base | {"mode": "deployed (tiers, decoded tail)", "tier_fractions": r["tier_fractions"],
                                    "kv_bytes_per_position": r["kv_bytes_per_position"],
                                    "ratio_to_dense": r["kv_bytes_per_position"] / dense_b,
                                    "tail_relative_to_exact": r["relative_to_exact"],
                                    "tail_upper_bound_z2": r["relative_upper_bound_z2"],
                                    "perplexity_estimate": est,
                                    "relative_to_dense": est / pp["perplexity"]["dense"] - 1,
                                    "tail": {k: v for k, v in tail.items() if k != "rows"}})
                print(f"[curve]   tiers {r['tier_fractions']}: {r['kv_bytes_per_position']:.0f} B/pos "
                      f"tail +{100 * r['relative_to_exact']:.2f}% vs exact", flush=True)
        print(f"[curve]   {time.perf_counter() - t0:.0f} s", flush=True)
    return {"seq_len": a.seq_len, "sequences": a.sequences, "rows": rows}


def cmd_chat(a: argparse.Namespace) -> dict[str, Any]:
    s = Setup(a.checkpoint, a.dense, None)
    r = chat(s, a.prompt, a.max_new)
    print(f"[chat] dense: {r['dense']!r}\n[chat] gsm:   {r['gsm_exact']!r}", flush=True)
    return r


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/quality_real.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, many: bool = False) -> None:
        p.add_argument("--checkpoint", type=Path, required=True, nargs="+" if many else None)
        p.add_argument("--dense", type=Path, required=True, help="the dense source (.gguf, HF dir, llama2c .bin)")
        p.add_argument("--out", type=Path, help="write the results JSON here")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--seed", type=int, default=0)

    lg = sub.add_parser("long", help="hit rates at long contexts, perplexity at one length")
    common(lg)
    lg.add_argument("--eval-text", type=Path, required=True)
    lg.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096])
    lg.add_argument("--sequences", type=int, default=2, help="sequences per length")
    lg.add_argument("--block", type=int, default=512, help="query rows scored at once")
    lg.add_argument("--gsm-trace", action="store_true",
                    help="also the hit rate under the GSM model's own attention (golden trace; memory ~ layers x T^2)")
    lg.add_argument("--ppl-len", type=int, default=2048, help="0 = skip perplexity")
    lg.add_argument("--ppl-sequences", type=int, default=2)
    lg.add_argument("--full-selection", action="store_true",
                    help="also GSM with every position selected (isolates the latents' cost from the selection's)")
    lg.add_argument("--tail-steps", type=int, default=0, help="decode steps scored with INT tiers (0 = skip)")
    lg.add_argument("--fractions", nargs="*", default=["0,0,1"], help="tier fractions FP16,INT12,INT8")

    cv = sub.add_parser("curve", help="KV bytes per position vs held-out perplexity")
    common(cv, many=True)
    cv.add_argument("--eval-text", type=Path, required=True)
    cv.add_argument("--seq-len", type=int, default=512)
    cv.add_argument("--sequences", type=int, default=8)
    cv.add_argument("--tail-steps", type=int, default=0)
    cv.add_argument("--fractions", nargs="*", default=[])

    tk = sub.add_parser("topk", help="hit rate and perplexity as functions of top-k")
    common(tk)
    ints = lambda t: [int(x) for x in t.split(",") if x]  # noqa: E731
    tk.add_argument("--eval-text", type=Path, required=True)
    tk.add_argument("--ks", type=ints, default=[64, 128, 256, 512, 1024, 2048])
    tk.add_argument("--lengths", type=ints, default=[1024, 2048], help="hit-rate lengths ('' = none)")
    tk.add_argument("--sequences", type=int, default=2, help="sequences per hit-rate length")
    tk.add_argument("--block", type=int, default=256)
    tk.add_argument("--ppl-len", type=int, default=2048, help="0 = skip perplexity")
    tk.add_argument("--ppl-sequences", type=int, default=2)
    tk.add_argument("--ppl-ks", type=ints, default=[], help="top-k values scored for perplexity")
    tk.add_argument("--recency", action="store_true", help="also recency (window + top-k) at each --ppl-ks budget")
    tk.add_argument("--no-dense", action="store_true", help="skip the dense perplexity (run in another process)")
    tk.add_argument("--recency-only", action="store_true", help="with --recency: skip the indexer's top-k models")

    ky = sub.add_parser("keys", help="8-bit indexer keys: selection changes and perplexity vs FP16 keys")
    common(ky)
    ky.add_argument("--eval-text", type=Path, required=True)
    ky.add_argument("--calib-text", type=Path, required=True, help="text the per-channel scales are taken on")
    ky.add_argument("--calib-sequences", type=int, default=2)
    ky.add_argument("--calib-len", type=int, default=1024)
    ky.add_argument("--lengths", type=ints, default=[512, 2048])
    ky.add_argument("--sequences", type=int, default=2, help="held-out sequences per length")

    ch = sub.add_parser("chat", help="greedy chat answer, GSM exact vs dense")
    common(ch)
    ch.add_argument("--prompt", default=README_PROMPT)
    ch.add_argument("--max-new", type=int, default=64)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        res = {"long": cmd_long, "curve": cmd_curve, "chat": cmd_chat, "topk": cmd_topk, "keys": cmd_keys}[a.cmd](a)
    except (ValueError, KeyError, FileNotFoundError) as e:  # bad input: a flag, a file, a checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    res["command"] = " ".join(sys.argv)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
