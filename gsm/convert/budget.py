"""The selection budget (`sparse_top_k`) as a measured choice: mask hit rate as a function of top-k.

A fixed top-k covers a shrinking share of attention as the context grows (SmolLM2, 68 positions:
hit rate 0.92 at 256 tokens, 0.74 at 2K, +81 % perplexity at 2K; docs/quality.md). So the
converter measures, at a long context on calibration text, the hit rate of the fitted indexers for
every top-k of a ladder, and keeps the smallest top-k that reaches a target (docs/decisions.md
"Selection budget").

One sort per query row gives the whole curve: with the candidates (causal, neither sink nor window)
in descending score order, the mass that top-k selects is the sum of the first k sorted masses, so
hit(k) = mass(sinks ∪ window) + cumsum(sorted candidate mass)[k - 1]. Only per-layer sums and row
counts are accumulated; the attention itself is formed one block of query rows at a time and
dropped (a [heads, block, T] slice, never [heads, T, T]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from gsm.config import GSMParams, LayerSelection
from gsm.golden import attention as A
from gsm.golden.selection import index_scores

LADDER = (64, 128, 256, 512, 1024, 2048)
# the per-layer choice's finer ladder: a layer that needs few rows should not pay for 64 (0: sinks + window only)
LAYER_LADDER = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# SmolLM2 at 2K, per-layer selection with the long-fit indexer and the wider windows (docs/quality.md section 0; 2
# held-out windows): mean hit rate 0.95 -> 303 rows per step, +1.13 % perplexity; 0.955 -> 320 rows (15.6 % of
# dense), +0.82 %. 0.955 is the least of these that keeps 2K within +1 % (window 32 only needed 0.95 and 331 rows
# for +0.80 %). docs/decisions.md: why a hit rate
HIT_RATE_TARGET = 0.955
BUDGET_SEQ_LEN = 2048  # the context the curve is measured at (clamped to the model's)
BUDGET_SEQUENCES = 2  # calibration sequences of BUDGET_SEQ_LEN the curve is measured on
PREFILL_CHUNK = 256  # positions per chunk of the dense prefill the curve is measured through
# the top-k chosen at BUDGET_SEQ_LEN is a floor that grows to (t + 1) // TOP_K_DIVISOR past it (0: a fixed count).
# 16: SmolLM2's chosen floors stay as they are to 2K (one layer of 22 grows there) and the mean rows at 8K stay
# within 1/16 of dense (508); held-out 4K +1.96 -> +1.81 %, 8K +4.13 -> +3.26 % (docs/quality.md section 0)
TOP_K_DIVISOR = 16
SELECTORS = ("indexer", "recency")
# Wider windows offered beside a smaller indexer top-k at the same rows (selector `indexer+w{W}`): the indexer sees
# no positions, so a layer's local attention is the window's to catch. SmolLM2 at 4-8K, equal rows per query (the
# mean over its 22 indexer layers, each better): window 128 beside the indexer captured 0.904 of the dense attention,
# window 256 0.916, window 32 0.864 (docs/quality.md section 0)
WIDE_WINDOWS = (128, 256)


def wide_selector(window: int) -> str:
    """The curve's name for the indexer beside a window of `window` positions."""
    return f"indexer+w{window}"


def selected_mass(scores: torch.Tensor, probs: torch.Tensor, q_pos: torch.Tensor, sinks: int, window: int,
                  ks: Sequence[int]) -> torch.Tensor:
    """Attention mass of Sel(t) = sinks ∪ window ∪ top-k(scores) for every k at once: [b, len(ks)].

    scores: [b, n] selection scores of query rows at absolute positions q_pos [b] over cached
    positions 0..n-1; probs: [b, n] their attention (mean over heads: the hit rate is linear in it).
    Ties are broken as gsm.golden.selection.select does (stable sort: the lower position first).
    Rows where the selection would be dense are not special-cased here: see `sparse_rows`.
    """
    n = scores.shape[-1]
    s = torch.arange(n)
    causal = s[None, :] <= q_pos[:, None]
    fixed = causal & ((s[None, :] < sinks) | (s[None, :] > q_pos[:, None] - window))
    cand = causal & ~fixed
    base = (probs * fixed).sum(-1)  # [b]
    order = torch.sort(scores.masked_fill(~cand, float("-inf")), dim=-1, descending=True, stable=True).indices
    cum = torch.gather(probs * cand, 1, order).cumsum(-1)  # non-candidates sort last and add nothing
    cols = torch.tensor([min(k, n) - 1 for k in ks])
    top = torch.where(cols[None, :] >= 0, cum[:, cols.clamp_min(0)], torch.zeros(()))
    return base[:, None] + top


