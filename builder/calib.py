"""Per-layer quantisation tables `quant` [3, r] (rows s12, s8, comp8; k channels then v), spec 5.

Sources, first that exists: `--calibration FILE`, the checkpoint's kv_calibration.safetensors, or
the data-free scales of decisions "Uncalibrated checkpoints". The data-free scales are computed by
the golden's own `KVCalibration.data_free` (torch) on the few tensors it needs (S, Vt, the input
norm of each owning layer), so engine and golden quantise with bit-identical scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from gsm import names
from gsm.checkpoint import CALIB_FILE, CheckpointTensors
from gsm.config import ModelConfig
from gsm.safetensors_io import LazySafetensors


class CalibrationError(ValueError):
    """The calibration file lacks a table or has the wrong shape."""


@dataclass(frozen=True)
class QuantTables:
    tables: dict[int, np.ndarray]  # owning layer -> [3, r_k + r_v] float32
    source: str  # "file:<path>", "checkpoint", "data-free"


def default_int12_scale(s8: np.ndarray) -> np.ndarray:
    """s12 = float32(float32(s8 * 127) / 2047) (decisions "Rounding")."""
    return (s8.astype(np.float32) * np.float32(127.0)) / np.float32(2047.0)


def _from_file(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], path: Path) -> dict[int, np.ndarray]:
    f = LazySafetensors(path)
    have = set(f.names)
    out = {}
    for l in cfg.owning_layers:
        cols = []
        for kind, r in zip(("k", "v"), ranks[l]):
            rows = {}
            for what in ("scale_int8", "scale_int12", "comp_int8"):
                n = names.calib_name(l, kind, what)
                if n not in have:
                    if what == "scale_int12":
                        continue
                    raise CalibrationError(f"{path}: no table {n!r}")
                a = f.array(n).astype(np.float32)
                if a.shape != (r,):
                    raise CalibrationError(f"{path}: {n} has shape {list(a.shape)}, expected [{r}] (rank of layer {l})")
                rows[what] = a
            s12 = rows.get("scale_int12", default_int12_scale(rows["scale_int8"]))
            cols.append(np.stack([s12, rows["scale_int8"], rows["comp_int8"]]))
        out[l] = np.concatenate(cols, axis=1).astype(np.float32)
    return out


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
        out[l] = np.stack([np.concatenate([a.numpy(), b.numpy()]) for a, b in
                           ((k.scale_int12, v.scale_int12), (k.scale_int8, v.scale_int8),
                            (k.comp_int8, v.comp_int8))]).astype(np.float32)
    return out


def quant_tables(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], tensors: CheckpointTensors,
                 checkpoint_dir: Path, calibration: Path | None = None) -> QuantTables:
    if calibration is not None:
        if not calibration.is_file():
            raise CalibrationError(f"--calibration {calibration}: no such file")
        return QuantTables(_from_file(cfg, ranks, calibration), f"file:{calibration}")
    if (checkpoint_dir / CALIB_FILE).is_file():
        return QuantTables(_from_file(cfg, ranks, checkpoint_dir / CALIB_FILE), "checkpoint")
    return QuantTables(_data_free(cfg, tensors), "data-free")
