"""What a converted GSM model costs in quality and buys in memory, measured on held-out text.

Everything here runs on the evaluation text only (never fitted on). Figures:
- per layer: rank, relative K/V output error (calibration and held-out), role and source, mask
  hit rate of the indexer vs a random indexer and a recency-only window of the same budget
  (under the dense model's attention), the GSM model's own hit rate (spec 4.3), KV noise of
  sharing layers (spec 4.3: KL of full causal attention with original vs projected K/V);
- perplexity of the dense model, the GSM model, and the GSM model without sharing;
- greedy-token agreement over 128 steps (teacher-forced on the dense continuation, and the
  length of the identical free-running prefix);
- KV bytes per position (spec 6) vs dense FP16, and a bytes <-> perplexity trade-off over
  several tolerances (on the first TRADEOFF_SEQUENCES evaluation sequences: one model pass per
  tolerance is the costliest part of the report).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from gsm import names
from gsm.config import KVQuantConfig, ModelConfig
from gsm.convert import indexer as ixr
from gsm.convert.plan import Plan, assemble, golden_of, mean_nll, ranks_at
from gsm.convert.svd import LowRank
from gsm.dense import DenseLlama
from gsm.golden.quant import TIER_BYTES
from gsm.golden.selection import index_scores

AGREEMENT_STEPS = 128
AGREEMENT_PROMPTS = 4
PROMPT_TOKENS = 16
TRADEOFF_SEQUENCES = 8
PROBE_SEQUENCES = 8  # evaluation sequences whose attention and GSM trace the per-layer figures come from


def _no_advance(n: int = 1) -> None:
    pass


def quality_units(n_eval: int, sharing: bool, n_tolerances: int) -> int:
    """Model passes quality_report makes over n_eval sequences (its progress units): the dense capture, the dense
    and GSM perplexities (and GSM without sharing), the GSM traces, the agreement prompts, the trade-off's dense
    reference and one pass per tolerance and sequence."""
    n_probe, n_trade = min(PROBE_SEQUENCES, n_eval), min(TRADEOFF_SEQUENCES, n_eval)
    return (1 + n_eval * (3 if sharing else 2) + n_probe + min(AGREEMENT_PROMPTS, n_eval)
            + n_trade * (1 + n_tolerances))


def kv_bytes_per_position(cfg: ModelConfig, ranks: dict[int, tuple[int, int]],
                          quant: KVQuantConfig | None = None) -> dict[str, float]:
    """Spec 6: dense FP16 baseline, GSM with every latent in FP16, and GSM under the tier fractions."""
    dense = cfg.num_hidden_layers * 2 * cfg.kv_dim * 2
    q = quant or KVQuantConfig()
    avg = sum(f * b for f, b in zip(q.tier_fractions, TIER_BYTES))
    d_idx = cfg.gsm.indexer_dim
    fp16 = sum((rk + rv) * 2 + d_idx * 2 for i, (rk, rv) in ranks.items() if cfg.is_owning(i))
    tiered = sum((rk + rv) * avg + d_idx * 2 for i, (rk, rv) in ranks.items() if cfg.is_owning(i))
    return {"dense_fp16": float(dense), "gsm_fp16": float(fp16), "gsm_tiered": float(tiered),
            "ratio_fp16": fp16 / dense, "ratio_tiered": tiered / dense,
            "tier_fractions": list(q.tier_fractions)}


def heldout_rel_error(w: torch.Tensor, lr: LowRank, r: int, x: torch.Tensor) -> float:
    U, S, Vt = lr.factors(r)
    y = x @ w.T
    return float((x @ (U @ (S[:, None] * Vt)).T - y).norm() / y.norm().clamp_min(1e-30))


def _counted(value: float, advance: Callable[[int], None]) -> float:
    """value, after counting the pass that made it."""
    advance(1)
    return value


def first_last(losses: list[float]) -> list[float]:
    """A fit's first and last recorded loss ([] when it took no step)."""
    return [losses[0], losses[-1]] if losses else []


def ppl(nll: float) -> float:
    return math.exp(nll)