def sparse_rows(q_pos: torch.Tensor, sinks: int, window: int, ks: Sequence[int]) -> torch.Tensor:
    """[b, len(ks)]: whether row t's selection is sparse at top-k (spec 4.1: t + 1 > sinks + window + k)."""
    return (q_pos[:, None] + 1) > torch.tensor([sinks + window + k for k in ks])[None, :]


@dataclass
class HitRateCurve:
    """Per-layer, per-selector sums of the selected mass over sparse query rows, for every k of `ks`.

    k counts the rows beyond sinks + the model's window for every selector: `recency` reads them as a longer
    window, `indexer+w{W}` as a window of W and an indexer top-k of k - (W - window) (nan where k is too small)."""

    ks: tuple[int, ...]
    n_layers: int
    wide: tuple[int, ...] = WIDE_WINDOWS  # the wider windows offered beside the indexer
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # selector -> [L, K] float64
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [L, K] sparse rows counted

    def __post_init__(self) -> None:
        shape = (self.n_layers, len(self.ks))
        self.sums = {s: np.zeros(shape) for s in self.selectors}
        self.rows = np.zeros(shape, dtype=np.int64)

    @property
    def windows(self) -> dict[str, int]:
        """The wide selectors' windows by name."""
        return {wide_selector(w): w for w in self.wide}

    @property
    def selectors(self) -> tuple[str, ...]:
        return (*SELECTORS, *self.windows)

    def add(self, layer: int, selector: str, mass: torch.Tensor, sparse: torch.Tensor) -> None:
        """mass, sparse: [b, K] from selected_mass / sparse_rows for one block of query rows."""
        self.sums[selector][layer] += (mass.double() * sparse).sum(0).numpy()
        if selector == SELECTORS[0]:
            self.rows[layer] += sparse.sum(0).numpy()

    def per_layer(self, selector: str = "indexer") -> np.ndarray:
        """[L, K] hit rate (nan where no row was sparse at that k)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.rows > 0, self.sums[selector] / np.maximum(self.rows, 1), np.nan)

    def mean(self, selector: str = "indexer") -> np.ndarray:
        """[K] hit rate averaged over layers (each layer weighs the same, as the quality report does)."""
        return self.per_layer(selector).mean(0)

    def measured_ks(self) -> list[int]:
        """The ks with sparse rows in every layer (a k the context cannot exceed tells nothing)."""
        return [k for j, k in enumerate(self.ks) if (self.rows[:, j] > 0).all()]

    def to_json(self) -> list[dict[str, Any]]:
        out = []
        for j, k in enumerate(self.ks):
            if k not in self.measured_ks():
                continue
            out.append({"sparse_top_k": k, "hit_rate": float(self.mean("indexer")[j]),
                        "recency_hit_rate": float(self.mean("recency")[j]),
                        "sparse_rows_per_layer": int(self.rows[0, j]),
                        "per_layer": [round(float(v), 4) for v in self.per_layer("indexer")[:, j]]})
        return out


def add_block(curve: HitRateCurve, layer: int, scores: torch.Tensor, probs: torch.Tensor, q_pos: torch.Tensor,
              sinks: int, window: int) -> None:
    """Accumulate one block of query rows: index scores [b, n] and head-mean attention [b, n] at q_pos [b]."""
    sparse = sparse_rows(q_pos, sinks, window, curve.ks)
    curve.add(layer, "indexer", selected_mass(scores, probs, q_pos, sinks, window, curve.ks), sparse)
    n = scores.shape[-1]
    rec = torch.arange(n, dtype=torch.float32)[None].expand(q_pos.numel(), n)
    curve.add(layer, "recency", selected_mass(rec, probs, q_pos, sinks, window, curve.ks), sparse)
    for name, w in curve.windows.items():  # the same rows as window + k, as a window of w and a smaller top-k
        extra = w - window
        valid = torch.tensor([extra > 0 and k >= extra for k in curve.ks])
        mass = selected_mass(scores, probs, q_pos, sinks, w, [max(k - extra, 0) for k in curve.ks])
        curve.add(layer, name, mass.masked_fill(~valid[None, :], float("nan")), sparse)


@torch.no_grad()
def add_layer(curve: HitRateCurve, layer: int, x_own: torch.Tensor, indexer: Any, n_idx: int, q: torch.Tensor,
              k: torch.Tensor, sinks: int, window: int, block: int = 256) -> None:
    """Accumulate one sequence of one layer into `curve`.

    x_own: [T, H] input of the layer whose indexer selects (itself, or its sharing source); indexer: its weights
    .q [nI*dI, H], .k [dI, H], .w [nI, H] (gsm.convert.indexer.Indexer, as add_sequence takes them);
    q: [nH, T, D], k: [nKV, T, D] RoPE'd dense queries/keys of the scored layer.
    """
    T = x_own.shape[0]
    keys = x_own @ indexer.k.T  # [T, dI]
    first = sinks + window + min(curve.ks) if curve.ks else T  # earlier rows are dense for every k
    for a in range(first, T, block):
        q_pos = torch.arange(a, min(a + block, T))
        probs = A.attention_probs(q[:, q_pos], k, A.causal_mask(q_pos, T)).mean(0)  # [b, T]
        add_block(curve, layer, index_scores(x_own[q_pos], indexer.q, indexer.w, keys, n_idx), probs, q_pos, sinks,
                  window)


def chunk_row_attention(cfg: Any, chunk_q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, pick: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Head-mean dense attention [r, n] of a prefill chunk's query rows `pick` (a mask or indices into q_pos, the
    chunk's positions) over the n cached RoPE'd keys k [nKV, n, D]; chunk_q [c, nH*D] is the chunk's captured
    pre-RoPE queries, cos/sin its RoPE tables."""
    q = A.apply_rope(chunk_q.float().view(-1, cfg.num_attention_heads, cfg.head_dim).transpose(0, 1), cos, sin)
    return A.attention_probs(q[:, pick], k, A.causal_mask(q_pos[pick], k.shape[1])).mean(0)


