"""The bundle format, declared once: `python -m builder build` writes it, the runtime reads it.

- `FILES`: the name of every file a bundle may hold (docs/builder.md "The bundle");
- `BUNDLE_FORMAT` / `BUNDLE_VERSION`: the identity manifest.json carries, checked by `check_identity`;
- `BundleConfig`: bundle.json, the numbers the runtime drives the graphs with, parsed once and checked
  field by field (one BundleError naming the file and the field);
- `GRAPH_REVISION`: the engine interface revision (docs/engine_io.md changelog) of the graphs the builder
  writes. bundle.json states it; the runtime runs this revision only and refuses another with the rebuild
  command (a bundle rebuilds in seconds);
- `VERIFY_ROWS`: the most new tokens per sequence a call may carry and still give each query the bits a one-token
  step gives it (a speculative verification, docs/engine_io.md "logit_rows").

Standard library only (plus gsm.config, gsm.tiers and gsm.atomic, likewise): the runtime imports this, never torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gsm.atomic import MANIFEST_NAME
from gsm.bundle_knobs import KnobError, KnobLimits, RunKnobs, RunTime
from gsm.config import ConfigError, KVQuantConfig
from gsm.tiers import NAMES as TIER_NAMES

BUNDLE_FORMAT = "gsm-edge-bundle"
BUNDLE_VERSION = 1
GRAPH_REVISION = 16
REBUILD = "python -m builder build --device DEVICE --checkpoint CHECKPOINT --output BUNDLE"
VERIFY_ROWS = 16


class BundleError(ValueError):
    """A bundle is missing, not a bundle of this format/version, a file fails its hash, or bundle.json
    does not hold what the runtime needs."""


@dataclass(frozen=True)
class BundleFiles:
    """File names inside a bundle directory."""

    manifest: str = MANIFEST_NAME  # gsm.atomic's, plus the bundle identity fields
    config: str = "bundle.json"  # BundleConfig
    plan: str = "plan.json"  # builder.plan.MemoryPlan
    report: str = "report.json"  # the build report
    weights: str = "weights.bin"  # external data of every graph
    model_trt: str = "model.onnx"  # GSM plugin nodes, for TensorRT (engine_io 2-4)
    model_portable: str = "model.portable.onnx"  # standard ops, ONNX Runtime anywhere (engine_io 5)
    model_cpu: str = "model.cpu.onnx"  # portable + the fused CPU attention op (engine_io 5.1)
    cpu_weights: str = "model.cpu.weights.json"  # CpuWeightTable: model.cpu.onnx's custom-op weights in weights.bin
    demote_trt: str = "gsm_demote.onnx"  # GsmKVDemote nodes (engine_io 4.3)
    demote_portable: str = "gsm_demote.portable.onnx"  # re-encodes changed rows (engine_io 5)
    engine: str = "engine.plan"  # only where TensorRT built it
    demote_engine: str = "demote.plan"
    probe: str = "golden_probe.npz"  # the golden model's outputs on a fixed probe (gsm.probe_format, docs/verify.md)

    def graphs(self) -> dict[str, str]:
        """The manifest's `graphs` record: network form -> file."""
        return {"tensorrt": self.model_trt, "portable": self.model_portable, "cpu": self.model_cpu}


FILES = BundleFiles()


@dataclass(frozen=True)
class WeightSpan:
    """One initializer's bytes in weights.bin: ONNX external data (offset, length) with its numpy dtype and shape."""

    name: str
    offset: int
    length: int
    dtype: str  # numpy dtype name: "uint8", "float16", "float32", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CpuWeightTable:
    """The initializers model.cpu.onnx's custom ops (domain ai.gsm_edge.cpu) read, where weights.bin holds them:
    the runtime reads them into memory of its own (large pages where the OS offers them) and hands them to the
    session in place of ONNX Runtime's file mappings (runtime/ort_backend.py). The ops read them as they are
    (nothing prepacks them), so nothing is held twice."""

    spans: tuple[WeightSpan, ...]

    def to_json(self) -> dict[str, Any]:
        return {"file": FILES.weights, "spans": [[w.name, w.offset, w.length, w.dtype, list(w.shape)]
                                                 for w in self.spans]}

    @classmethod
    def from_json(cls, d: Any, origin: str) -> CpuWeightTable:
        try:
            if d["file"] != FILES.weights:
                raise ValueError(f"file {d['file']!r}, expected {FILES.weights!r}")
            spans = tuple(WeightSpan(str(n), int(o), int(ln), str(dt), tuple(int(x) for x in shp))
                          for n, o, ln, dt, shp in d["spans"])
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{origin}: not a CPU weight table ({e}); rebuild the bundle with `{REBUILD}`") from e
        return cls(spans)