def greedy_agreement(dense: DenseLlama, gsm: Any, ev: torch.Tensor, steps: int = AGREEMENT_STEPS,
                     advance: Callable[[int], None] = _no_advance) -> dict[str, float]:
    """Teacher-forced agreement and identical free-running prefix over `steps` greedy steps (`advance(1)` after
    each prompt)."""
    agree, prefix = [], []
    for row in ev[:AGREEMENT_PROMPTS]:
        prompt = row[:PROMPT_TOKENS].tolist()
        ref = dense.greedy(prompt, steps)
        logits = gsm.forward(gsm.new_cache(), prompt + ref[:-1]).logits[PROMPT_TOKENS - 1:]
        agree.append(float((logits.argmax(-1) == torch.tensor(ref)).float().mean()))
        mine = gsm.greedy(prompt, steps)
        same = next((k for k, (a, b) in enumerate(zip(mine, ref)) if a != b), steps)
        prefix.append(same)
        advance(1)
    return {"steps": steps, "prompts": len(agree), "teacher_forced": float(np.mean(agree)),
            "free_running_identical_prefix_mean": float(np.mean(prefix))}


def hit_rates(cfg: ModelConfig, plan: Plan, xs: list[torch.Tensor], probs: list[torch.Tensor]) -> dict:
    """Owning layer -> mean hit rate of indexer / random / recency under dense attention."""
    out = {}
    p = cfg.gsm
    for i in cfg.owning_layers:
        ix = plan.indexers[i]
        res: dict[str, list[float]] = {"indexer": [], "random": [], "recency": []}
        for b in range(xs[i].shape[0]):
            x, pr = xs[i][b], probs[i][b]
            T = x.shape[0]
            sc = index_scores(x, ix.q, ix.w, x @ ix.k.T, p.indexer_heads)
            lp = p.for_layer(i)  # the layer's own window and top-k
            res["indexer"].append(ixr.hit_rate(sc, pr, lp))
            res["random"].append(ixr.hit_rate(ixr.baseline_scores("random", T, seed=b), pr, lp))
            res["recency"].append(ixr.hit_rate(ixr.baseline_scores("recency", T), pr, lp))
        out[i] = {k: float(np.mean(v)) for k, v in res.items()}
    return out


@torch.no_grad()
def quality_report(src: Any, gcfg: ModelConfig, tensors: dict[str, np.ndarray], plan: Plan,
                   lowranks: dict[tuple[int, str], LowRank], ev: torch.Tensor,
                   tradeoff_tolerances: tuple[float, ...], agreement_steps: int, progress: Any,
                   advance: Callable[[int], None] = _no_advance) -> dict[str, Any]:
    """The figures of the module docstring; `advance(1)` after each model pass (quality_units: how many)."""
    dense = DenseLlama(src)
    n_probe = min(PROBE_SEQUENCES, ev.shape[0])
    _, cap = dense.forward(ev[:n_probe], capture=True, capture_probs=True)
    advance(1)
    dense_nll = float(np.mean([_counted(dense.nll(row), advance) for row in ev]))
    dense_kv = {i: (src.get(names.layer_name("k_proj", i)), src.get(names.layer_name("v_proj", i)))
                for i in gcfg.sharing_layers}
    gsm = golden_of(gcfg, tensors, dense_kv=dense_kv)
    gsm_nll = mean_nll(gsm, ev, advance)
    progress(f"held-out perplexity: dense {ppl(dense_nll):.3f}, GSM {ppl(gsm_nll):.3f}")
    if plan.sharing:
        cfg_ns, t_ns = assemble(src, lowranks, replace(plan, sharing={}))
        ns_nll = mean_nll(golden_of(cfg_ns, t_ns), ev, advance)
    else:
        ns_nll = gsm_nll
    g_hit, g_noise = gsm_signals(gsm, gcfg, ev[:n_probe], advance)
    layers = layer_rows(src, gcfg, plan, lowranks, cap, g_hit, g_noise)
    progress("measuring greedy agreement and the bytes <-> perplexity trade-off")
    tradeoff = tradeoff_rows(src, gcfg, plan, lowranks, dense, ev[:TRADEOFF_SEQUENCES], tradeoff_tolerances, advance)
    return {
        "evaluation": {"tokens": int(ev.numel()), "seq_len": int(ev.shape[1]),
                       "sequences": int(ev.shape[0])},
        "layers": layers,
        "perplexity": {"dense": ppl(dense_nll), "gsm": ppl(gsm_nll), "gsm_no_sharing": ppl(ns_nll),
                       "relative_increase": ppl(gsm_nll) / ppl(dense_nll) - 1.0},
        "greedy_agreement": greedy_agreement(dense, gsm, ev, agreement_steps, advance),
        "kv_bytes_per_position": kv_bytes_per_position(gcfg, plan.ranks),
        "tradeoff": tradeoff,
    }


