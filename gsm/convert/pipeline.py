"""Dense LLaMA-family model -> GSM checkpoint: the steps, in order, as plain functions.

0. Check every length (calibration/eval sequences, agreement steps, the selection budget) against
   the model's context before any work.
1. Stream calibration text through the dense model and keep statistics, not activations
   (gsm.convert.stats): per-layer input moments, projector moments for nearby layer pairs, and a
   bounded sample of sequences with their attention for the indexer.
2. Whitened SVD of every layer's k_proj/v_proj (gsm.convert.svd); ranks from the tolerance or a
   byte budget.
3. Window/top-k split (optional search on the sample), then the indexer of every layer,
   initialised from its projections, fitted to its attention on the short sample and then on
   sampled query rows of long calibration windows (gsm.convert.long_sample); then (optional) the
   selection budget: per layer, the fewest rows whose hit rate at a long calibration context
   reaches a target (gsm.convert.budget).
4. Sharing: none, a user map, or auto (least-squares projector from the nearest few earlier
   layers, kept while the calibration perplexity cost stays within budget).
5. Assemble the tensors of spec 3, measure the result on held-out text (gsm.convert.quality),
   write the checkpoint atomically.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from gsm import names
from gsm.config import GSMParams, KVQuantConfig
from gsm.convert import budget as bud
from gsm.convert import indexer as ixr
from gsm.convert.budget import BUDGET_SEQ_LEN, BUDGET_SEQUENCES, HIT_RATE_TARGET, TOP_K_DIVISOR
from gsm.convert.data import DataError, add_bos_of, stream_windows, text_sha256, token_sequences, token_stream
from gsm.convert.long_sample import chunks_of, collect_long_sample
from gsm.convert.plan import LowRanks, Plan, assemble, golden_of, mean_nll, ranks_at, resident
from gsm.convert.quality import (
    AGREEMENT_STEPS,
    LONG_CHECK,
    PROMPT_TOKENS,
    long_check_units,
    long_context_check,
    quality_report,
    quality_units,
)
from gsm.convert.sharing import ProjectorFit, fit_projector_from_moments, latent_moments, parse_sharing_map
from gsm.convert.stages import Stages, resolve_device
from gsm.convert.stats import CalibStats, collect_stats, sharing_pairs
from gsm.convert.svd import whitened_svd
from gsm.dense import DenseLlama
from gsm.golden.selection import index_scores
from gsm.progress import track
from gsm.sources import DenseSource

__all__ = ["ConvertOptions", "Lengths", "Plan", "assemble", "check_lengths", "convert", "golden_of", "mean_nll",
           "ranks_at"]

WINDOW_CANDIDATES = (3, 8, 16, 32, 48)
WINDOW_SEARCH_LAYERS = 6  # the split is one number for the model: scored on this many layers, spread evenly
SHARING_REACH = 3  # auto sharing: a layer may read the latents of one of the 3 layers before it
SHARING_MAX_REJECTIONS = 3  # auto sharing stops after this many rejected trials in a row
SHARING_EVAL_SEQUENCES = 8  # calibration sequences each sharing trial is scored on
# SmolLM2 (docs/convert.md): 3 windows of 4K, 256 rows each, 300 steps after the short fit; 8 windows gave +0.88 %
# at 2K where 3 gave +0.91 %, for 1 GB more sample
LONG_FIT_LEN = 4096  # positions per long window (clamped to the model's context)
LONG_FIT_WINDOWS = 3
LONG_FIT_ROWS = 256  # query rows sampled per window
LONG_FIT_STEPS = 300


@dataclass(frozen=True)
class ConvertOptions:
    calib_text: Path
    eval_text: Path | None = None
    tolerance: float = GSMParams.kv_compression_tolerance
    kv_budget: int | None = None  # bytes per position of the FP16 latent cache (spec 6 formula)
    sharing: str = "none"  # "none" | "auto" | "3:1,4:2" (docs/convert.md: why none is the default)
    sharing_budget: float = 0.05  # auto: allowed relative calibration-perplexity increase
    seq_len: int = 256
    calib_tokens: int = 16384  # moments of H x H need far fewer tokens than the forward costs
    eval_tokens: int = 4096
    indexer_sequences: int = 32  # the bounded sample the indexer and the window search are fitted on
    indexer_steps: int = 200  # the short fit's Adam steps (0: the long fit starts from the initialisation)
    # the indexer's second fit, on sampled query rows of long calibration windows (gsm.convert.long_sample);
    # 0 tokens, windows or steps: the short sample only
    long_fit_len: int = LONG_FIT_LEN
    long_fit_windows: int = LONG_FIT_WINDOWS
    long_fit_rows: int = LONG_FIT_ROWS
    long_fit_steps: int = LONG_FIT_STEPS
    seed: int = 0
    gsm: GSMParams = field(default_factory=GSMParams)
    tradeoff_tolerances: tuple[float, ...] = (0.005, 0.02, 0.05, 0.1, 0.2)
    auto_window: bool = False  # search the window/top-k split of the budget (choose_window)
    auto_top_k: bool = False  # choose sparse_top_k from bud.LADDER by hit rate (selection_budget_stage)
    per_layer_selection: bool = True  # with auto_top_k: each layer its own selector and budget
    # > 0: each indexer layer's top-k grows to (t + 1) // top_k_divisor past its floor (bud.with_growth); None:
    # TOP_K_DIVISOR when the top-k is chosen (auto_top_k), 0 for a given one (written as given)
    top_k_divisor: int | None = None
    long_check: tuple[int, ...] = LONG_CHECK  # held-out window lengths of the report's long-context check
    long_check_windows: int = 1  # windows per length
    hit_rate_target: float = HIT_RATE_TARGET
    budget_seq_len: int = BUDGET_SEQ_LEN
    budget_sequences: int = BUDGET_SEQUENCES
    device: str = "auto"  # cpu | cuda | auto: where statistics, SVDs and indexer fits run

    @property
    def growth(self) -> int:
        """The top-k divisor the conversion writes (top_k_divisor resolved)."""
        if self.top_k_divisor is not None:
            return self.top_k_divisor
        return TOP_K_DIVISOR if self.auto_top_k else 0


@dataclass(frozen=True)
class Lengths:
    """Every length the conversion will use, already fitted to the model's context."""

    seq_len: int
    agreement_steps: int
    budget_seq_len: int = 0  # context of the selection-budget measurement (0: no measurement)
    long_fit_len: int = 0  # positions per window of the indexer's long fit (0: no long fit)
    notes: tuple[str, ...] = ()


