"""Dense LLaMA-family model -> GSM checkpoint: the steps, in order, as plain functions.

1. Run the dense model over calibration text and keep each layer's attention inputs, K/V outputs
   and (for a few sequences) its attention probabilities.
2. Whitened SVD of every layer's k_proj/v_proj (gsm.convert.svd); ranks from the tolerance or a
   byte budget.
3. Indexer of every layer, initialised from its projections and fitted to its attention.
4. Sharing: none, a user map, or auto (least-squares projector, best source, kept while the
   calibration perplexity cost stays within budget).
5. Assemble the tensors of spec 3, measure the result on held-out text (gsm.convert.quality),
   write the checkpoint atomically.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from gsm import names
from gsm.config import GSMParams, KVQuantConfig, ModelConfig
from gsm.convert import indexer as ixr
from gsm.convert.data import text_sha256, token_sequences
from gsm.convert.sharing import ProjectorFit, best_source, fit_projector, parse_sharing_map
from gsm.convert.svd import LowRank, input_covariance, ranks_for_budget, whitened_svd
from gsm.dense import DenseLlama
from gsm.golden.model import GoldenModel
from gsm.golden.selection import index_scores
from gsm.golden.weights import GoldenWeights
from gsm.sources import DenseSource

WINDOW_CANDIDATES = (3, 8, 16, 32, 48)


@dataclass(frozen=True)
class ConvertOptions:
    calib_text: Path
    eval_text: Path | None = None
    tolerance: float = GSMParams.kv_compression_tolerance
    kv_budget: int | None = None  # bytes per position of the FP16 latent cache (spec 6 formula)
    sharing: str = "auto"  # "auto" | "none" | "3:1,4:2"
    sharing_budget: float = 0.05  # auto: allowed relative calibration-perplexity increase
    seq_len: int = 256
    calib_tokens: int = 65536
    eval_tokens: int = 16384
    indexer_sequences: int = 32
    indexer_steps: int = 200
    seed: int = 0
    gsm: GSMParams = field(default_factory=GSMParams)
    tradeoff_tolerances: tuple[float, ...] = (0.005, 0.02, 0.05, 0.1, 0.2)
    auto_window: bool = False  # search the window/top-k split of the budget (choose_window)


@dataclass
class Activations:
    """Per layer, flattened over calibration tokens: x [N, H], k and v outputs [N, kvD]."""

    x: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    seq_x: list[torch.Tensor]  # [B_ix, T, H] inputs of the indexer sequences
    attn: list[torch.Tensor]  # [B_ix, T, T] head-summed attention of those sequences


@dataclass
class Plan:
    """Everything decided about the GSM model before its tensors are assembled."""

    ranks: dict[int, tuple[int, int]]  # every layer's (r_k, r_v) at the tolerance/budget
    sharing: dict[int, ProjectorFit]  # sharing layer -> projector
    indexers: dict[int, ixr.Indexer]
    indexer_losses: dict[int, list[float]]
    params: GSMParams = field(default_factory=GSMParams)  # selection numbers after the window search
    sharing_trials: list[dict[str, Any]] = field(default_factory=list)
    window_search: list[dict[str, Any]] = field(default_factory=list)


@torch.no_grad()
def collect(dense: DenseLlama, ids: torch.Tensor, n_attn: int) -> Activations:
    L = dense.config.num_hidden_layers
    xs: list[list[torch.Tensor]] = [[] for _ in range(L)]
    ks: list[list[torch.Tensor]] = [[] for _ in range(L)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(L)]
    seq_x: list[list[torch.Tensor]] = [[] for _ in range(L)]
    attn: list[list[torch.Tensor]] = [[] for _ in range(L)]
    for b0 in range(0, ids.shape[0], 8):
        chunk = ids[b0:b0 + 8]
        want_probs = b0 < n_attn
        _, cap = dense.forward(chunk, capture=True, capture_probs=want_probs)
        for i in range(L):
            lc = cap.layers[i]
            xs[i].append(lc.x.reshape(-1, lc.x.shape[-1]))
            ks[i].append(lc.k.reshape(-1, lc.k.shape[-1]))
            vs[i].append(lc.v.reshape(-1, lc.v.shape[-1]))
            if want_probs:
                take = min(n_attn - b0, chunk.shape[0])
                seq_x[i].append(lc.x[:take])
                attn[i].append(lc.probs[:take].sum(1))
    return Activations(
        x=[torch.cat(a) for a in xs], k=[torch.cat(a) for a in ks], v=[torch.cat(a) for a in vs],
        seq_x=[torch.cat(a) for a in seq_x], attn=[torch.cat(a) for a in attn])


def lowranks_of(src: DenseSource, acts: Activations) -> dict[tuple[int, str], LowRank]:
    out = {}
    for i in range(src.config.num_hidden_layers):
        cov = input_covariance(acts.x[i])
        for kv in ("k", "v"):
            out[(i, kv)] = whitened_svd(src.get(names.layer_name(f"{kv}_proj", i)), cov)
    return out


def ranks_at(lowranks: dict[tuple[int, str], LowRank], layers: list[int], tolerance: float,
             kv_budget: int | None, d_idx: int) -> dict[int, tuple[int, int]]:
    """Ranks of `layers` by tolerance, or, with a byte budget, by ranks_for_budget (FP16 bytes)."""
    if kv_budget is None:
        return {i: (lowranks[(i, "k")].rank_for_tolerance(tolerance),
                    lowranks[(i, "v")].rank_for_tolerance(tolerance)) for i in layers}
    values = (kv_budget - 2 * d_idx * len(layers)) // 2
    r = ranks_for_budget({key: lowranks[key] for i in layers for key in ((i, "k"), (i, "v"))}, values)
    return {i: (r[(i, "k")], r[(i, "v")]) for i in layers}


def latents(lowranks: dict[tuple[int, str], LowRank], acts: Activations, i: int,
            ranks: tuple[int, int]) -> torch.Tensor:
    """[N, r_k + r_v] latents of layer i on the calibration inputs: c = (x Vtᵀ) ⊙ S."""
    parts = []
    for kv, r in zip(("k", "v"), ranks):
        _, S, Vt = lowranks[(i, kv)].factors(r)
        parts.append((acts.x[i] @ Vt.T) * S)
    return torch.cat(parts, dim=1)


def assemble(src: DenseSource, lowranks: dict[tuple[int, str], LowRank], plan: Plan,
             ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and the tensors of spec 3 (float32 numpy arrays) for the planned GSM model."""
    sharing = {i: f.source for i, f in plan.sharing.items()}
    shared = tuple(sorted(set(sharing.values())))
    p = replace(plan.params, kv_sharing=sharing, shared_layers=shared)
    cfg = src.config.replace(gsm=p)
    t: dict[str, np.ndarray] = {names.EMBED: src.get(names.EMBED).numpy(),
                                names.FINAL_NORM: src.get(names.FINAL_NORM).numpy()}
    if not cfg.tie_word_embeddings:
        t[names.LM_HEAD] = src.get(names.LM_HEAD).numpy()
    for i in range(cfg.num_hidden_layers):
        for key in names.COMMON:
            t[names.layer_name(key, i)] = src.get(names.layer_name(key, i)).numpy()
        if i in plan.sharing:
            f = plan.sharing[i]
            t[names.layer_name("proj_w", i)] = f.weight.numpy()
            t[names.layer_name("proj_b", i)] = f.bias.numpy()
            continue
        for kv, r in zip(("k", "v"), plan.ranks[i]):
            U, S, Vt = lowranks[(i, kv)].factors(r)
            t[names.layer_name(f"{kv}_U", i)] = U.numpy()
            t[names.layer_name(f"{kv}_S", i)] = S.numpy()
            t[names.layer_name(f"{kv}_Vt", i)] = Vt.numpy()
        ix = plan.indexers[i]
        t[names.layer_name("idx_q", i)] = ix.q.numpy()
        t[names.layer_name("idx_k", i)] = ix.k.numpy()
        t[names.layer_name("idx_w", i)] = ix.w.numpy()
    return cfg, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def golden_of(cfg: ModelConfig, tensors: dict[str, np.ndarray], **kw: Any) -> GoldenModel:
    return GoldenModel(GoldenWeights.from_tensors(cfg, tensors), mode="exact", **kw)


