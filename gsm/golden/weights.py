"""Weights and calibration tables of the golden model, gathered from checkpoint tensors by name table."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gsm import names
from gsm.config import ModelConfig
from gsm.golden.quant import default_int4_scale, default_int12_scale


@dataclass
class OwningKV:
    """Latent factors and indexer of a KV-owning layer (spec 3)."""

    k_U: torch.Tensor  # [kvD, r_k]
    k_S: torch.Tensor  # [r_k]
    k_Vt: torch.Tensor  # [r_k, H]
    v_U: torch.Tensor  # [kvD, r_v]
    v_S: torch.Tensor  # [r_v]
    v_Vt: torch.Tensor  # [r_v, H]
    idx_q: torch.Tensor  # [nI*dI, H]
    idx_k: torch.Tensor  # [dI, H]
    idx_w: torch.Tensor  # [nI, H]

    @property
    def ranks(self) -> tuple[int, int]:
        return self.k_S.numel(), self.v_S.numel()


@dataclass
class SharingKV:
    """kv_projector of a KV-sharing layer: [Kpre; V] = W [c_k; c_v] + b (spec 4.2)."""

    source: int
    weight: torch.Tensor  # [2*kvD, r_k(s) + r_v(s)]
    bias: torch.Tensor  # [2*kvD]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    kv: OwningKV | SharingKV


def layer_weights(cfg: ModelConfig, i: int, t: Callable[[str], torch.Tensor]) -> LayerWeights:
    """Layer i's weights, each tensor by its checkpoint name from `t` (float32)."""
    def per_layer(table: dict[str, str]) -> dict[str, torch.Tensor]:
        return {k: t(v.format(i=i)) for k, v in table.items()}

    if cfg.is_owning(i):
        kv: OwningKV | SharingKV = OwningKV(**per_layer(names.OWNING))
    else:
        p = per_layer(names.SHARING)
        kv = SharingKV(source=cfg.gsm.kv_sharing[i], weight=p["proj_w"], bias=p["proj_b"])
    return LayerWeights(kv=kv, **per_layer(names.COMMON))


@dataclass
class GoldenWeights:
    cfg: ModelConfig
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding when tied)
    layers: Sequence[LayerWeights] = field(default_factory=list)  # a list, or one that loads each layer when read

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: Mapping[str, np.ndarray | torch.Tensor]) -> GoldenWeights:
        def t(name: str) -> torch.Tensor:
            v = tensors[name]
            return (torch.from_numpy(np.asarray(v)) if not isinstance(v, torch.Tensor) else v).float()

        embed = t(names.EMBED)
        lm_head = embed if cfg.tie_word_embeddings else t(names.LM_HEAD)
        layers = [layer_weights(cfg, i, t) for i in range(cfg.num_hidden_layers)]
        return cls(cfg=cfg, embed=embed, final_norm=t(names.FINAL_NORM), lm_head=lm_head, layers=layers)

    def owning(self, i: int) -> OwningKV:
        kv = self.layers[i].kv
        assert isinstance(kv, OwningKV), f"layer {i} does not own a KV cache"
        return kv

    @property
    def ranks(self) -> dict[int, tuple[int, int]]:
        return {i: self.owning(i).ranks for i in self.cfg.owning_layers}


@dataclass
class LatentScales:
    """Per-channel quantisation constants of one latent (c_k or c_v) of one owning layer."""

    scale_int8: torch.Tensor  # [r]
    scale_int12: torch.Tensor  # [r]
    comp_int8: torch.Tensor  # [r]
    scale_int4: torch.Tensor | None = None  # [r]; None: the data-free default of decisions "A 4-bit tier"
    comp_int4: torch.Tensor | None = None  # [r]; None: 0

    def __post_init__(self) -> None:
        self.int4_fitted = self.scale_int4 is not None  # fitted on text (written back), not the default
        if self.scale_int4 is None:
            self.scale_int4 = default_int4_scale(self.scale_int8)
        if self.comp_int4 is None:
            self.comp_int4 = torch.zeros_like(self.scale_int8)