def check_identity(root: Path, manifest: Mapping[str, Any]) -> None:
    """The manifest says this is a bundle of this format and version, else BundleError."""
    fmt, version = manifest.get("bundle_format"), manifest.get("bundle_version")
    if fmt != BUNDLE_FORMAT:
        raise BundleError(f"{root}: not a {BUNDLE_FORMAT} (manifest bundle_format {fmt!r}); build one with `{REBUILD}`")
    if version != BUNDLE_VERSION:
        raise BundleError(f"{root}: bundle version {version!r}, this code reads {BUNDLE_VERSION}; rebuild it with "
                          f"`{REBUILD}`")


@dataclass(frozen=True)
class PoolRows:
    """Rows per sequence of the FP16 / INT12 / INT8 / INT4 regions of every owning layer's latent pool
    (`C16, C12, C8, C4` of docs/engine_io.md section 3; one slot table serves all owning layers)."""

    fp16: int
    int12: int
    int8: int
    int4: int = 0  # a bundle.json written before the 4-bit tier has none

    @property
    def total(self) -> int:
        return self.fp16 + self.int12 + self.int8 + self.int4

    @property
    def by_tier(self) -> tuple[int, int, int, int]:
        return self.fp16, self.int12, self.int8, self.int4


# The CPU graph's row cache of reconstructed K rows (plugins/ortCpu/GsmPoolAttention): per layer `row_cache.{i}`
# [R, C, kvD] float32 and `row_cache_tags.{i}` [R, ROW_CACHE_TAGS, C] int32, tag rows position, slot entry, last
# call read; a new row starts with every tag -1 (free).
ROW_CACHE_TAGS = 3
ROW_CACHE_FREE = -1


