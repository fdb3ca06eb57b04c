"""ONNX Runtime backend: runs model.portable.onnx and gsm_demote.portable.onnx on the CPU (or any
ORT execution provider), holding the cache as the portable graphs define it (docs/engine_io.md 5):
dequantised float32 latents and FP16 indexer keys by position, one array per owning layer.

ONNX Runtime cannot alias an output to an input, so after each call the backend keeps the
`*_out` arrays as the next call's cache inputs (no copy: the arrays are handed over).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PORTABLE_MODEL = "model.portable.onnx"
PORTABLE_DEMOTE = "gsm_demote.portable.onnx"


@dataclass
class StepOutput:
    logits: np.ndarray  # [B, 1 or S, V] float32
    attn_mass: np.ndarray  # [B, N_max] float32
    selected: dict[int, np.ndarray] | None = None  # owning layer -> [B, S, N_max] bool (debug bundles)


class OrtBackend:
    name = "onnxruntime"

    def __init__(self, bundle: Path, cfg: dict[str, Any], *, threads: int = 0,
                 providers: list[str] | None = None) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3  # unused-initializer notes are not the user's business
        prov = providers or ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(bundle / PORTABLE_MODEL), so, providers=prov)
        self.demote_session = ort.InferenceSession(str(bundle / PORTABLE_DEMOTE), so, providers=prov)
        self.cfg = cfg
        self.out_names = [o.name for o in self.session.get_outputs()]
        self.layers = [int(l) for l in cfg["owning_layers"]]

    def new_cache(self, batch: int = 1) -> dict[str, np.ndarray]:
        n, dI = self.cfg["n_max"], self.cfg["index_dim"]
        cache = {}
        for l in self.layers:
            rk, rv = self.cfg["ranks"][str(l)]
            cache[f"latent_k.{l}"] = np.zeros((batch, n, rk), np.float32)
            cache[f"latent_v.{l}"] = np.zeros((batch, n, rv), np.float32)
            cache[f"index_keys.{l}"] = np.zeros((batch, n, dI), np.float16)
        return cache

    def forward(self, cache: dict[str, np.ndarray], ids: np.ndarray, past: np.ndarray, new: np.ndarray,
                sparse_window: int) -> StepOutput:
        """One call over ids [B, S] at positions past[b]..; updates `cache` in place (dict entries)."""
        feeds = dict(cache)
        feeds.update(input_ids=ids.astype(np.int64), past_lengths=past.astype(np.int32),
                     new_lengths=new.astype(np.int32), sparse_window=np.array([sparse_window], np.int32))
        outs = dict(zip(self.out_names, self.session.run(None, feeds)))
        for l in self.layers:
            for k in ("latent_k", "latent_v", "index_keys"):
                cache[f"{k}.{l}"] = outs[f"{k}_out.{l}"]
        sel = {l: outs[f"selected.{l}"] for l in self.layers} if f"selected.{self.layers[0]}" in outs else None
        return StepOutput(outs["logits"], outs["attn_mass"], sel)

    def demote(self, cache: dict[str, np.ndarray], new_tier: np.ndarray) -> None:
        """Re-encode the rows whose new_tier [B, N_max] is >= 0 (the portable GsmKVDemote)."""
        feeds: dict[str, np.ndarray] = {"new_tier": new_tier.astype(np.int32)}
        for l in self.layers:
            feeds[f"latent_k.{l}"] = cache[f"latent_k.{l}"]
            feeds[f"latent_v.{l}"] = cache[f"latent_v.{l}"]
        names = [o.name for o in self.demote_session.get_outputs()]
        for name, arr in zip(names, self.demote_session.run(None, feeds)):
            cache[name.replace("_out", "")] = arr