def check_lengths(max_positions: int, opts: ConvertOptions) -> Lengths:
    """Clamp the lengths to max_position_embeddings, or refuse before any work when nothing useful fits.

    Sequences longer than the context are cut to it (the dense model could not run them); the
    greedy-agreement measurement gets the steps that fit after its prompt. Refused: a context (or
    --seq-len) that leaves no position where the selection is sparse, because then there is
    nothing to fit the indexer to and nothing to measure.
    """
    p = opts.gsm
    notes = []
    seq_len = opts.seq_len
    if seq_len > max_positions:
        notes.append(f"--seq-len {seq_len} is longer than the model's context (max_position_embeddings "
                     f"{max_positions}); using {max_positions}")
        seq_len = max_positions
    # the fit sequences need sparse rows at the fitting budget; a larger top-k (given, or chosen by the
    # budget stage) only makes the short held-out report's selection dense, which it then says
    fit_k = p.sparse_top_k if opts.auto_top_k else min(p.sparse_top_k, GSMParams.sparse_top_k)
    budget = p.sink_tokens + p.sparse_window + fit_k
    if seq_len <= budget:
        who = (f"the model's context (max_position_embeddings {max_positions})" if seq_len == max_positions
               else f"--seq-len {seq_len}")
        raise ValueError(f"{who} is not longer than the selection budget sinks + window + top-k = {budget}: "
                         "every position would attend densely, leaving nothing to fit the indexer to; "
                         "lower --top-k or raise --seq-len")
    if max_positions < PROMPT_TOKENS + 2:
        raise ValueError(f"the model's context (max_position_embeddings {max_positions}) is shorter than the "
                         f"{PROMPT_TOKENS + 2} positions the greedy-agreement measurement needs")
    if not opts.auto_top_k and p.selection_is_dense(seq_len):
        notes.append(f"top-k {p.sparse_top_k}: every position of the {seq_len}-token held-out sequences is "
                     "selected, so the report's hit rates and perplexity there do not measure the selection")
    steps = min(AGREEMENT_STEPS, max_positions - PROMPT_TOKENS)
    if steps < AGREEMENT_STEPS:
        notes.append(f"greedy agreement measured over {steps} steps (context {max_positions})")
    budget_len = 0
    if opts.auto_top_k:
        budget_len = min(opts.budget_seq_len, max_positions)
        if budget_len < opts.budget_seq_len:
            notes.append(f"selection budget measured at {budget_len} tokens (max_position_embeddings "
                         f"{max_positions}), not {opts.budget_seq_len}")
        if budget_len < seq_len:
            raise ValueError(f"the selection-budget context {budget_len} is shorter than --seq-len {seq_len}")
    long_len = min(opts.long_fit_len, max_positions) if opts.long_fit_windows > 0 and opts.long_fit_steps > 0 else 0
    if 0 < long_len < opts.long_fit_len:
        notes.append(f"the indexer's long fit uses windows of {long_len} tokens (max_position_embeddings "
                     f"{max_positions}), not {opts.long_fit_len}")
    if long_len <= seq_len:
        long_len = 0  # nothing longer than the short sample to fit on
    return Lengths(seq_len=seq_len, agreement_steps=steps, budget_seq_len=budget_len, long_fit_len=long_len,
                   notes=tuple(notes))