def gsm_signals(gsm: Any, gcfg: ModelConfig, rows: torch.Tensor, advance: Callable[[int], None] = _no_advance
                ) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """The GSM model's own signals (spec 4.3) on the probe sequences rows [n, T]: per layer the mask hit rate of
    each sequence over its sparse query rows (1.0 where none is sparse), and per sharing layer its KV noise.
    `advance(1)` after each sequence."""
    g_hit: dict[int, list[float]] = {i: [] for i in range(gcfg.num_hidden_layers)}
    g_noise: dict[int, list[float]] = {i: [] for i in gcfg.sharing_layers}
    owner = {i: i if gcfg.is_owning(i) else gcfg.gsm.kv_sharing[i] for i in range(gcfg.num_hidden_layers)}
    for row in rows:
        tr = gsm.forward(gsm.new_cache(), row, trace=True).trace
        for i, hr in tr.hit_rate.items():
            lp = gcfg.gsm.for_layer(owner[i])
            sparse = ~torch.tensor([lp.selection_is_dense(t + 1) for t in range(row.numel())])
            g_hit[i].append(float(hr[sparse].mean()) if sparse.any() else 1.0)
        for i, kl in tr.kv_noise.items():
            g_noise[i].append(float(kl.mean()))
        advance(1)
    return g_hit, g_noise


def layer_rows(src: Any, gcfg: ModelConfig, plan: Plan, lowranks: dict[tuple[int, str], LowRank], cap: Any,
               g_hit: dict[int, list[float]], g_noise: dict[int, list[float]]) -> list[dict[str, Any]]:
    """The report's per-layer rows: the GSM model's hit rate (gsm_signals); owning layers their ranks, K/V errors on
    calibration and held-out activations (cap: the dense model's capture of the probe sequences), mask hit rates
    against the baselines and the indexer fits' losses; sharing layers their source, projector residual and KV
    noise."""
    hits = hit_rates(gcfg, plan, [cap.layers[i].x for i in range(gcfg.num_hidden_layers)],
                     [cap.layers[i].probs for i in range(gcfg.num_hidden_layers)])
    layers = []
    for i in range(gcfg.num_hidden_layers):
        rk, rv = plan.ranks[i]
        row: dict[str, Any] = {"layer": i, "role": "owning" if gcfg.is_owning(i) else "sharing",
                               "gsm_mask_hit_rate": float(np.mean(g_hit[i]))}
        if gcfg.is_owning(i):
            x_ev = cap.layers[i].x.reshape(-1, gcfg.hidden_size)
            row.update({
                "rank_k": rk, "rank_v": rv, "full_rank": gcfg.kv_dim,
                "rel_error_k_calib": lowranks[(i, "k")].rel_error(rk),
                "rel_error_v_calib": lowranks[(i, "v")].rel_error(rv),
                "rel_error_k_heldout": heldout_rel_error(src.get(names.layer_name("k_proj", i)),
                                                         lowranks[(i, "k")], rk, x_ev),
                "rel_error_v_heldout": heldout_rel_error(src.get(names.layer_name("v_proj", i)),
                                                         lowranks[(i, "v")], rv, x_ev),
                "mask_hit_rate": hits[i],
                "indexer_kl_first_last": first_last(plan.indexer_losses.get(i, [])),
                **({"indexer_long_kl_first_last": first_last(plan.indexer_long_losses[i])}
                   if i in plan.indexer_long_losses else {}),
            })
        else:
            f = plan.sharing[i]
            row.update({"source": f.source, "projector_rel_residual_calib": f.rel_residual,
                        "kv_noise_kl": float(np.mean(g_noise[i]))})
        layers.append(row)
    return layers


def tradeoff_rows(src: Any, gcfg: ModelConfig, plan: Plan, lowranks: dict[tuple[int, str], LowRank],
                  dense: DenseLlama, rows: torch.Tensor, tolerances: tuple[float, ...],
                  advance: Callable[[int], None] = _no_advance) -> list[dict[str, Any]]:
    """The bytes <-> perplexity trade-off: for each rank tolerance (no sharing) the KV bytes per position and the
    perplexity on rows [n, T] against the dense model's on the same rows (each row compared with the same tokens).
    `advance(1)` after each model pass over a sequence."""
    dense_tradeoff = ppl(float(np.mean([_counted(dense.nll(row), advance) for row in rows])))
    tradeoff = []
    L = gcfg.num_hidden_layers
    for tol in tolerances:
        r = ranks_at(lowranks, list(range(L)), tol, None, gcfg.gsm.indexer_dim)
        c, t = assemble(src, lowranks, replace(plan, ranks=r, sharing={}))
        tradeoff.append({"tolerance": tol, "sharing": "none",
                         "kv_bytes_per_position_fp16": kv_bytes_per_position(c, r)["gsm_fp16"],
                         "perplexity": ppl(mean_nll(golden_of(c, t), rows, advance)),
                         "dense_perplexity": dense_tradeoff, "sequences": int(rows.shape[0])})
        tradeoff[-1]["relative_increase"] = tradeoff[-1]["perplexity"] / dense_tradeoff - 1
    return tradeoff