@torch.no_grad()
def add_sequence(curve: HitRateCurve, dense: Any, ids: torch.Tensor, indexers: Sequence[Any], n_idx: int,
                 sinks: int, window: int, chunk: int = PREFILL_CHUNK,
                 advance: Callable[[int], None] | None = None) -> None:
    """Accumulate one sequence ids [T], every layer scored with its own indexer (.q, .k, .w).

    The dense model runs as a chunked prefill (its K/V cache path, `chunk` positions at a time), and each
    chunk's query rows are scored against the cached RoPE'd keys right away: memory holds the K/V cache,
    the indexer keys and one chunk's activations, never a [heads, T, T] attention nor every layer's
    activations (a whole-sequence capture at 2K added 3.4 GB to a 1B model's conversion). `advance(1)` after
    each chunk.
    """
    cfg = dense.config
    T = ids.numel()
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    keys: list[torch.Tensor] = [torch.zeros(0, ix.k.shape[0]) for ix in indexers]
    first = sinks + window + min(curve.ks) if curve.ks else T
    for a in range(0, T, chunk):
        q_pos = torch.arange(a, min(a + chunk, T))
        _, layers = dense.run_cached(ids[None, a:a + chunk], kv, capture=True)  # extends kv in place
        cos, sin = A.rope_tables(q_pos, cfg.head_dim, cfg.rope_theta)
        for i, lc in enumerate(layers):
            ix = indexers[i]
            x = lc.x[0].float()
            keys[i] = torch.cat([keys[i], x @ ix.k.T])
            rows = q_pos >= first
            if not rows.any():
                continue
            probs = chunk_row_attention(cfg, lc.q[0], kv[i][0][0], q_pos, rows, cos, sin)
            add_block(curve, i, index_scores(x[rows], ix.q, ix.w, keys[i], n_idx), probs, q_pos[rows], sinks, window)
        if advance is not None:
            advance(1)