@dataclass(frozen=True)
class IndexKeyLayout:
    """One position's indexer key in the caches (decisions "INT8 indexer keys"): FP16 values, or INT8 codes, which
    the plugin graph holds four to an int32 word (TensorRT plugins do not take 8-bit tensors as plain bytes; the
    latent pools are int32 words for the same reason) and the ONNX Runtime graphs as int8."""

    index_dim: int
    bits: int  # 16 or 8

    @property
    def plugin_width(self) -> int:
        """Elements of `index_keys.{l}`'s last axis in the plugin graph: dI float16, or ceil(dI / 4) int32 words."""
        return self.index_dim if self.bits == 16 else -(-self.index_dim // 4)

    @property
    def bytes(self) -> int:
        """Device bytes of one position's key (the plugin graph's words included)."""
        return 2 * self.index_dim if self.bits == 16 else 4 * self.plugin_width


# -- field parsers: each returns the value as BundleConfig holds it, or raises TypeError/ValueError ------------
def _int(lo: int) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError
        return v

    return parse


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError
    return v


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if v not in options:
            raise ValueError
        return v

    return parse


def _layers(v: Any) -> tuple[int, ...]:
    return tuple(_int(0)(x) for x in v)


def _ranks(v: Any) -> dict[int, tuple[int, int]]:
    out = {}
    for k, r in v.items():
        rk, rv = r
        out[int(k)] = (_int(1)(rk), _int(1)(rv))
    return out


def selection_entry(window: int, top_k: int, divisor: int = 0) -> tuple[int, ...]:
    """A `layer_selection` entry: (window, top_k), or (window, top_k, divisor) for a budget growing with the
    context (a fixed one keeps the two-number form older bundles have)."""
    return (window, top_k, divisor) if divisor else (window, top_k)


def _layer_selection(v: Any) -> dict[int, tuple[int, ...]]:
    out = {int(k): tuple(int(x) for x in e) for k, e in v.items()}
    if any(len(e) not in (2, 3) or e[0] < 1 or min(e[1:]) < 0 for e in out.values()):
        raise ValueError("a window below 1, a negative top-k or divisor, or not 2 or 3 numbers")
    return {k: selection_entry(*e) for k, e in out.items()}


def _pool_rows(v: Any) -> PoolRows:
    return PoolRows(**{k: _int(0)(v[k]) for k in ("fp16", "int12", "int8")}, int4=_int(0)(v.get("int4", 0)))


def _kv_quantization(v: Any) -> KVQuantConfig:
    if not isinstance(v, dict):
        raise ValueError
    return KVQuantConfig.from_json({"kv_quantization": v})


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else parse(v)


def _record(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or not isinstance(v.get("format"), str):
        raise ValueError
    return dict(v)


def _tier_noise(v: Any) -> dict[str, float]:
    out = {str(k): float(x) for k, x in v.items()}
    if not set(out) <= set(TIER_NAMES) or not all(0 <= x < float("inf") for x in out.values()):
        raise ValueError
    return out


def _run_time(v: Any) -> RunTime:
    try:
        return RunTime.from_json(v)
    except KnobError as e:
        raise ConfigError(str(e)) from None


def _revision(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v != GRAPH_REVISION:
        raise ValueError
    return v


def _spec(parse: Callable[[Any], Any], what: str, **kw: Any) -> Any:
    """A BundleConfig field: how bundle.json's value is parsed, and what the error says it must be."""
    return field(metadata={"parse": parse, "what": what}, **kw)


def _int_spec(lo: int) -> Any:
    return _spec(_int(lo), f"an integer >= {lo}")


@dataclass(frozen=True)
class BundleConfig:
    """bundle.json: what the runtime needs to drive the graphs (shapes, tier-policy numbers, revision)."""

    n_max: int = _int_spec(1)  # max-seq: positions per sequence
    max_batch: int = _int_spec(1)
    max_input: int = _int_spec(1)  # most new tokens per call (prefill chunk)
    logits: str = _spec(_choice("last", "all"), "'last' or 'all'")
    debug_outputs: bool = _spec(_bool, "true or false")
    vocab_size: int = _int_spec(1)
    bos_token_id: int = _int_spec(0)
    eos_token_id: int = _int_spec(0)
    owning_layers: tuple[int, ...] = _spec(_layers, "a list of layer indices")
    ranks: dict[int, tuple[int, int]] = _spec(_ranks, "an object layer -> [rank_k, rank_v]")  # owning layers
    index_dim: int = _int_spec(1)
    pool_rows: PoolRows = _spec(_pool_rows, "an object with integers fp16, int12, int8 (and int4)")
    sink_tokens: int = _int_spec(0)
    sparse_window: int = _int_spec(1)
    max_sparse_window: int = _int_spec(1)
    sparse_top_k: int = _int_spec(0)  # the checkpoint's default selection budget
    quantization_adaptation_rate: int = _int_spec(1)
    kv_quantization: KVQuantConfig = _spec(_kv_quantization, "a kv_quantization object (quant_config.json's)")
    graph_revision: int = _spec(_revision, f"engine_io revision {GRAPH_REVISION}, the one this runtime runs (rebuild "
                                           f"the bundle with `{REBUILD}`)")
    # written since --max-top-k existed: the TensorRT graph's largest per-sequence budget (None: not stated)
    max_top_k: int | None = _spec(_optional(_int(0)), "an integer >= 0", default=None)
    # written since --weights existed; older bundles have FP16 weights
    weights: dict[str, Any] = _spec(_record, "an object with a format", default_factory=lambda: {"format": "fp16"})
    # owning layer -> (window, top_k) where the checkpoint chose per layer (the graphs select so when the
    # run-time window is 0 and a budget -1); empty: every layer selects with sparse_window and sparse_top_k
    layer_selection: dict[int, tuple[int, ...]] = _spec(_layer_selection,
                                                        "an object layer -> [window, top_k(, top_k divisor)]",
                                                        default_factory=dict)
    # the uniform top-k's growth (gsm_config sparse_top_k_divisor; 0: a fixed count)
    sparse_top_k_divisor: int = _spec(_int(0), "an integer >= 0", default=0)
    # the relative error each latent tier made on the calibration text (calibration_report.json, over the owning
    # layers' K and V latents): what a re-tier pass is expected to add, for the KV-noise fallback's threshold;
    # empty where nothing was measured (an uncalibrated or FP16-only cache)
    kv_tier_noise: dict[str, float] = _spec(_tier_noise, "an object tier name (fp16, int12, int8, int4) -> number >= 0",
                                            default_factory=dict)
    # the runtime's own choices for every request (window and budget sent to the graphs, fallback thresholds),
    # which `runtime patch` changes in place (gsm.bundle_knobs)
    run_time: RunTime = _spec(_run_time, "a run_time object (gsm.bundle_knobs.RunTime)", default_factory=RunTime)

    @property
    def knobs(self) -> RunKnobs:
        """The run-time knobs this bundle states (gsm.bundle_knobs)."""
        return RunKnobs.of(self.run_time, self.quantization_adaptation_rate, self.kv_quantization)

    @property
    def knob_limits(self) -> KnobLimits:
        """What the graphs and the memory plan of this bundle were built for: the range of every knob."""
        return KnobLimits(self.n_max, self.max_input, self.max_sparse_window, self.max_top_k, self.sink_tokens,
                          self.vocab_size, self.pool_rows.by_tier, self.quantization_adaptation_rate,
                          self.kv_quantization)

    @property
    def index_keys(self) -> IndexKeyLayout:
        """How the caches hold the indexer keys (kv_quantization.index_key_bits)."""
        return IndexKeyLayout(self.index_dim, self.kv_quantization.index_key_bits)

    def selection_of(self, layer: int) -> tuple[int, int]:
        """(window, top_k) owning layer `layer` selects with by default (top_k: the floor of a growing one)."""
        return self.layer_selection.get(layer, (self.sparse_window, self.sparse_top_k))[:2]

    def top_k_divisor_of(self, layer: int) -> int:
        """Owning layer `layer`'s top-k growth (0: a fixed count)."""
        e = self.layer_selection.get(layer)
        return self.sparse_top_k_divisor if e is None else (e[2] if len(e) == 3 else 0)

    def __post_init__(self) -> None:
        if not set(self.layer_selection) <= set(self.owning_layers):
            stray = sorted(set(self.layer_selection) - set(self.owning_layers))
            raise BundleError(f"layer_selection names layers {stray} that own no KV cache")
        if set(self.ranks) != set(self.owning_layers):
            raise BundleError(f"ranks has layers {sorted(self.ranks)}, owning_layers {list(self.owning_layers)}")
        if self.sparse_window > self.max_sparse_window:
            raise BundleError(f"sparse_window {self.sparse_window} is above max_sparse_window {self.max_sparse_window}")

    @classmethod
    def from_json(cls, d: Any, origin: str) -> BundleConfig:
        """Every field checked; one BundleError naming `origin` (the file) and the field otherwise."""
        if not isinstance(d, dict):
            raise BundleError(f"{origin}: expected a JSON object, got {type(d).__name__}")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            what = f.metadata["what"]
            if f.name not in d:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise BundleError(f"{origin}: no field {f.name!r} ({what}); rebuild the bundle with `{REBUILD}`")
                continue
            try:
                kw[f.name] = f.metadata["parse"](d[f.name])
            except ConfigError as e:
                raise BundleError(f"{origin}: field {f.name!r}: {e}") from None
            except (TypeError, ValueError, KeyError, AttributeError):
                raise BundleError(f"{origin}: field {f.name!r} must be {what}, got {d[f.name]!r}") from None
        try:
            return cls(**kw)
        except BundleError as e:
            raise BundleError(f"{origin}: {e}") from None

    @classmethod
    def load(cls, root: Path) -> BundleConfig:
        """bundle.json of the bundle directory `root`."""
        path = Path(root) / FILES.config
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BundleError(f"{path}: missing; rebuild the bundle with `{REBUILD}`") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise BundleError(f"{path}: not readable JSON ({e})") from None
        if isinstance(d, dict) and "graph_revision" not in d:  # written before the field: an old graph
            raise BundleError(f"{path}: states no graph_revision (built by an older builder, whose graphs this "
                              f"runtime does not run); rebuild the bundle with `{REBUILD}`")
        return cls.from_json(d, str(path))

    def to_json(self) -> dict[str, Any]:
        """What the builder writes (the keys of the fields; JSON types)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["owning_layers"] = list(self.owning_layers)
        d["ranks"] = {str(l): list(r) for l, r in sorted(self.ranks.items())}
        d["pool_rows"] = dataclasses.asdict(self.pool_rows)
        d["layer_selection"] = {str(l): list(v) for l, v in sorted(self.layer_selection.items())}
        d["kv_quantization"] = self.kv_quantization.to_json()["kv_quantization"]
        d["run_time"] = self.run_time.to_json()
        return d