# held-out window lengths of the long-context check (one window each by default): where the selection is sparse
LONG_CHECK = (2048, 4096)
LONG_CHUNK = 512  # positions per chunked prefill of the long-context check: memory is one chunk's attention


def prefill_chunks(dense: DenseLlama | None, gsm: Any, row: torch.Tensor, state: Any,
                   chunk: int | None = None, advance: Callable[[int], None] = _no_advance,
                   ) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, logits [c, V]) of each chunk of row [T] in turn, through the dense model's K/V path (state: its K/V
    list) or the golden's cache (state: a SequenceCache), the state extended in place: a long window costs
    [heads, chunk, T] of attention, never [heads, T, T]. `advance(1)` after each chunk's pass."""
    chunk = chunk or LONG_CHUNK
    for a in range(0, row.numel(), chunk):
        ids = row[a:a + chunk]
        logits = dense.run_cached(ids[None], state)[0][0] if dense is not None else gsm.forward(state, ids).logits
        advance(1)
        yield a, logits


@torch.no_grad()
def token_nll(dense: DenseLlama | None, gsm: Any, row: torch.Tensor, chunk: int | None = None,
              advance: Callable[[int], None] = _no_advance) -> torch.Tensor:
    """[T - 1] NLL of each next token of row [T] through a chunked prefill, each chunk's logits scored and dropped:
    never the [T, V] logits (805 MB at 4K for SmolLM2's vocabulary)."""
    parts = []
    for a, logits in prefill_chunks(dense, gsm, row, [] if dense is not None else gsm.new_cache(), chunk, advance):
        target = row[a + 1:a + 1 + logits.shape[0]]  # the last position of the window predicts nothing
        parts.append(torch.nn.functional.cross_entropy(logits[:target.numel()], target, reduction="none"))
    return torch.cat(parts)


def chunked_nll(dense: DenseLlama | None, gsm: Any, row: torch.Tensor,
                advance: Callable[[int], None] = _no_advance) -> float:
    """Mean next-token NLL of row [T] (token_nll)."""
    return float(token_nll(dense, gsm, row, advance=advance).mean())


def long_check_units(windows: dict[int, torch.Tensor]) -> int:
    """Chunked prefill passes of long_context_check (its progress units): dense and GSM over every window."""
    return sum(2 * seqs.shape[0] * -(-T // LONG_CHUNK) for T, seqs in windows.items())


@torch.no_grad()
def long_context_check(src: Any, gcfg: ModelConfig, tensors: dict[str, np.ndarray], windows: dict[int, torch.Tensor],
                       progress: Any, advance: Callable[[int], None] = _no_advance) -> dict[str, Any]:
    """Held-out perplexity where the selection is sparse: dense and GSM on the same long windows (seq_len -> [B, T]),
    the share of those windows' query rows whose selection is sparse in each layer, and the rows a decode step
    reads at the window's end. The short report's sequences can be shorter than the budget (then nothing of the
    selection is measured there)."""
    dense = DenseLlama(src)
    gsm = golden_of(gcfg, tensors)
    p, layers = gcfg.gsm, gcfg.owning_layers
    out = {}
    for T, seqs in windows.items():
        d = float(np.mean([chunked_nll(dense, None, row, advance) for row in seqs]))
        g = float(np.mean([chunked_nll(None, gsm, row, advance) for row in seqs]))
        sparse = float(np.mean([max(0, T - p.sink_tokens - p.selection_of(l).rows) / T for l in layers]))
        rows = p.mean_rows(layers, T)
        out[T] = {"sequences": int(seqs.shape[0]), "perplexity": {"dense": ppl(d), "gsm": ppl(g)},
                  "relative_increase": ppl(g) / ppl(d) - 1, "sparse_query_share": sparse,
                  "rows_per_step": rows, "fraction_of_dense_rows": rows / T}
        progress(f"held-out at {T} tokens ({seqs.shape[0]} windows): dense {ppl(d):.3f}, GSM {ppl(g):.3f} "
                 f"({ppl(g) / ppl(d) - 1:+.1%}), {out[T]['rows_per_step']:.0f} rows per step "
                 f"({out[T]['fraction_of_dense_rows']:.1%} of dense)")
    return out