def lowranks_of(src: DenseSource, stats: CalibStats, device: torch.device,
                advance: Callable[[int], None] | None = None) -> LowRanks:
    out = {}
    for i in range(src.config.num_hidden_layers):
        cov = stats.covariance(i)
        for kv in ("k", "v"):
            out[(i, kv)] = whitened_svd(src.get(names.layer_name(f"{kv}_proj", i)), cov, device)
        if advance is not None:
            advance(1)
    return out


def projector(lowranks: LowRanks, stats: CalibStats, s: int, d: int, ranks: tuple[int, int]) -> ProjectorFit:
    """kv_projector of sharing layer d reading owning layer s at `ranks`, from the moments alone."""
    A = torch.cat([lowranks[(s, kv)].latent_map(r) for kv, r in zip(("k", "v"), ranks)], dim=1)
    m, md = stats.layers[s], stats.layers[d]
    if (s, d) not in stats.cross or md.yy is None or md.y_sum is None:
        raise ValueError(f"no calibration moments for sharing pair {d}:{s}")
    ztz, zty = latent_moments(A, m.xx, m.x_sum, stats.tokens, stats.cross[(s, d)], md.y_sum)
    return fit_projector_from_moments(ztz, zty, float(torch.trace(md.yy)), s)


def fit_indexers(src: DenseSource, lowranks: LowRanks, stats: CalibStats, params: GSMParams, steps: int,
                 seed: int, device: torch.device, advance: Any, n_fit: int | None = None,
                 layers: list[int] | None = None) -> tuple[dict[int, ixr.Indexer], dict[int, list[float]]]:
    """Indexer of each of `layers` (all by default), fitted on the first n_fit sample sequences (all by default).

    `advance(1)` after each Adam step, or after each layer when steps is 0 (fit_units: how many)."""
    cfg = src.config
    out, losses = {}, {}
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        m = stats.layers[i]
        init = ixr.init_from_projections(
            src.get(names.layer_name("q_proj", i)), lowranks[(i, "k")], m.xx, m.x_sum,
            n_heads=cfg.num_attention_heads, n_kv=cfg.num_key_value_heads,
            n_idx=params.indexer_heads, d_idx=params.indexer_dim)
        out[i], losses[i] = ixr.fit(init, stats.seq_x[i][:n_fit], stats.attn[i][:n_fit], params,
                                    steps=steps, seed=seed + i, device=device, advance=advance)
        if not steps:
            advance(1)
    return out, losses


def fit_units(n_layers: int, steps: int) -> int:
    """The progress units of fit_indexers over n_layers: Adam steps, or layers when there are none."""
    return n_layers * max(steps, 1)


