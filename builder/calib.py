"""Per-layer quantisation tables `quant` [5, r] (rows s12, s8, comp8, s4, comp4; k channels then v), spec 5.

Sources, first that exists: `--calibration FILE`, the checkpoint's kv_calibration.safetensors, or
the data-free scales of decisions "Uncalibrated checkpoints". The data-free scales are computed by
the golden's own `KVCalibration.data_free` (torch) on the few tensors it needs (S, Vt, the input
norm of each owning layer), so engine and golden quantise with bit-identical scales.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from gsm import names
from gsm.checkpoint import CALIB_FILE, CheckpointTensors
from gsm.config import ModelConfig
from gsm.quant_table import TABLE_ROWS, table_of
from gsm.safetensors_io import LazySafetensors
from gsm.tiers import NAMES as TIER_NAMES


class CalibrationError(ValueError):
    """The calibration file lacks a table or has the wrong shape."""


@dataclass(frozen=True)
class QuantTables:
    tables: dict[int, np.ndarray]  # owning layer -> [5, r_k + r_v] float32 (TABLE_ROWS)
    int4_fitted: bool  # every latent has INT4 scales fitted on text: only then may rows be INT4
    source: str  # "file:<path>", "checkpoint", "data-free"
    # owning layer -> [dI] float32 INT8 indexer-key scale, when the file has one for every owning layer
    key_scales: dict[int, np.ndarray] | None = None


def _key_scales(cfg: ModelConfig, path: Path) -> dict[int, np.ndarray] | None:
    """The INT8 indexer-key scales of every owning layer, None when the file has none; some only: refused."""
    f = LazySafetensors(path)
    want = {l: names.index_key_scale_name(l) for l in cfg.owning_layers}
    have = [l for l, n in want.items() if n in f.names]
    if not have:
        return None
    if len(have) != len(want):
        missing = [n for l, n in want.items() if l not in have]
        raise CalibrationError(f"{path}: INT8 indexer-key scales for some owning layers only; missing {missing[:3]}"
                               f"{' ...' if len(missing) > 3 else ''} (rerun `python -m calibration run`)")
    out = {}
    for l, n in want.items():
        a = f.array(n).astype(np.float32)
        if a.shape != (cfg.gsm.indexer_dim,) or not np.isfinite(a).all() or (a <= 0).any():
            raise CalibrationError(f"{path}: {n} must be {cfg.gsm.indexer_dim} positive finite values (the indexer "
                                   f"dim), got shape {list(a.shape)}")
        out[l] = a
    return out


def has_key_scales(path: Path) -> bool:
    """The calibration file holds INT8 indexer-key scales (checked before planning, as has_int4_tables)."""
    return _holds(path, (".index_key.scale_int8",))


def head_input_moment(path: Path, hidden: int) -> np.ndarray | None:
    """The calibration file's LM-head input moment [H, H] (names.HEAD_INPUT_MOMENT), None when it has none or
    does not read; a wrong shape is refused by name."""
    try:
        f = LazySafetensors(path)
        if names.HEAD_INPUT_MOMENT not in f.names:
            return None
    except (OSError, ValueError):
        return None
    if tuple(f.shape(names.HEAD_INPUT_MOMENT)) != (hidden, hidden):
        raise CalibrationError(f"{path}: {names.HEAD_INPUT_MOMENT} has shape {list(f.shape(names.HEAD_INPUT_MOMENT))}, "
                               f"expected [{hidden}, {hidden}] (the hidden size, twice)")
    return np.asarray(f.array(names.HEAD_INPUT_MOMENT), np.float64)


def _from_file(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], path: Path) -> tuple[dict[int, np.ndarray], bool]:
    """The tables and whether every latent has fitted INT4 scales."""
    f = LazySafetensors(path)
    have = set(f.names)
    out, int4 = {}, True
    for l in cfg.owning_layers:
        cols = []
        for kind, r in zip(("k", "v"), ranks[l]):
            rows = {}
            for what in names.CALIB_TENSORS:
                n = names.calib_name(l, kind, what)
                if n not in have:
                    if what not in names.CALIB_REQUIRED:
                        continue
                    raise CalibrationError(f"{path}: no table {n!r}")
                a = f.array(n).astype(np.float32)
                if a.shape != (r,):
                    raise CalibrationError(f"{path}: {n} has shape {list(a.shape)}, expected [{r}] (rank of layer {l})")
                rows[what] = a
            int4 = int4 and "scale_int4" in rows and "comp_int4" in rows
            cols.append(table_of(rows))
        out[l] = np.concatenate(cols, axis=1).astype(np.float32)
    return out, int4


def _data_free(cfg: ModelConfig, tensors: CheckpointTensors) -> dict[int, np.ndarray]:
    import torch

    from gsm.golden.weights import KVCalibration

    layers, owning = {}, {}
    for l in cfg.owning_layers:
        def t(key: str, l: int = l) -> torch.Tensor:
            return torch.from_numpy(tensors.array(names.layer_name(key, l))).float()
        layers[l] = SimpleNamespace(input_norm=t("input_norm"))
        owning[l] = SimpleNamespace(k_S=t("k_S"), k_Vt=t("k_Vt"), v_S=t("v_S"), v_Vt=t("v_Vt"))
    duck = SimpleNamespace(cfg=cfg, layers=layers, owning=owning.__getitem__)
    cal = KVCalibration.data_free(duck)  # type: ignore[arg-type]  # reads only the fields above
    out = {}
    for l in cfg.owning_layers:
        k, v = cal.scales[(l, "k")], cal.scales[(l, "v")]
        out[l] = np.stack([np.concatenate([getattr(k, w).numpy(), getattr(v, w).numpy()])
                           for w in TABLE_ROWS]).astype(np.float32)
    return out


def has_int4_tables(path: Path) -> bool:
    """The calibration file holds fitted INT4 scales (checked before planning; the build refuses a file that holds
    them for only some latents once it reads the tables)."""
    return _holds(path, (".scale_int4", ".comp_int4"))


def _holds(path: Path, suffixes: tuple[str, ...]) -> bool:
    """The file holds a tensor whose name ends in one of `suffixes` (False when it does not read)."""
    try:
        return any(n.endswith(suffixes) for n in LazySafetensors(path).names)
    except (OSError, ValueError):
        return False


def quant_tables(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], tensors: CheckpointTensors,
                 checkpoint_dir: Path, calibration: Path | None = None) -> QuantTables:
    if calibration is not None:
        if not calibration.is_file():
            raise CalibrationError(f"--calibration {calibration}: no such file")
        return QuantTables(*_from_file(cfg, ranks, calibration), source=f"file:{calibration}",
                           key_scales=_key_scales(cfg, calibration))
    if (checkpoint_dir / CALIB_FILE).is_file():
        path = checkpoint_dir / CALIB_FILE
        return QuantTables(*_from_file(cfg, ranks, path), source="checkpoint", key_scales=_key_scales(cfg, path))
    return QuantTables(_data_free(cfg, tensors), False, "data-free")


def tier_noise(report_path: Path) -> dict[str, float]:
    """Tier name -> the relative error calibration measured for that tier over every owning layer's K and V latents:
    the RMS of the report's per-latent `rel_rms`, each weighted by its rank (a re-tier pass's KV noise is a norm over
    all re-encoded values, and a latent holds rank values a row). {} when the file does not exist; CalibrationError
    naming the file and field when it is not a calibration report."""
    if not report_path.is_file():
        return {}
    try:
        layers = json.loads(report_path.read_text(encoding="utf-8"))["layers"]
        sums: dict[str, list[float]] = {}
        for entry in layers:
            for tier in TIER_NAMES:
                if tier in entry:
                    s = sums.setdefault(tier, [0.0, 0.0])
                    s[0] += int(entry["rank"]) * float(entry[tier]["rel_rms"]) ** 2
                    s[1] += int(entry["rank"])
    except (ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"{report_path}: not a calibration report (layers[*].rank and layers[*].<tier>.rel_rms "
                               f"expected: {type(e).__name__} {e})") from None
    return {t: math.sqrt(a / n) for t, (a, n) in sums.items() if n > 0 and math.isfinite(a)}