def mean_nll(model: GoldenModel, ids: torch.Tensor) -> float:
    """Token-weighted mean NLL over sequences [B, T] (each scored in one prefill)."""
    return float(np.mean([model.nll(row) for row in ids]))


def fit_indexers(src: DenseSource, lowranks: dict[tuple[int, str], LowRank], acts: Activations,
                 params: GSMParams, steps: int, seed: int, progress: Any | None,
                 n_fit: int | None = None) -> tuple[dict[int, ixr.Indexer], dict[int, list[float]]]:
    """Indexer of every layer, fitted on the first n_fit indexer sequences (all by default)."""
    cfg = src.config
    out, losses = {}, {}
    for i in range(cfg.num_hidden_layers):
        init = ixr.init_from_projections(
            src.get(names.layer_name("q_proj", i)), lowranks[(i, "k")], acts.x[i],
            n_heads=cfg.num_attention_heads, n_kv=cfg.num_key_value_heads,
            n_idx=params.indexer_heads, d_idx=params.indexer_dim)
        out[i], losses[i] = ixr.fit(init, acts.seq_x[i][:n_fit], acts.attn[i][:n_fit], params,
                                    steps=steps, seed=seed + i)
        if progress is not None:
            progress(f"indexer of layer {i}: KL {losses[i][0]:.3f} -> {losses[i][-1]:.3f}")
    return out, losses


