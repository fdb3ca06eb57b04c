"""AWQ (activation-aware weight quantisation, Lin et al. 2023; llm-awq `auto_scale`) for the projections.

Why: a few input channels of each projection carry much larger activations than the rest, and the
weights that multiply them matter most. AWQ scales input channel j of W by s_j (and the input by
1/s_j, which leaves the fp product unchanged), so the salient weights use more of the INT4 grid.
The scales are `s = mean|x|^alpha` (normalised to geometric mean 1), alpha grid-searched per group of
projections that read the same input, minimising the output error of the *quantised* projections on
a bounded sample of real activation rows. alpha = 0 is plain RTN, so on the search sample AWQ is
never worse than RTN; tests measure it on rows the search did not see.

Groups (llm-awq's, so the 1/s of a shared input can later be folded into the preceding RMSNorm
weight): (q, k, v) on the attention input, (o) on the attention output, (gate, up) on the MLP input,
(down) on the SwiGLU product. Activations come from `gsm.dense.DenseLlama` on calibration text, read
by a tap on the projection weights (no change to the forward code).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from builder.wquant import WeightQuantConfig, fake_quantize
from gsm import names
from gsm.dense import DenseLlama

GROUPS: dict[str, tuple[str, ...]] = {
    "attn_in": ("q_proj", "k_proj", "v_proj"),
    "attn_out": ("o_proj",),
    "mlp_in": ("gate_proj", "up_proj"),
    "mlp_out": ("down_proj",),
}
GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}
N_GRID = 20  # llm-awq's grid: alpha in {0, 0.05, ..., 0.95}


class _Tap(torch.Tensor):
    """A weight that reports the input of every F.linear it takes part in (then computes as usual)."""

    tap_key: tuple[int, str]
    tap_sink: ActivationCollector

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and isinstance(args[1], _Tap):
            args[1].tap_sink.record(args[1].tap_key, args[0])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


@dataclass
class InputStats:
    """One projection group's input: mean |x| per channel over every row, and a sample of rows."""

    abs_sum: np.ndarray  # [K] float64
    count: int
    rows: list[np.ndarray]  # sampled rows, [m_i, K] float32 each

    @property
    def mean_abs(self) -> np.ndarray:
        return (self.abs_sum / max(self.count, 1)).astype(np.float32)

    @property
    def sample(self) -> np.ndarray:
        return np.concatenate(self.rows, axis=0)


class ActivationCollector:
    """Per (layer, group): input statistics, `rows_per_sequence` rows sampled from each sequence."""

    def __init__(self, rows_per_sequence: int, seed: int = 0) -> None:
        self.rows_per_sequence = rows_per_sequence
        self.rng = np.random.default_rng(seed)
        self.stats: dict[tuple[int, str], InputStats] = {}
        self._pick: np.ndarray | None = None

    def begin_sequence(self, n_tokens: int) -> None:
        m = min(self.rows_per_sequence, n_tokens)
        self._pick = np.sort(self.rng.choice(n_tokens, size=m, replace=False))  # same rows for every layer

    def record(self, key: tuple[int, str], x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).float().numpy()
        st = self.stats.get(key)
        if st is None:
            st = self.stats[key] = InputStats(np.zeros(x2.shape[1]), 0, [])
        st.abs_sum += np.abs(x2).sum(axis=0, dtype=np.float64)
        st.count += x2.shape[0]
        st.rows.append(x2[self._pick].copy())


@torch.no_grad()
def collect_inputs(model: DenseLlama, sequences: Iterable[torch.Tensor], *, rows_per_sequence: int = 64,
                   seed: int = 0) -> dict[tuple[int, str], InputStats]:
    """Run the dense model over each [T] id sequence; statistics per (layer, group name)."""
    sink = ActivationCollector(rows_per_sequence, seed)
    original = dict(model.w)
    for i in range(model.config.num_hidden_layers):
        for group, keys in GROUPS.items():
            # one tap per group: the members share their input, so record it once (first member)
            name = names.layer_name(keys[0], i)
            t = torch.Tensor._make_subclass(_Tap, original[name])
            t.tap_key, t.tap_sink = (i, group), sink
            model.w[name] = t
    try:
        for ids in sequences:
            sink.begin_sequence(int(ids.shape[-1]))
            model.forward(ids.reshape(1, -1))
    finally:
        model.w.update(original)
    return sink.stats


@dataclass(frozen=True)
class AwqResult:
    """The chosen input scale of one projection group and the output errors it was chosen by."""

    alpha: float
    scales: np.ndarray  # [K] float32: quantise W diag(s), feed x / s
    error: float  # sum over the group of mean squared output error on the sample, at `alpha`
    error_rtn: float  # the same at alpha = 0 (plain RTN)


def output_error(x: np.ndarray, weights: list[np.ndarray], cfg: WeightQuantConfig, s: np.ndarray | None) -> float:
    """Sum over `weights` of mean((x W_q^T - x W^T)^2), W_q = Q(W diag(s)) diag(1/s)."""
    err = 0.0
    for w in weights:
        wq = fake_quantize(w, cfg) if s is None else fake_quantize(w * s[None, :], cfg) / s[None, :]
        err += float(np.mean((x @ (wq - w).T) ** 2))  # one product: x (W_q - W)^T
    return err


def search_scales(x: np.ndarray, mean_abs: np.ndarray, weights: list[np.ndarray], cfg: WeightQuantConfig,
                  n_grid: int = N_GRID) -> AwqResult:
    """Grid search of alpha in s = mean|x|^alpha (llm-awq auto_scale) for one group of projections."""
    x = np.asarray(x, np.float32)
    best: tuple[float, float, np.ndarray] | None = None
    rtn = 0.0
    for step in range(n_grid):
        alpha = step / n_grid
        s = np.maximum(mean_abs.astype(np.float64), 1e-4) ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        err = output_error(x, weights, cfg, None if step == 0 else s)
        if step == 0:
            rtn = err
        if best is None or err < best[0]:
            best = (err, alpha, s)
    assert best is not None
    return AwqResult(best[1], best[2], best[0], rtn)


def awq_model_scales(model: DenseLlama, stats: dict[tuple[int, str], InputStats], cfg: WeightQuantConfig,
                     *, progress=None) -> dict[tuple[int, str], AwqResult]:
    """AWQ scales for every (layer, group) of a dense model, from `collect_inputs` statistics."""
    out = {}
    for (i, group), st in sorted(stats.items()):
        ws = [model.w[names.layer_name(k, i)].float().numpy() for k in GROUPS[group]]
        out[(i, group)] = search_scales(st.sample, st.mean_abs, ws, cfg)
        if progress is not None:
            progress(i, group, out[(i, group)])
    return out


def quantized_dense_weights(model: DenseLlama, cfg: WeightQuantConfig,
                            awq: dict[tuple[int, str], AwqResult] | None = None) -> dict[str, torch.Tensor]:
    """The float32 weights a quantised dense model computes with: every projection replaced by
    Q(W diag(s)) diag(1/s) (s = 1 without AWQ); embeddings, norms and the head unchanged."""
    out = {}
    for i in range(model.config.num_hidden_layers):
        for key, group in GROUP_OF.items():
            name = names.layer_name(key, i)
            w = model.w[name].float().numpy()
            if awq is None:
                wq = fake_quantize(w, cfg, name=name)
            else:
                s = awq[(i, group)].scales
                wq = fake_quantize(w * s[None, :], cfg, name=name) / s[None, :]
            out[name] = torch.from_numpy(np.ascontiguousarray(wq, dtype=np.float32))
    return out