def rope_qk(cap_q: torch.Tensor, cap_k: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
            theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Captured pre-RoPE projections [T, nH*D], [T, kvD] -> RoPE'd [nH, T, D], [nKV, T, D]."""
    T = cap_q.shape[0]
    cos, sin = A.rope_tables(torch.arange(T), head_dim, theta)
    q = A.apply_rope(cap_q.float().view(T, n_heads, head_dim).transpose(0, 1), cos, sin)
    k = A.apply_rope(cap_k.float().view(T, n_kv, head_dim).transpose(0, 1), cos, sin)
    return q, k


def choose_top_k(curve: HitRateCurve, target: float) -> tuple[int, bool]:
    """The smallest measured k whose mean hit rate reaches `target`; (largest measured k, False) when none does."""
    ks = curve.measured_ks()
    if not ks:
        raise ValueError("no top-k of the ladder leaves a sparse query row at the measurement length")
    mean = dict(zip(curve.ks, curve.mean("indexer")))
    for k in ks:
        if mean[k] >= target:
            return k, True
    return ks[-1], False


@dataclass(frozen=True)
class LayerChoice:
    """One layer's option, all reading sinks + window + k rows: the indexer's top-k beside the window, (recency) a
    longer window, or the indexer beside a wider window `wide` with the top-k k - (wide - window)."""

    selector: str  # "indexer", "recency" or a wide selector ("indexer+w{W}")
    k: int
    hit_rate: float
    wide: int = 0  # the wide selector's window

    def selection(self, window: int) -> LayerSelection:
        if self.selector == "recency":
            return LayerSelection(window + self.k, 0)
        if self.wide:
            return LayerSelection(self.wide, self.k - (self.wide - window))
        return LayerSelection(window, self.k)


def layer_options(curve: HitRateCurve) -> list[list[LayerChoice]]:
    """Per layer, every measured (selector, k) with its hit rate (a wide selector where its window leaves the k);
    rows read = sinks + window + k for all."""
    ks = curve.measured_ks()
    cols = [curve.ks.index(k) for k in ks]
    per = {s: curve.per_layer(s) for s in curve.selectors}
    wide = curve.windows
    return [[LayerChoice(s, k, float(per[s][i, j]), wide.get(s, 0)) for s in curve.selectors
             for k, j in zip(ks, cols) if not np.isnan(per[s][i, j])] for i in range(curve.n_layers)]


def _pick(options: list[list[LayerChoice]], lam: float) -> list[LayerChoice]:
    """Each layer's option minimising missed mass + lam * rows (ties: fewer rows, then the indexer)."""
    return [min(opts, key=lambda o: (1 - o.hit_rate + lam * o.k, o.k, o.selector != "indexer")) for opts in options]


def allocate(curve: HitRateCurve, target: float) -> tuple[list[LayerChoice], bool]:
    """Each layer's selector and k with the fewest mean rows whose mean hit rate reaches `target`.

    The mean hit rate over layers is the same target the uniform choice uses (choose_top_k), so at the same
    target the per-layer allocation reads fewer rows: a local layer reaches a high hit rate with a short window,
    a layer that attends far back gets the indexer's rows. Lagrangian: for a price lam per row each layer takes its
    cheapest option (missed mass + lam * rows); mean hit rate falls as lam grows, so lam is bisected to the largest
    price that still reaches the target. (Choices on the convex hull of each layer's curve only: the price sweep
    cannot reach a point inside it, which costs a few rows at most.) When even lam = 0 misses the target, every
    layer's best option is returned and the flag says so."""
    options = layer_options(curve)
    if not options or not options[0]:
        raise ValueError("no top-k of the ladder leaves a sparse query row at the measurement length")

    def mean_hit(picks: list[LayerChoice]) -> float:
        return float(np.mean([o.hit_rate for o in picks]))

    best = _pick(options, 0.0)
    if mean_hit(best) < target:
        return best, False
    lo, hi = 0.0, 1.0
    while mean_hit(_pick(options, hi)) >= target and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_hit(_pick(options, mid)) >= target else (lo, mid)
    return _pick(options, lo), True


def wide_divisor(divisor: int, extra: int, context: int) -> int:
    """The divisor of a layer whose window is `extra` positions wider than the model's: the smallest d >= divisor
    whose growth at `context` is at most context // divisor - extra, so the layer reads at the model's context what
    a model-window layer with `divisor` reads (its window took those rows from the top-k); 0 (a fixed top-k) when
    the window takes them all."""
    room = context // divisor - extra
    if room <= 0:
        return 0
    return max(divisor, -(-(context + 1) // (room + 1)))


def with_growth(p: GSMParams, divisor: int, context: int = 0) -> GSMParams:
    """p with every layer that picks by the indexer (top-k > 0) growing its top-k to (t + 1) // divisor at
    position t (docs/decisions.md "A budget that grows with the context"); streaming layers (sinks + window)
    stay as they are, the anchors' streaming heads. A layer with a wider window than p's grows by
    wide_divisor(divisor, its extra window, context) when `context` (the model's) is given. divisor 0: p
    unchanged."""
    if divisor == 0:
        return p

    def grown(ls: LayerSelection) -> LayerSelection:
        extra = ls.sparse_window - p.sparse_window
        d = wide_divisor(divisor, extra, context) if context and extra > 0 else divisor
        return replace(ls, sparse_top_k_divisor=d)

    per = {i: grown(ls) if ls.sparse_top_k > 0 else ls for i, ls in p.layer_selection.items()}
    return replace(p, layer_selection=per, sparse_top_k_divisor=divisor if p.sparse_top_k > 0 else 0)


def fit_growth(p: GSMParams, divisor: int, context: int, layers: Sequence[int]) -> GSMParams:
    """with_growth at the smallest divisor >= `divisor` (at most 4x) whose rows per step at `context` (the model's),
    averaged over `layers`, stay within context / divisor: the share of dense the growth is for. With windows wider
    than the model's a layer that streamed at the measurement length may pick by the indexer instead, and its growth
    then has to come out of everyone's."""
    if divisor == 0:
        return p
    for d in range(divisor, 4 * divisor + 1):
        g = with_growth(p, d, context)
        if g.mean_rows(list(layers), context) <= context / divisor:
            return g
    return g


def rows_per_step(p: Any, layers: Sequence[int], contexts: Sequence[int]) -> dict[int, dict[str, float]]:
    """Rows a decode step reads, averaged over layers, at each context: absolute and as a share of dense (t)."""
    rows = {n: p.mean_rows(list(layers), n) for n in contexts}
    return {n: {"rows": r, "fraction_of_dense": r / n} for n, r in rows.items()}
