"""Configuration dataclasses of a GSM checkpoint (spec sections 2 and 5).

One dataclass per concept: `GSMParams` is `config.json["gsm_config"]`, `ModelConfig` is the
whole `config.json`, `KVQuantConfig` is `quant_config.json["kv_quantization"]`. Each has one
constructor from the external JSON (`from_json`) and one writer (`to_json`); derived facts
(kv_dim, owning layers, ...) are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gsm import tiers

SPEC_VERSION = 1


class ConfigError(ValueError):
    """A config file is present but does not say what the spec requires."""


@contextmanager
def _parsing(where: str) -> Iterator[None]:
    """Turn any type/shape surprise in parsed JSON into one ConfigError naming where it was."""
    try:
        yield
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        raise ConfigError(f"{where}: malformed field ({type(e).__name__}: {e})") from e


def canonical_json(obj: Any) -> str:
    """Canonical JSON of spec 2: sorted keys, no spaces (Python json, ASCII escapes)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def gsm_checksum(gsm_config: dict[str, Any]) -> str:
    """`sha256:` of the canonical JSON of gsm_config without its `checksum` field.

    Computed over the parsed JSON object, so the file's whitespace and key order do not matter.
    """
    body = {k: v for k, v in gsm_config.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(canonical_json(body).encode()).hexdigest()


@dataclass(frozen=True)
class LayerSelection:
    """One owning layer's selection (spec 4.1 per layer): sinks (the model's) + `sparse_window` + a top-k.

    `sparse_top_k = 0` is a streaming layer (sinks + window, no indexer pick: DuoAttention's split).
    `sparse_top_k_divisor` d > 0 makes the top-k grow with the context (docs/decisions.md "A budget that grows
    with the context"): the query at position t picks max(sparse_top_k, (t + 1) // d); 0 keeps it fixed."""

    sparse_window: int
    sparse_top_k: int
    sparse_top_k_divisor: int = 0

    def top_k_at(self, t: int) -> int:
        """The top-k of the query at absolute position t."""
        return top_k_at(self.sparse_top_k, self.sparse_top_k_divisor, t)

    @property
    def rows(self) -> int:
        """Rows a query past the dense threshold reads with the floor budget, less the model's sinks."""
        return self.sparse_window + self.sparse_top_k

    def rows_at(self, t: int) -> int:
        """Rows the query at position t reads past the dense threshold, less the model's sinks."""
        return self.sparse_window + self.top_k_at(t)

    def to_json(self) -> dict[str, int]:
        d = dataclasses.asdict(self)
        if not self.sparse_top_k_divisor:
            del d["sparse_top_k_divisor"]  # a fixed budget's entry stays as format v2 wrote it
        return d


def top_k_at(top_k: int, divisor: int, t: int) -> int:
    """Spec 4.1 with a growing budget: max(top_k, (t + 1) // divisor) for divisor > 0, else top_k (integers only,
    so every engine computes the same count)."""
    return max(top_k, (t + 1) // divisor) if divisor > 0 else top_k


@dataclass(frozen=True)
class GSMParams:
    """`gsm_config` of config.json; defaults are those of spec section 2."""

    sparse_window: int = 3
    max_sparse_window: int = 8
    sparse_top_k: int = 64
    sink_tokens: int = 1
    # 0: a fixed top-k (format v1); d > 0: the top-k grows to (t + 1) // d (LayerSelection)
    sparse_top_k_divisor: int = 0
    indexer_heads: int = 4
    indexer_dim: int = 32
    kv_compression_ratio: float = 3.2
    kv_compression_tolerance: float = 0.005
    shared_layers: tuple[int, ...] = (1, 2, 3, 4)
    # sharing layer index -> source layer index; a layer owns a KV cache iff it is not a key here
    kv_sharing: dict[int, int] = field(default_factory=dict)
    shared_layer_grouping: tuple[str, ...] = ("entity", "relation", "logic")
    quantization_adaptation_rate: int = 1000
    # owning layer -> its own window and top-k (docs/decisions.md "Selection per layer"); a layer not named
    # here, and every layer when this is empty (format v1), selects with sparse_window and sparse_top_k
    layer_selection: dict[int, LayerSelection] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sparse_window < 1:
            raise ConfigError(f"gsm_config.sparse_window must be >= 1, got {self.sparse_window}")
        if self.max_sparse_window < self.sparse_window:
            raise ConfigError(
                f"gsm_config.max_sparse_window ({self.max_sparse_window}) must be >= "
                f"sparse_window ({self.sparse_window})")
        for name in ("sparse_top_k", "sink_tokens", "sparse_top_k_divisor"):
            if getattr(self, name) < 0:
                raise ConfigError(f"gsm_config.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("indexer_heads", "indexer_dim", "quantization_adaptation_rate"):
            if getattr(self, name) < 1:
                raise ConfigError(f"gsm_config.{name} must be >= 1, got {getattr(self, name)}")
        if not (isinstance(self.kv_compression_tolerance, (int, float))
                and 0 < self.kv_compression_tolerance < 1):  # NaN fails too
            raise ConfigError("gsm_config.kv_compression_tolerance must be a relative error in (0, 1), got "
                              f"{self.kv_compression_tolerance!r}")
        if not (isinstance(self.kv_compression_ratio, (int, float)) and 0 < self.kv_compression_ratio < math.inf):
            raise ConfigError(f"gsm_config.kv_compression_ratio must be a finite number > 0, got "
                              f"{self.kv_compression_ratio!r}")
        for dst, src in self.kv_sharing.items():
            if src >= dst:
                raise ConfigError(
                    f"gsm_config.kv_sharing: layer {dst} reads layer {src}; a source must be an "
                    "earlier layer (its latents must exist when the sharing layer runs)")
            if src in self.kv_sharing:
                raise ConfigError(f"gsm_config.kv_sharing: source layer {src} is itself sharing")
        for layer, ls in self.layer_selection.items():
            if layer in self.kv_sharing:
                raise ConfigError(f"gsm_config.layer_selection: layer {layer} shares layer {self.kv_sharing[layer]}'s "
                                  "KV and selection (spec 4.2); it has no selection of its own")
            if ls.sparse_window < 1 or ls.sparse_top_k < 0 or ls.sparse_top_k_divisor < 0:
                raise ConfigError(f"gsm_config.layer_selection[{layer}]: sparse_window must be >= 1, sparse_top_k "
                                  f"and sparse_top_k_divisor >= 0, got {ls.sparse_window}, {ls.sparse_top_k} and "
                                  f"{ls.sparse_top_k_divisor}")

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GSMParams:
        with _parsing("gsm_config"):
            return cls._from_json(d)

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> GSMParams:
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
        try:
            if "kv_sharing" in kw:
                kw["kv_sharing"] = {int(k): int(v) for k, v in (kw["kv_sharing"] or {}).items()}
            for k in ("shared_layers", "shared_layer_grouping"):
                if k in kw:
                    kw[k] = tuple(kw[k])
            if "layer_selection" in kw:
                kw["layer_selection"] = {int(k): LayerSelection(int(v["sparse_window"]), int(v["sparse_top_k"]),
                                                                int(v.get("sparse_top_k_divisor", 0)))
                                         for k, v in (kw["layer_selection"] or {}).items()}
            return cls(**kw)
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"gsm_config: malformed field ({e})") from e

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shared_layers"] = list(self.shared_layers)
        d["shared_layer_grouping"] = list(self.shared_layer_grouping)
        d["kv_sharing"] = {str(k): v for k, v in sorted(self.kv_sharing.items())}
        if self.layer_selection:
            d["layer_selection"] = self._layer_selection_json()
        else:
            del d["layer_selection"]  # a v1 config stays byte-identical (and keeps its checksum)
        if not self.sparse_top_k_divisor:
            del d["sparse_top_k_divisor"]  # likewise: a fixed budget writes no growth field
        d["checksum"] = gsm_checksum(d)
        return d

    def top_k_at(self, t: int) -> int:
        """The uniform fields' top-k of the query at position t (a layer's own: `for_layer(l).top_k_at`)."""
        return top_k_at(self.sparse_top_k, self.sparse_top_k_divisor, t)

    def selection_is_dense(self, n_positions: int) -> bool:
        """Spec 4.1: a query at t attends densely when t + 1 <= sinks + window + top_k(t)."""
        return n_positions <= self.sink_tokens + self.sparse_window + self.top_k_at(n_positions - 1)

    def selection_of(self, layer: int) -> LayerSelection:
        """The window and top-k owning layer `layer` selects with."""
        return self.layer_selection.get(layer, LayerSelection(self.sparse_window, self.sparse_top_k,
                                                              self.sparse_top_k_divisor))

    def for_layer(self, layer: int) -> GSMParams:
        """These params with owning layer `layer`'s window and top-k in the uniform fields (what select() reads)."""
        ls = self.layer_selection.get(layer)
        if ls is None:
            return self
        return dataclasses.replace(self, sparse_window=ls.sparse_window, sparse_top_k=ls.sparse_top_k,
                                   sparse_top_k_divisor=ls.sparse_top_k_divisor,
                                   max_sparse_window=max(self.max_sparse_window, ls.sparse_window), layer_selection={})

    def overridden(self, *, sparse_top_k: int | None = None, sparse_window: int | None = None) -> GSMParams:
        """A run-time override, as the engines apply it: every layer selects with the given top-k (window),
        the field not given stays each layer's own; a growing layer's top-k still grows from the given floor."""
        per = {i: LayerSelection(ls.sparse_window if sparse_window is None else sparse_window,
                                 ls.sparse_top_k if sparse_top_k is None else sparse_top_k, ls.sparse_top_k_divisor)
               for i, ls in self.layer_selection.items()}
        return dataclasses.replace(self, layer_selection=per,
                                   sparse_top_k=self.sparse_top_k if sparse_top_k is None else sparse_top_k,
                                   sparse_window=self.sparse_window if sparse_window is None else sparse_window)

    def max_top_k_to(self, n_max: int) -> int:
        """The largest top-k any layer selects with by default within n_max positions, at most n_max: the
        engines' max_top_k floor (a growing layer reaches (n_max) // d at its last position)."""
        sels = [self.selection_of(-1), *self.layer_selection.values()]  # -1: no layer's own, the uniform fields
        return min(max(ls.top_k_at(n_max - 1) for ls in sels), n_max)

    def layer_max_window(self, layer: int) -> int:
        """The widest window owning layer `layer` may select with: its own, or a run-time one."""
        return max(self.max_sparse_window, self.selection_of(layer).sparse_window)

    def k_sel(self, layer: int, max_top_k: int) -> int:
        """K_sel of owning layer `layer`'s attention node (engine_io 4.2): its `selected` width and the CUDA
        logits workspace, for nodes that honour budgets up to max_top_k."""
        return self.sink_tokens + self.layer_max_window(layer) + max_top_k

    def recency_equivalent(self, n_positions: int = 0) -> GSMParams:
        """The same rows per layer given to sinks + a window (top-k 0): the baseline a selector must beat. A
        growing budget's rows are those of a query at position n_positions - 1 (its floor's when 0)."""
        t = max(n_positions - 1, 0)
        per = {i: LayerSelection(self.selection_of(i).rows_at(t), 0) for i in self.layer_selection}
        w = self.sparse_window + self.top_k_at(t)
        return dataclasses.replace(self, sparse_window=w, sparse_top_k=0, sparse_top_k_divisor=0,
                                   max_sparse_window=max(self.max_sparse_window, w), layer_selection=per)

    def mean_rows(self, layers: list[int], n_positions: int) -> float:
        """Rows a query at position n_positions - 1 reads per layer, averaged over `layers` (sinks included)."""
        t = n_positions - 1
        return (sum(min(n_positions, self.sink_tokens + self.selection_of(i).rows_at(t)) for i in layers)
                / max(len(layers), 1))

    def selection_summary(self) -> dict[str, Any]:
        d = {"sink_tokens": self.sink_tokens, "sparse_window": self.sparse_window, "sparse_top_k": self.sparse_top_k,
             "layer_selection": self._layer_selection_json()}
        if self.sparse_top_k_divisor:
            d["sparse_top_k_divisor"] = self.sparse_top_k_divisor
        return d

    def _layer_selection_json(self) -> dict[str, dict[str, int]]:
        return {str(k): v.to_json() for k, v in sorted(self.layer_selection.items())}


@dataclass(frozen=True)
class ModelConfig:
    """config.json: HF-LLaMA fields plus `gsm`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int = 1
    eos_token_id: int = 2
    gsm: GSMParams = field(default_factory=GSMParams)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for dst in self.gsm.kv_sharing:
            if not 0 <= dst < self.num_hidden_layers:
                raise ConfigError(f"gsm_config.kv_sharing names layer {dst}, model has "
                                  f"{self.num_hidden_layers} layers")
        if self.torch_dtype not in DTYPE_NAMES:
            raise ConfigError(f"torch_dtype must be one of {sorted(DTYPE_NAMES)}, "
                              f"got {self.torch_dtype!r}")

    # derived facts
    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def owning_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.gsm.kv_sharing]

    @property
    def sharing_layers(self) -> list[int]:
        return sorted(self.gsm.kv_sharing)

    def is_owning(self, layer: int) -> bool:
        return layer not in self.gsm.kv_sharing

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        with _parsing("config.json"):
            return cls._from_json(d)

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        if "gsm_config" not in d:
            raise ConfigError("config.json has no gsm_config")
        known = {f.name for f in dataclasses.fields(cls)} - {"gsm"}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("eos_token_id"), list):  # HF allows a list; the first is ours
            kw["eos_token_id"] = kw["eos_token_id"][0]
        required = ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "vocab_size")
        missing = [k for k in required if k not in kw]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        if kw.get("head_dim") is None:
            kw["head_dim"] = 0
        for k in required + ("head_dim", "max_position_embeddings"):
            if k in kw and (not isinstance(kw[k], int) or isinstance(kw[k], bool) or kw[k] < 0
                            or (kw[k] == 0 and k != "head_dim")):
                raise ConfigError(f"config.json: {k} must be a positive integer, got {kw[k]!r}")
        if not isinstance(d["gsm_config"], dict):
            raise ConfigError("config.json: gsm_config must be an object")
        try:
            return cls(gsm=GSMParams.from_json(d["gsm_config"]), **kw)
        except TypeError as e:
            raise ConfigError(f"config.json: malformed field ({e})") from e

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "gsm"}
        d["architectures"] = ["GSMForCausalLM"]
        d["model_type"] = "gsm"
        d["gsm_config"] = self.gsm.to_json()
        return d

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


DTYPE_NAMES = {"float32", "float16", "bfloat16"}


INDEX_KEY_BITS = (16, 8)


@dataclass(frozen=True)
class KVQuantConfig:
    """quant_config.json `kv_quantization` (spec 5). Defaults are our decisions (docs/decisions.md)."""

    scheme: str = "adaptive"
    bit_widths: tuple[int, ...] = tiers.BIT_WIDTHS_V1  # GSM_SPEC v2 adds the 4 (tiers.BIT_WIDTHS_V2)
    # fractions of the positions outside window and sinks kept FP16 / INT12 / INT8 (/ INT4: four numbers,
    # GSM_SPEC v2; three mean no INT4 row)
    tier_fractions: tuple[float, ...] = (0.25, 0.25, 0.5)
    fp16_window: int = 32
    hotness_decay: float = 0.9
    hot_token_ids: tuple[int, ...] = ()
    # bits of the cached indexer keys: 16 (FP16, GSM_SPEC v1) or 8 (per-channel INT8 codes with scales in
    # kv_calibration.safetensors, GSM_SPEC v2; decisions "INT8 indexer keys")
    index_key_bits: int = 16
    method: str = "absmax"
    samples: int = 0
    data_hash: str = ""

    def __post_init__(self) -> None:
        if len(self.tier_fractions) not in (3, 4) or any(f < 0 for f in self.tier_fractions) or \
                abs(sum(self.tier_fractions) - 1.0) > 1e-6:
            raise ConfigError("kv_quantization.tier_fractions must be three (FP16/INT12/INT8) or four (…/INT4) "
                              f"non-negative numbers summing to 1, got {list(self.tier_fractions)}")
        if len(self.tier_fractions) == 4 and self.tier_fractions[3] > 0 and 4 not in self.bit_widths:
            raise ConfigError(f"kv_quantization.tier_fractions {list(self.tier_fractions)} keep INT4 rows but "
                              f"bit_widths {list(self.bit_widths)} has no 4 (GSM_SPEC v2: [16, 12, 8, 4])")
        if self.index_key_bits not in INDEX_KEY_BITS:
            raise ConfigError(f"kv_quantization.index_key_bits must be one of {list(INDEX_KEY_BITS)} "
                              f"(FP16 or INT8 indexer keys), got {self.index_key_bits!r}")
        if self.fp16_window < 0:
            raise ConfigError(f"kv_quantization.fp16_window must be >= 0, got {self.fp16_window}")
        if not 0.0 <= self.hotness_decay < 1.0:
            raise ConfigError(f"kv_quantization.hotness_decay must be in [0, 1), "
                              f"got {self.hotness_decay}")

    @property
    def is_gsm(self) -> bool:
        """Mark 5 of spec 1."""
        return self.scheme == "adaptive" and tuple(self.bit_widths) in tiers.BIT_WIDTHS

    @property
    def fractions4(self) -> tuple[float, float, float, float]:
        """FP16/INT12/INT8/INT4 fractions (a v1 triple has no INT4 rows)."""
        return tiers.fractions4(self.tier_fractions)

    @property
    def uses_int4(self) -> bool:
        return tiers.uses_int4(self.tier_fractions)

    @property
    def int8_keys(self) -> bool:
        return self.index_key_bits == 8

    def with_fractions(self, fractions: tuple[float, ...]) -> KVQuantConfig:
        """These options with other tier fractions; INT4 rows make bit_widths GSM_SPEC v2's."""
        bits = tiers.BIT_WIDTHS_V2 if tiers.uses_int4(fractions) else self.bit_widths
        return dataclasses.replace(self, tier_fractions=tuple(fractions), bit_widths=tuple(bits))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVQuantConfig:
        with _parsing("quant_config.json"):
            return cls._from_json(d)

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> KVQuantConfig:
        if not isinstance(d, dict) or not isinstance(d.get("kv_quantization"), dict):
            raise ConfigError("quant_config.json has no kv_quantization object")
        q = d["kv_quantization"]
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in q.items() if k in known}
        try:
            for k in ("bit_widths", "tier_fractions", "hot_token_ids"):
                if k in kw:
                    kw[k] = tuple(kw[k])
            return cls(**kw)
        except TypeError as e:
            raise ConfigError(f"quant_config.json: malformed field ({e})") from e

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("bit_widths", "tier_fractions", "hot_token_ids"):
            d[k] = list(d[k])
        if d["index_key_bits"] == 16:  # the v1 default: a v1 file stays as it was
            del d["index_key_bits"]
        return {"kv_quantization": d}

    def replace(self, **kw: Any) -> KVQuantConfig:
        return dataclasses.replace(self, **kw)