@dataclass
class KVCalibration:
    """kv_calibration.safetensors (spec 5): scales[(layer, "k"|"v")]."""

    scales: dict[tuple[int, str], LatentScales]
    calibrated: bool  # False for the data-free defaults below
    # owning layer -> [dI] scale of its INT8 indexer keys (optional; fitted on text only)
    index_key_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    # [H, H] mean x x^T of the LM head's input over calibration text (optional; names.HEAD_INPUT_MOMENT)
    head_input_moment: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: Mapping[str, np.ndarray | torch.Tensor]) -> KVCalibration:
        out = {}
        for i in cfg.owning_layers:
            for kv in ("k", "v"):
                s8 = torch.as_tensor(np.asarray(tensors[names.calib_name(i, kv, "scale_int8")])).float()
                n12 = names.calib_name(i, kv, "scale_int12")
                s12 = (torch.as_tensor(np.asarray(tensors[n12])).float() if n12 in tensors
                       else default_int12_scale(s8))
                comp = torch.as_tensor(np.asarray(tensors[names.calib_name(i, kv, "comp_int8")])).float()
                s4, c4 = (names.calib_name(i, kv, w) for w in ("scale_int4", "comp_int4"))
                out[(i, kv)] = LatentScales(
                    s8, s12, comp, torch.as_tensor(np.asarray(tensors[s4])).float() if s4 in tensors else None,
                    torch.as_tensor(np.asarray(tensors[c4])).float() if c4 in tensors else None)
        keys = {i: torch.as_tensor(np.asarray(tensors[names.index_key_scale_name(i)])).float()
                for i in cfg.owning_layers if names.index_key_scale_name(i) in tensors}
        moment = (torch.as_tensor(np.asarray(tensors[names.HEAD_INPUT_MOMENT])).float()
                  if names.HEAD_INPUT_MOMENT in tensors else None)
        return cls(out, calibrated=True, index_key_scales=keys, head_input_moment=moment)

    @classmethod
    def data_free(cls, w: GoldenWeights, sigmas: float = 4.0) -> KVCalibration:
        """Scales for an uncalibrated checkpoint, from the weights alone.

        Assumes the normalised input has unit RMS per element before the norm weight g, so
        channel j of c = (x Vt^T) * S has std ~ |S_j| * ||Vt_j * g||; clip at `sigmas` std.
        Far from calibrated quality, but deterministic and never zero; comp is 0.
        """
        out = {}
        for i in w.cfg.owning_layers:
            g = w.layers[i].input_norm
            kv = w.owning(i)
            for name, S, Vt in (("k", kv.k_S, kv.k_Vt), ("v", kv.v_S, kv.v_Vt)):
                std = S.abs() * (Vt * g).norm(dim=1)
                s8 = (sigmas * std / 127.0).clamp_min(1e-8).float()
                out[(i, name)] = LatentScales(s8, default_int12_scale(s8), torch.zeros_like(s8))
        return cls(out, calibrated=False)

    def to_tensors(self) -> dict[str, np.ndarray]:
        d = {}
        for (i, kv), s in sorted(self.scales.items()):
            d[names.calib_name(i, kv, "scale_int8")] = s.scale_int8.numpy().astype(np.float32)
            d[names.calib_name(i, kv, "scale_int12")] = s.scale_int12.numpy().astype(np.float32)
            d[names.calib_name(i, kv, "comp_int8")] = s.comp_int8.numpy().astype(np.float32)
            if s.int4_fitted:
                d[names.calib_name(i, kv, "scale_int4")] = s.scale_int4.numpy().astype(np.float32)
                d[names.calib_name(i, kv, "comp_int4")] = s.comp_int4.numpy().astype(np.float32)
        for i, s in sorted(self.index_key_scales.items()):
            d[names.index_key_scale_name(i)] = s.numpy().astype(np.float32)
        if self.head_input_moment is not None:
            d[names.HEAD_INPUT_MOMENT] = self.head_input_moment.numpy().astype(np.float32)
        return d

    def keys_fitted(self, cfg: ModelConfig) -> bool:
        """Every owning layer has its INT8 indexer-key scale (index_key_bits 8 needs them)."""
        return all(i in self.index_key_scales for i in cfg.owning_layers)

    @property
    def int4_fitted(self) -> bool:
        """Every latent has INT4 scales fitted on text (a bundle ships INT4 rows only then)."""
        return bool(self.scales) and all(s.int4_fitted for s in self.scales.values())
