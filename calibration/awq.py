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


_T_GETTER = torch.Tensor.T.__get__
_MATMULS = (torch.Tensor.__matmul__, torch.Tensor.matmul, torch.matmul)


class _Tap(torch.Tensor):
    """A weight that reports the input of every `F.linear(x, W)` and `x @ W.T` it takes part in (then
    computes as usual): DenseLlama uses the first, the golden GSM model both."""

    tap_key: tuple[int, str]
    tap_sink: ActivationCollector

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.nn.functional.linear or func in _MATMULS) and isinstance(args[1], _Tap):
            args[1].tap_sink.record(args[1].tap_key, args[0])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func == _T_GETTER and isinstance(args[0], _Tap):  # W.T stays a tap for the `x @ W.T` that follows
            out = _tap(out, args[0].tap_key, args[0].tap_sink)
        return out


def _tap(w: torch.Tensor, key: tuple[int, str], sink: ActivationCollector) -> _Tap:
    t = torch.Tensor._make_subclass(_Tap, w)
    t.tap_key, t.tap_sink = key, sink
    return t


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
            model.w[name] = _tap(original[name], (i, group), sink)
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


# -- a GSM checkpoint: scales searched on the golden model, stored for `builder build --awq-scales` ----------
# GSM layers have no k/v projections (latent factors instead, kept float32), so the attention-input group is q
GSM_GROUPS: dict[str, tuple[str, ...]] = {"attn_in": ("q_proj",), **{g: GROUPS[g] for g in ("attn_out", "mlp_in",
                                                                                             "mlp_out")}}


@torch.no_grad()
def collect_golden_inputs(golden, sequences: Iterable[torch.Tensor], *, rows_per_sequence: int = 64,
                          seed: int = 0) -> dict[tuple[int, str], InputStats]:
    """`collect_inputs` for `gsm.golden.GoldenModel` (exact mode): one fresh cache per sequence."""
    sink = ActivationCollector(rows_per_sequence, seed)
    saved = []
    for i, lw in enumerate(golden.w.layers):
        for group, keys in GSM_GROUPS.items():
            saved.append((lw, keys[0], getattr(lw, keys[0])))
            setattr(lw, keys[0], _tap(getattr(lw, keys[0]), (i, group), sink))
    try:
        for ids in sequences:
            sink.begin_sequence(int(ids.shape[-1]))
            golden.forward(golden.new_cache(), ids.reshape(-1))
    finally:
        for lw, key, w in saved:
            setattr(lw, key, w)
    return sink.stats


def gsm_awq_scales(golden, stats: dict[tuple[int, str], InputStats], cfg: WeightQuantConfig, *,
                   progress=None) -> dict[str, AwqResult]:
    """AWQ result per projection weight name (the members of a group share it)."""
    out = {}
    for (i, group), st in sorted(stats.items()):
        lw = golden.w.layers[i]
        r = search_scales(st.sample, st.mean_abs, [getattr(lw, k).float().numpy() for k in GSM_GROUPS[group]], cfg)
        for k in GSM_GROUPS[group]:
            out[names.layer_name(k, i)] = r
        if progress is not None:
            progress(i, group, r)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m calibration.awq --checkpoint C --data TEXT --out awq_scales.safetensors`: AWQ input-channel
    scales of a GSM checkpoint's q, o, gate, up, down projections for `builder build --weights int4
    --int4-grid sym --awq-scales F` (searched for INT4 at --group-size)."""
    import argparse
    import json
    import sys
    import time
    from pathlib import Path

    from gsm.cli_support import int_at_least, run_main

    ap = argparse.ArgumentParser(prog="python -m calibration.awq", description=main.__doc__)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True, help="calibration text (or .npy / .bin token ids)")
    ap.add_argument("--out", type=Path, required=True, help="scales file (safetensors, one [K] per projection)")
    ap.add_argument("--group-size", type=int_at_least(16), default=128)
    ap.add_argument("--samples", type=int_at_least(1), default=16, help="calibration windows")
    ap.add_argument("--seq-len", type=int_at_least(3), default=512)
    ap.add_argument("--rows", type=int_at_least(1), default=16, help="activation rows sampled per window for "
                    "the search")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)

    def body() -> int:
        from calibration.data import CalibrationInputError, checkpoint_bos, checkpoint_tokenizer, load_sequences
        from gsm import checkpoint
        from gsm.checker import verify
        from gsm.golden.model import GoldenModel
        from gsm.outputs import OutputPathError, check_output_file, write_bytes_atomic

        try:
            check_output_file(a.out, flag="--out", overwrite=a.overwrite, inputs=[("--checkpoint", a.checkpoint),
                                                                                  ("--data", a.data)])
            wcfg = WeightQuantConfig(4, a.group_size)
        except (OutputPathError, ValueError) as e:
            print(f"python -m calibration.awq: error: {e}", file=sys.stderr)
            return 2
        rep = verify(a.checkpoint)
        if not rep.ok:
            print(f"python -m calibration.awq: error: {a.checkpoint} is not a valid GSM checkpoint "
                  f"(python -m gsm verify {a.checkpoint})", file=sys.stderr)
            return 2
        cfg = checkpoint.load_config(a.checkpoint)
        try:
            seqs = load_sequences(a.data, "--data", lambda: checkpoint_tokenizer(a.checkpoint, None, cfg.vocab_size),
                                  seq_len=a.seq_len, max_sequences=a.samples,
                                  bos_id=checkpoint_bos(a.checkpoint, cfg.bos_token_id), vocab_size=cfg.vocab_size)
        except CalibrationInputError as e:
            print(f"python -m calibration.awq: error: {e}", file=sys.stderr)
            return 2
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        golden = GoldenModel.from_checkpoint(a.checkpoint, mode="exact")
        stats = collect_golden_inputs(golden, list(seqs.ids), rows_per_sequence=a.rows)
        res = gsm_awq_scales(golden, stats, wcfg, progress=lambda i, g, r: print(
            f"layer {i} {g}: alpha {r.alpha:.2f}, error {r.error / max(r.error_rtn, 1e-30):.3f}x RTN", file=sys.stderr))
        from safetensors.numpy import save

        meta = {"format": checkpoint.AWQ_SCALES_FORMAT, "group_size": str(a.group_size), "bits": "4",
                "samples": str(len(seqs.ids)), "seq_len": str(a.seq_len), "data": str(a.data),
                "alphas": json.dumps({n: r.alpha for n, r in res.items()})}
        write_bytes_atomic(a.out, save({n: np.ascontiguousarray(r.scales, np.float32) for n, r in res.items()},
                                       metadata=meta))
        gain = np.mean([r.error / r.error_rtn for r in res.values() if r.error_rtn > 0])
        print(f"wrote {a.out}: {len(res)} projections, mean alpha {np.mean([r.alpha for r in res.values()]):.2f}, "
              f"search-sample error {gain:.3f}x RTN, {time.perf_counter() - t0:.0f} s")
        return 0

    return run_main("python -m calibration.awq", body, extra="convert")


if __name__ == "__main__":
    raise SystemExit(main())