def window_candidates(params: GSMParams) -> list[GSMParams]:
    """Splits of the same selection budget (sinks + window + top_k) between window and top-k."""
    budget = params.sparse_window + params.sparse_top_k
    ws = sorted({params.sparse_window, *(w for w in WINDOW_CANDIDATES if w < budget)})
    return [replace(params, sparse_window=w, sparse_top_k=budget - w,
                    max_sparse_window=max(params.max_sparse_window, w)) for w in ws]


def choose_window(src: DenseSource, lowranks: dict[tuple[int, str], LowRank], acts: Activations,
                  opts: ConvertOptions, progress: Any) -> tuple[GSMParams, list[dict[str, Any]]]:
    """The window/top-k split with the best mean mask hit rate on held-in calibration sequences.

    The spec's indexer sees no positions, so it cannot reproduce the local part of attention that
    a recency window captures; a wider window absorbs that part and leaves the indexer the
    content-addressed part. Indexers are fitted briefly on 3/4 of the indexer sequences and
    scored on the other 1/4 (all calibration text: the evaluation text is never looked at).
    """
    n = acts.seq_x[0].shape[0]
    n_fit = max(1, (3 * n) // 4)
    table = []
    for p in window_candidates(opts.gsm):
        ix, _ = fit_indexers(src, lowranks, acts, p, steps=max(20, opts.indexer_steps // 4),
                             seed=opts.seed, progress=None, n_fit=n_fit)
        rates = []
        for i in range(src.config.num_hidden_layers):
            for b in range(n_fit, n):
                x = acts.seq_x[i][b]
                sc = index_scores(x, ix[i].q, ix[i].w, x @ ix[i].k.T, p.indexer_heads)
                probs = acts.attn[i][b][None] / src.config.num_attention_heads  # head mean
                rates.append(ixr.hit_rate(sc, probs, p))
        table.append({"sparse_window": p.sparse_window, "sparse_top_k": p.sparse_top_k,
                      "calib_hit_rate": float(np.mean(rates))})
        progress(f"window {p.sparse_window:3d} + top-k {p.sparse_top_k:3d}: "
                 f"calibration hit rate {table[-1]['calib_hit_rate']:.4f}")
    best = max(table, key=lambda r: (r["calib_hit_rate"], -r["sparse_window"]))
    chosen = next(p for p in window_candidates(opts.gsm) if p.sparse_window == best["sparse_window"])
    return chosen, table


def decide_sharing(src: DenseSource, lowranks: dict[tuple[int, str], LowRank],
                   acts: Activations, plan: Plan, opts: ConvertOptions, calib_eval: torch.Tensor,
                   progress: Any) -> None:
    """Fill plan.sharing according to opts.sharing (mutates plan)."""
    L = src.config.num_hidden_layers
    if opts.sharing == "none":
        return

    def targets(i: int) -> torch.Tensor:
        return torch.cat([acts.k[i], acts.v[i]], dim=1)

    if opts.sharing != "auto":
        for dst, s in parse_sharing_map(opts.sharing, L).items():
            plan.sharing[dst] = fit_projector(latents(lowranks, acts, s, plan.ranks[s]), targets(dst), s)
        return
    lat = {i: latents(lowranks, acts, i, plan.ranks[i]) for i in range(L)}
    cfg0, t0 = assemble(src, lowranks, plan)
    base = mean_nll(golden_of(cfg0, t0), calib_eval)
    rejected: set[int] = set()
    while True:
        owning = [i for i in range(L) if i not in plan.sharing]
        sources = set(f.source for f in plan.sharing.values())
        cands = [i for i in owning if i >= 1 and i not in rejected and i not in sources]
        fits = [best_source(lat, targets(i), [s for s in owning if s < i]) for i in cands
                if any(s < i for s in owning)]
        fits_by_layer = dict(zip([i for i in cands if any(s < i for s in owning)], fits))
        if not fits_by_layer:
            break
        dst, fit = min(fits_by_layer.items(), key=lambda kv: (kv[1].rel_residual, kv[0]))
        plan.sharing[dst] = fit
        cfg1, t1 = assemble(src, lowranks, plan)
        nll = mean_nll(golden_of(cfg1, t1), calib_eval)
        cost = math.exp(nll - base) - 1.0
        ok = cost <= opts.sharing_budget
        plan.sharing_trials.append({"layer": dst, "source": fit.source, "rel_residual": fit.rel_residual,
                                    "calib_ppl_increase": cost, "accepted": ok})
        progress(f"sharing layer {dst} <- {fit.source}: residual {fit.rel_residual:.3f}, "
                 f"calibration perplexity {cost:+.1%} ({'kept' if ok else 'rejected'})")
        if not ok:
            del plan.sharing[dst]
            rejected.add(dst)


def plan_model(src: DenseSource, opts: ConvertOptions, calib: torch.Tensor, progress: Any,
               ) -> tuple[Plan, dict[tuple[int, str], LowRank], Activations]:
    dense = DenseLlama(src)
    acts = collect(dense, calib, opts.indexer_sequences)
    progress(f"collected activations of {calib.numel()} calibration tokens")
    lowranks = lowranks_of(src, acts)
    L = src.config.num_hidden_layers
    params = opts.gsm
    window_table: list[dict[str, Any]] = []
    if opts.auto_window:
        params, window_table = choose_window(src, lowranks, acts, opts, progress)
    ranks = ranks_at(lowranks, list(range(L)), opts.tolerance, opts.kv_budget, params.indexer_dim)
    indexers, losses = fit_indexers(src, lowranks, acts, params, opts.indexer_steps, opts.seed, progress)
    plan = Plan(ranks=ranks, sharing={}, indexers=indexers, indexer_losses=losses, params=params,
                window_search=window_table)
    calib_eval = calib[: max(4, min(8, calib.shape[0]))]
    decide_sharing(src, lowranks, acts, plan, opts, calib_eval, progress)
    if opts.kv_budget is not None and plan.sharing:
        # the budget is spent on the layers that still own a cache; refit projectors on new ranks
        owning = [i for i in range(L) if i not in plan.sharing]
        plan.ranks.update(ranks_at(lowranks, owning, opts.tolerance, opts.kv_budget, params.indexer_dim))
        for dst, f in list(plan.sharing.items()):
            plan.sharing[dst] = fit_projector(latents(lowranks, acts, f.source, plan.ranks[f.source]),
                                              torch.cat([acts.k[dst], acts.v[dst]], dim=1), f.source)
    return plan, lowranks, acts


def convert(src: DenseSource, out: Path, opts: ConvertOptions, *, overwrite: bool = False,
            progress: Any = print) -> dict[str, Any]:
    """Convert `src`, measure it, write the checkpoint to `out`; returns the quality report."""
    from gsm.checkpoint import write_checkpoint_arrays
    from gsm.convert.quality import quality_report

    t_start = time.perf_counter()
    if src.tokenizer_json is None:
        raise ValueError(f"{src.origin}: no tokenizer found; pass --tokenizer (the GSM checkpoint must "
                         "carry tokenizer.json so the runtime needs only the tokenizers library)")
    tok = Tokenizer.from_str(src.tokenizer_json)
    cfg = src.config
    seq = lambda path, n: token_sequences(path, tok, seq_len=min(opts.seq_len, cfg.max_position_embeddings),  # noqa: E731
                                          max_tokens=n, bos_id=cfg.bos_token_id, vocab_size=cfg.vocab_size)
    calib = seq(opts.calib_text, opts.calib_tokens)
    plan, lowranks, acts = plan_model(src, opts, calib, progress)
    gcfg, tensors = assemble(src, lowranks, plan)
    report: dict[str, Any] = {
        "source": src.origin,
        "calibration": {"file": str(opts.calib_text), "sha256": text_sha256(opts.calib_text),
                        "tokens": int(calib.numel()), "seq_len": int(calib.shape[1])},
        "options": {"tolerance": opts.tolerance, "kv_budget": opts.kv_budget, "sharing": opts.sharing,
                    "sharing_budget": opts.sharing_budget},
        "gsm_config": gcfg.gsm.to_json(),
        "window_search": plan.window_search,
        "sharing_trials": plan.sharing_trials,
    }
    if opts.eval_text is not None:
        ev = seq(opts.eval_text, opts.eval_tokens)
        report.update(quality_report(src, gcfg, tensors, plan, lowranks, acts, ev, opts, progress))
    report["convert_seconds"] = time.perf_counter() - t_start
    import json

    write_checkpoint_arrays(out, gcfg, KVQuantConfig(), tensors, tokenizer_json=src.tokenizer_json,
                            tokenizer_config=src.tokenizer_config,
                            extra_files={"conversion_report.json": json.dumps(report, indent=1).encode()},
                            overwrite=overwrite)
    return report
