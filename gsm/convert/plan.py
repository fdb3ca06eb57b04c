"""The decided GSM model (`Plan`) and how it becomes tensors and a golden model.

Both the pipeline (which decides) and the quality report (which measures) need to assemble a plan
into spec-3 tensors and score it, so those pieces live here, below both: pipeline -> quality ->
plan, and nothing imports back up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from gsm import names
from gsm.config import GSMParams, ModelConfig
from gsm.convert import indexer as ixr
from gsm.convert.sharing import ProjectorFit
from gsm.convert.svd import LowRank, ranks_for_budget
from gsm.golden.model import GoldenModel
from gsm.golden.weights import GoldenWeights
from gsm.sources import DenseSource, LazyTensors

LowRanks = dict[tuple[int, str], LowRank]


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
    selection_budget: dict[str, Any] = field(default_factory=dict)  # how sparse_top_k was chosen (report)
    indexer_long_losses: dict[int, list[float]] = field(default_factory=dict)  # the long fit's KL (when it ran)
    long_fit: dict[str, Any] = field(default_factory=dict)  # its windows, rows and steps (report)
    short_fit: dict[str, Any] = field(default_factory=dict)  # the short fit's sequences and steps (report)


def resident(src: DenseSource) -> DenseSource:
    """`src` with every tensor loaded once as float32 and then shared by every reader.

    The dense forward, the assembled GSM tensors and each golden model read the same common
    weights; loading them per reader would hold the model several times (4x for a 1B model).
    """
    loaded = {n: src.get(n) for n in src.names}
    shapes = {n: tuple(t.shape) for n, t in loaded.items()}
    tensors = LazyTensors({n: (lambda t=t: t) for n, t in loaded.items()}, shapes, src.origin)
    return replace(src, tensors=tensors)


def ranks_at(lowranks: LowRanks, layers: list[int], tolerance: float, kv_budget: int | None,
             d_idx: int) -> dict[int, tuple[int, int]]:
    """Ranks of `layers` by tolerance, or, with a byte budget, by ranks_for_budget (FP16 bytes)."""
    if kv_budget is None:
        return {i: (lowranks[(i, "k")].rank_for_tolerance(tolerance),
                    lowranks[(i, "v")].rank_for_tolerance(tolerance)) for i in layers}
    values = (kv_budget - 2 * d_idx * len(layers)) // 2
    r = ranks_for_budget({key: lowranks[key] for i in layers for key in ((i, "k"), (i, "v"))}, values)
    return {i: (r[(i, "k")], r[(i, "v")]) for i in layers}


def assemble(src: DenseSource, lowranks: LowRanks, plan: Plan, *, u_grid: bool = True,
             ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and the tensors of spec 3 (float32 numpy arrays) for the planned GSM model (u_grid: U on the FP16
    grid, as the converter writes it; LowRank.factors).

    Tensors taken unchanged from a `resident` source share its memory (no copy).
    """
    sharing = {i: f.source for i, f in plan.sharing.items()}
    shared = tuple(sorted(set(sharing.values())))
    # a sharing layer follows its source's selection (spec 4.2): its own entry, chosen before sharing, goes
    own = {i: ls for i, ls in plan.params.layer_selection.items() if i not in sharing}
    p = replace(plan.params, kv_sharing=sharing, shared_layers=shared, layer_selection=own)
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
            U, S, Vt = lowranks[(i, kv)].factors(r, u_grid=u_grid)
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


def mean_nll(model: GoldenModel, ids: torch.Tensor, advance: Callable[[int], None] | None = None) -> float:
    """Token-weighted mean NLL over sequences [B, T] (each scored in one prefill; `advance(1)` after each)."""
    out = []
    for row in ids:
        out.append(model.nll(row))
        if advance is not None:
            advance(1)
    return float(np.mean(out))