def search_steps(opts: ConvertOptions) -> int:
    """Adam steps of each brief fit of the window search."""
    return max(20, opts.indexer_steps // 4)


def search_layers(n_layers: int) -> list[int]:
    """WINDOW_SEARCH_LAYERS layers spread evenly from the first to the last (all of a small model)."""
    k = min(n_layers, WINDOW_SEARCH_LAYERS)
    return sorted({round(j * (n_layers - 1) / max(1, k - 1)) for j in range(k)})


def window_candidates(params: GSMParams) -> list[GSMParams]:
    """Splits of the same selection budget (sinks + window + top_k) between window and top-k."""
    budget = params.sparse_window + params.sparse_top_k
    ws = sorted({params.sparse_window, *(w for w in WINDOW_CANDIDATES if w < budget)})
    return [replace(params, sparse_window=w, sparse_top_k=budget - w,
                    max_sparse_window=max(params.max_sparse_window, w)) for w in ws]


def choose_window(src: DenseSource, lowranks: LowRanks, stats: CalibStats, opts: ConvertOptions,
                  device: torch.device, stages: Stages) -> tuple[GSMParams, list[dict[str, Any]]]:
    """The window/top-k split with the best mean mask hit rate on held-in calibration sequences.

    The spec's indexer sees no positions, so it cannot reproduce the local part of attention that
    a recency window captures; a wider window absorbs that part and leaves the indexer the
    content-addressed part. Indexers are fitted briefly on 3/4 of the sample sequences and scored
    on the other 1/4 (all calibration text: the evaluation text is never looked at), on
    WINDOW_SEARCH_LAYERS layers spread over the depth. Cost: one short fit per searched layer and
    candidate, bounded whatever the layer count.
    """
    n = stats.seq_x[0].shape[0]
    n_fit = max(1, (3 * n) // 4)
    layers = search_layers(src.config.num_hidden_layers)
    cands = window_candidates(opts.gsm)
    table = []
    with stages.run("window search", total=len(cands) * fit_units(len(layers), search_steps(opts)),
                    unit="Adam steps") as advance:
        for p in cands:
            ix, _ = fit_indexers(src, lowranks, stats, p, steps=search_steps(opts), seed=opts.seed,
                                 device=device, advance=advance, n_fit=n_fit, layers=layers)
            rates = []
            for i in layers:
                for b in range(n_fit, n):
                    x = stats.seq_x[i][b].float()
                    sc = index_scores(x, ix[i].q, ix[i].w, x @ ix[i].k.T, p.indexer_heads)
                    probs = stats.attn[i][b][None] / src.config.num_attention_heads  # head mean
                    rates.append(ixr.hit_rate(sc, probs, p))
            table.append({"sparse_window": p.sparse_window, "sparse_top_k": p.sparse_top_k,
                          "calib_hit_rate": float(np.mean(rates)), "layers": layers})
            stages.progress(f"window {p.sparse_window:3d} + top-k {p.sparse_top_k:3d}: "
                            f"calibration hit rate {table[-1]['calib_hit_rate']:.4f}")
    best = max(table, key=lambda r: (r["calib_hit_rate"], -r["sparse_window"]))
    chosen = next(p for p in cands if p.sparse_window == best["sparse_window"])
    return chosen, table


def calib_windows(path: Path, tok: Tokenizer, *, what: str, skip: int, n: int, L: int, min_len: int,
                  bos_id: int | None, vocab_size: int) -> tuple[torch.Tensor, list[str]]:
    """n calibration windows of L tokens after the first `skip` tokens of the text (the ones earlier stages fit on).

    With a text too short to skip them the windows overlap those tokens, and with less text than asked they
    are fewer or shorter (never shorter than min_len): a note naming `what` says which.
    """
    stream = token_stream(path, tok, skip + n * L)
    notes = []
    if len(stream) >= skip + n * L:
        stream = stream[skip:]
    else:
        notes.append(f"{what}: {path} is too short to take it beyond the text fitted on before")
    if len(stream) < n * L:
        L2 = max(min_len, min(L, len(stream) // n))
        n2 = max(1, min(n, len(stream) // L2))
        notes.append(f"{what}: {n2} x {L2} calibration tokens ({path} holds fewer than {n} x {L})")
        n, L = n2, L2
    try:
        return stream_windows(stream, seq_len=L, max_tokens=n * L, bos_id=bos_id, vocab_size=vocab_size,
                              where=str(path)), notes
    except DataError as e:
        raise ValueError(str(e)) from e


def budget_sequences(path: Path, tok: Tokenizer, lengths: Lengths, opts: ConvertOptions, bos_id: int | None,
                     vocab_size: int) -> tuple[torch.Tensor, list[str]]:
    """opts.budget_sequences calibration windows of lengths.budget_seq_len for the selection budget, after the
    indexer's short sample, so the curve scores the indexers on text the short fit did not see."""
    return calib_windows(path, tok, what="selection budget", skip=opts.indexer_sequences * lengths.seq_len,
                         n=opts.budget_sequences, L=lengths.budget_seq_len, min_len=lengths.seq_len, bos_id=bos_id,
                         vocab_size=vocab_size)


def long_fit_windows(path: Path, tok: Tokenizer, lengths: Lengths, opts: ConvertOptions, bos_id: int | None,
                     vocab_size: int) -> tuple[torch.Tensor, list[str]]:
    """opts.long_fit_windows calibration windows of lengths.long_fit_len for the indexer's long fit, after the
    short sample and the selection budget's windows (the curve then scores text neither fit saw)."""
    skip = opts.indexer_sequences * lengths.seq_len + opts.budget_sequences * lengths.budget_seq_len  # 0: no budget
    return calib_windows(path, tok, what="indexer long fit", skip=skip, n=opts.long_fit_windows,
                         L=lengths.long_fit_len, min_len=lengths.seq_len + 1, bos_id=bos_id, vocab_size=vocab_size)


@torch.no_grad()
def selection_budget_stage(src: DenseSource, plan: Plan, seqs: torch.Tensor, target: float, stages: Stages,
                           per_layer: bool = True, top_k_divisor: int = 0) -> tuple[GSMParams, dict[str, Any]]:
    """The selection budget from the indexers' hit rate under the dense attention on calibration sequences
    `seqs` [B, T] (every k of a ladder from one dense pass per sequence, gsm.convert.budget).

    per_layer (the default): each layer's selector (indexer top-k beside the window, or recency: the same rows as a
    longer window) and k, the fewest mean rows whose mean hit rate reaches `target` (budget.allocate), written as
    gsm_config layer_selection; sparse_top_k is then the layers' largest top-k. Uniform: the smallest sparse_top_k
    of bud.LADDER whose mean hit rate reaches `target`. Either way the largest measurable choice when none does.
    top_k_divisor > 0: the chosen top-k are floors that grow with the context (bud.with_growth).

    The indexers were fitted with sinks and window only (the fit does not depend on top-k), so they are
    scored as fitted; every layer uses its own indexer (sharing is decided afterwards; a sharing layer then
    follows its source's selection). Memory: the dense K/V cache of one sequence and one chunk of activations.
    """
    cfg = src.config
    p = plan.params
    ladder = bud.LAYER_LADDER if per_layer else bud.LADDER
    ks = tuple(k for k in ladder if k + p.sink_tokens + p.sparse_window < seqs.shape[1])
    curve = bud.HitRateCurve(ks, cfg.num_hidden_layers)
    dense = DenseLlama(src)
    dense.lm_head = torch.empty(0, cfg.hidden_size)  # the curve needs the layers, not the logits
    indexers = [plan.indexers[i] for i in range(cfg.num_hidden_layers)]
    chunk = bud.PREFILL_CHUNK
    with stages.run("selection budget", total=seqs.shape[0] * -(-seqs.shape[1] // chunk), unit="chunks") as advance:
        for row in seqs:
            bud.add_sequence(curve, dense, row, indexers, p.indexer_heads, p.sink_tokens, p.sparse_window, chunk=chunk,
                             advance=advance)
    info: dict[str, Any] = {"mode": "per-layer" if per_layer else "auto", "hit_rate_target": target,
                            "seq_len": int(seqs.shape[1]), "sequences": int(seqs.shape[0])}
    if not curve.measured_ks():
        new, reached = p, False
    elif per_layer:
        picks, reached = bud.allocate(curve, target)
        table = {i: c.selection(p.sparse_window) for i, c in enumerate(picks)}
        new = replace(p, layer_selection=table, sparse_top_k=max(ls.sparse_top_k for ls in table.values()))
        info["layers"] = [{"layer": i, "selector": c.selector, "k": c.k, "hit_rate": round(c.hit_rate, 4),
                           "sparse_window": table[i].sparse_window, "sparse_top_k": table[i].sparse_top_k}
                          for i, c in enumerate(picks)]
        info["mean_hit_rate"] = float(np.mean([c.hit_rate for c in picks]))
    else:
        k, reached = bud.choose_top_k(curve, target)
        new = replace(p, sparse_top_k=k)
    layers = list(range(cfg.num_hidden_layers))
    new = bud.fit_growth(new, top_k_divisor, cfg.max_position_embeddings, layers)
    if top_k_divisor:
        info["sparse_top_k_divisor"] = new.sparse_top_k_divisor
    info.update(sparse_top_k=new.sparse_top_k, target_reached=reached, curve=curve.to_json(),
                rows_per_step=bud.rows_per_step(new, layers, sorted({int(seqs.shape[1]), *(
                    n for n in (2048, 4096, 8192) if n <= cfg.max_position_embeddings)})))
    for r in info["curve"]:
        stages.progress(f"top-k {r['sparse_top_k']:5d}: hit rate {r['hit_rate']:.4f} at {seqs.shape[1]} tokens "
                        f"(recency {r['recency_hit_rate']:.4f})")
    if "layers" in info:
        # i: the indexer beside the model's window, i+wW: beside window W, r: a longer window alone
        stages.progress("per layer: " + ", ".join(
            f"{d['layer']}:{d['selector'][0]}{d['k']}" + (f"+w{d['sparse_window']}" if "+w" in d["selector"] else "")
            for d in info["layers"])
                        + f" (mean hit rate {info['mean_hit_rate']:.4f})")
    else:
        stages.progress(f"sparse_top_k {new.sparse_top_k}")
    stages.progress(", ".join(f"{n}: {v['rows']:.0f} rows per step ({v['fraction_of_dense']:.1%} of dense)"
                              for n, v in info["rows_per_step"].items())
                    + ("" if reached else f" (the hit-rate target {target} was not reached)"))
    return new, info


def decide_sharing(src: DenseSource, lowranks: LowRanks, stats: CalibStats, plan: Plan, opts: ConvertOptions,
                   calib_eval: torch.Tensor, stages: Stages) -> None:
    """Fill plan.sharing according to opts.sharing (mutates plan).

    auto: every (source, layer) pair within SHARING_REACH is fitted once from the moments (linear
    in the layer count); then, best residual first, a layer is tried as sharing and kept while the
    calibration perplexity stays within budget; SHARING_MAX_REJECTIONS rejections in a row end
    the search (the remaining candidates fit worse).
    """
    L = src.config.num_hidden_layers
    if opts.sharing == "none":
        return
    if opts.sharing != "auto":
        for dst, s in parse_sharing_map(opts.sharing, L).items():
            plan.sharing[dst] = projector(lowranks, stats, s, dst, plan.ranks[s])
        return
    with stages.run("sharing search", unit="trials") as advance:
        fits = {(s, d): projector(lowranks, stats, s, d, plan.ranks[s]) for s, d in sharing_pairs(L, SHARING_REACH)}
        cfg0, t0 = assemble(src, lowranks, plan)
        base = mean_nll(golden_of(cfg0, t0), calib_eval)
        rejected: set[int] = set()
        in_a_row = 0
        while in_a_row < SHARING_MAX_REJECTIONS:
            sources = {f.source for f in plan.sharing.values()}
            best: dict[int, ProjectorFit] = {}
            for (s, d), f in fits.items():
                if s in plan.sharing or d in plan.sharing or d in rejected or d in sources:
                    continue
                if d not in best or (f.rel_residual, f.source) < (best[d].rel_residual, best[d].source):
                    best[d] = f
            if not best:
                break
            dst, fit = min(best.items(), key=lambda kv: (kv[1].rel_residual, kv[0]))
            plan.sharing[dst] = fit
            cfg1, t1 = assemble(src, lowranks, plan)
            cost = math.exp(mean_nll(golden_of(cfg1, t1), calib_eval) - base) - 1.0
            ok = cost <= opts.sharing_budget
            plan.sharing_trials.append({"layer": dst, "source": fit.source, "rel_residual": fit.rel_residual,
                                        "calib_ppl_increase": cost, "accepted": ok})
            stages.progress(f"sharing layer {dst} <- {fit.source}: residual {fit.rel_residual:.3f}, "
                            f"calibration perplexity {cost:+.1%} ({'kept' if ok else 'rejected'})")
            advance(1)
            if not ok:
                del plan.sharing[dst]
                rejected.add(dst)
            in_a_row = 0 if ok else in_a_row + 1


def requested_pairs(opts: ConvertOptions, n_layers: int) -> list[tuple[int, int]]:
    """The (source, sharing layer) pairs whose moments the calibration pass must keep."""
    if opts.sharing == "none":
        return []
    if opts.sharing == "auto":
        return sharing_pairs(n_layers, SHARING_REACH)
    return [(s, d) for d, s in parse_sharing_map(opts.sharing, n_layers).items()]


def long_fit(dense: DenseLlama, plan: Plan, windows: torch.Tensor, opts: ConvertOptions, device: torch.device,
             stages: Stages) -> None:
    """Refit every layer's indexer on sampled query rows of long calibration windows [B, T] (mutates plan).

    Starts from the short fit: at 256 tokens it ranks the near past (from the initialisation instead, 8 windows
    left SmolLM2 +1.18 % over dense at 2K, not +0.88 %); the long rows teach it the far past, which a 256-token
    window never asks for. The sample is freed layer by layer as the fits finish.
    """
    p, L = plan.params, dense.config.num_hidden_layers
    # parallel: the sample's chunked prefill is 256-token GEMMs
    with stages.run("long sample", total=chunks_of(windows), parallel=True, unit="chunks") as advance:
        sample = collect_long_sample(dense, windows, rows_per_window=opts.long_fit_rows,
                                     first=p.sink_tokens + p.sparse_window, seed=opts.seed, advance=advance)
    stages.progress(f"long sample: {windows.shape[0]} x {windows.shape[1]} tokens, {sample.rows.shape[1]} query "
                    f"rows each: {sample.nbytes() / 2**20:.0f} MiB")
    with stages.run("indexer long fit", total=L * opts.long_fit_steps, unit="Adam steps") as advance:
        for i in range(L):
            plan.indexers[i], plan.indexer_long_losses[i] = ixr.fit_rows(
                plan.indexers[i], sample.x[i], sample.rows, sample.attn[i], p, steps=opts.long_fit_steps,
                seed=opts.seed + i, device=device, advance=advance)
            sample.x[i] = sample.attn[i] = torch.empty(0)
    for i in range(L):
        stages.progress(f"indexer of layer {i}, long rows: KL {plan.indexer_long_losses[i][0]:.3f} -> "
                        f"{plan.indexer_long_losses[i][-1]:.3f}")
    plan.long_fit = {"windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
                     "rows_per_window": int(sample.rows.shape[1]), "steps": opts.long_fit_steps}


def plan_model(src: DenseSource, opts: ConvertOptions, calib: torch.Tensor, stages: Stages,
               device: torch.device, budget_seqs: torch.Tensor | None = None,
               long_windows: torch.Tensor | None = None) -> tuple[Plan, LowRanks]:
    L = src.config.num_hidden_layers
    dense = DenseLlama(src)  # shares the resident weights
    # statistics need the layers, not the logits: an empty head skips the [B, T, vocab] matmul
    dense.lm_head = torch.empty(0, src.config.hidden_size)
    with stages.run("calibration statistics", total=calib.shape[0], parallel=True, unit="sequences") as advance:
        stats = collect_stats(dense, calib, n_sample=opts.indexer_sequences, pairs=requested_pairs(opts, L),
                              device=device, advance=advance)
    stages.progress(f"statistics of {stats.tokens} calibration tokens: {stats.nbytes() / 2**20:.0f} MiB")
    with stages.run("whitened SVD", total=L, unit="layers") as advance:
        lowranks = lowranks_of(src, stats, device, advance)
    params = opts.gsm
    window_table: list[dict[str, Any]] = []
    if opts.auto_window:
        params, window_table = choose_window(src, lowranks, stats, opts, device, stages)
    ranks = ranks_at(lowranks, list(range(L)), opts.tolerance, opts.kv_budget, params.indexer_dim)
    steps = opts.indexer_steps
    with stages.run("indexer fit" if steps else "indexer initialisation", total=fit_units(L, steps),
                    unit="Adam steps" if steps else "layers") as advance:
        indexers, losses = fit_indexers(src, lowranks, stats, params, steps, opts.seed, device, advance)
    short_fit = {"sequences": int(stats.seq_x[0].shape[0]), "seq_len": int(calib.shape[1]), "steps": steps}
    stats.seq_x, stats.attn = [], []  # the short sample's last reader: its 0.5 GB (SmolLM2) is free for the long one
    for i in range(L):
        if losses[i]:  # none with --indexer-steps 0
            stages.progress(f"indexer of layer {i}: KL {losses[i][0]:.3f} -> {losses[i][-1]:.3f}")
    plan = Plan(ranks=ranks, sharing={}, indexers=indexers, indexer_losses=losses, params=params,
                window_search=window_table, short_fit=short_fit)
    if long_windows is not None:
        long_fit(dense, plan, long_windows, opts, device, stages)
    if budget_seqs is not None:
        t0 = time.perf_counter()
        plan.params, plan.selection_budget = selection_budget_stage(src, plan, budget_seqs, opts.hit_rate_target,
                                                                    stages, per_layer=opts.per_layer_selection,
                                                                    top_k_divisor=opts.growth)
        plan.selection_budget["seconds"] = time.perf_counter() - t0
    else:
        plan.params = bud.with_growth(plan.params, opts.growth)
        plan.selection_budget = {"mode": "fixed", "sparse_top_k": params.sparse_top_k,
                                 **({"sparse_top_k_divisor": opts.growth} if opts.growth else {})}
    calib_eval = calib[: max(4, min(SHARING_EVAL_SEQUENCES, calib.shape[0]))]
    decide_sharing(src, lowranks, stats, plan, opts, calib_eval, stages)
    if opts.kv_budget is not None and plan.sharing:
        # the budget is spent on the layers that still own a cache; refit projectors on new ranks
        owning = [i for i in range(L) if i not in plan.sharing]
        plan.ranks.update(ranks_at(lowranks, owning, opts.tolerance, opts.kv_budget, params.indexer_dim))
        for dst, f in list(plan.sharing.items()):
            plan.sharing[dst] = projector(lowranks, stats, f.source, dst, plan.ranks[f.source])
    return plan, lowranks


def long_check_windows(opts: ConvertOptions, tok: Tokenizer, bos_id: int | None,
                       cfg: Any) -> tuple[dict[int, torch.Tensor], list[str]]:
    """Held-out windows of each opts.long_check length the context and the evaluation text allow."""
    out, notes = {}, []
    for T in opts.long_check:
        if T > cfg.max_position_embeddings:
            notes.append(f"long-context check at {T} skipped: beyond max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
            continue
        try:
            out[T] = token_sequences(opts.eval_text, tok, seq_len=T, max_tokens=T * opts.long_check_windows,
                                     bos_id=bos_id, vocab_size=cfg.vocab_size)
        except DataError:
            notes.append(f"long-context check at {T} skipped: {opts.eval_text} holds fewer than {T} tokens")
    return out, notes


def convert(src: DenseSource, out: Path, opts: ConvertOptions, *, overwrite: bool = False,
            progress: Any = print, show_bars: bool | None = None) -> dict[str, Any]:
    """Convert `src`, measure it, write the checkpoint to `out`; returns the quality report."""
    from gsm.checkpoint import CheckpointFiles, write_checkpoint_arrays

    t_start = time.perf_counter()
    stages = Stages(progress, show_bars)
    if src.tokenizer_json is None:
        raise ValueError(f"{src.origin}: no tokenizer found; pass --tokenizer (the GSM checkpoint must "
                         "carry tokenizer.json so the runtime needs only the tokenizers library)")
    cfg = src.config
    lengths = check_lengths(cfg.max_position_embeddings, opts)
    for note in lengths.notes:
        progress(note)
    device = resolve_device(opts.device)
    tok = Tokenizer.from_str(src.tokenizer_json)
    # the model's own protocol: a BOS it was not trained with would skew statistics and perplexities
    bos_id = cfg.bos_token_id if add_bos_of(src.tokenizer_config) else None

    def seq(path: Path, n: int) -> torch.Tensor:
        return token_sequences(path, tok, seq_len=lengths.seq_len, max_tokens=n, bos_id=bos_id,
                               vocab_size=cfg.vocab_size)

    with stages.run("read text"):
        calib = seq(opts.calib_text, opts.calib_tokens)
        ev = seq(opts.eval_text, opts.eval_tokens) if opts.eval_text is not None else None
        budget_seqs, long_seqs, notes = None, None, list(lengths.notes)
        more: list[str] = []
        if opts.auto_top_k:
            budget_seqs, more = budget_sequences(opts.calib_text, tok, lengths, opts, bos_id, cfg.vocab_size)
        if lengths.long_fit_len:
            long_seqs, more_long = long_fit_windows(opts.calib_text, tok, lengths, opts, bos_id, cfg.vocab_size)
            more += more_long
        notes += more
        for note in more:
            progress(note)
    with stages.run("load weights"):
        src = resident(src)
    plan, lowranks = plan_model(src, opts, calib, stages, device, budget_seqs, long_seqs)
    gcfg, tensors = assemble(src, lowranks, plan)
    report: dict[str, Any] = {
        "source": src.origin,
        "calibration": {"file": str(opts.calib_text), "sha256": text_sha256(opts.calib_text),
                        "tokens": int(calib.numel()), "seq_len": int(calib.shape[1]), "bos": bos_id is not None},
        "options": {"tolerance": opts.tolerance, "kv_budget": opts.kv_budget, "sharing": opts.sharing,
                    "sharing_budget": opts.sharing_budget, "device": str(device)},
        "length_notes": notes,
        "gsm_config": gcfg.gsm.to_json(),
        "window_search": plan.window_search,
        "indexer_short_fit": plan.short_fit,
        "indexer_long_fit": plan.long_fit,
        "selection_budget": plan.selection_budget,
        "sharing_trials": plan.sharing_trials,
    }
    if ev is not None:
        with stages.run("quality report", total=quality_units(ev.shape[0], bool(plan.sharing),
                                                              len(opts.tradeoff_tolerances)),
                        unit="model passes") as advance:
            report.update(quality_report(src, gcfg, tensors, plan, lowranks, ev, opts.tradeoff_tolerances,
                                         lengths.agreement_steps, progress, advance))
        long_windows, long_notes = long_check_windows(opts, tok, bos_id, cfg)
        report["length_notes"] += long_notes
        for note in long_notes:
            progress(note)
        if long_windows:
            with stages.run("long-context check", total=long_check_units(long_windows), unit="chunks") as advance:
                report["long_context"] = long_context_check(src, gcfg, tensors, long_windows, progress, advance)
    report["stage_seconds"] = dict(stages.seconds)
    report["convert_seconds"] = time.perf_counter() - t_start
    # on a terminal the writer's own bar counts the bytes; in a log the write is timed like a stage
    bars = sys.stderr.isatty() if show_bars is None else show_bars
    with nullcontext() if bars else track("write checkpoint", log=progress, bar=False):
        files = CheckpointFiles(tokenizer_json=src.tokenizer_json, tokenizer_config=src.tokenizer_config,
                                extra={"conversion_report.json": json.dumps(report, indent=1).encode()})
        write_checkpoint_arrays(out, gcfg, KVQuantConfig(), tensors, files=files, overwrite=overwrite, progress=bars)
    return report
