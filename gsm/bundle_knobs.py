"""A bundle's run-time knobs, declared once: what `python -m runtime patch` (offline) and a running server's
`PATCH /admin/config` (live) may change without rebuilding a graph, each knob's range, and the limit the graphs
and the memory plan were built for (past it, the builder flag that makes a bundle with the room).

A patch is RFC 6902 over bundle.json's own paths (docs/serving.md "Changing knobs"):
- `/run_time/...`: what the runtime sends the graphs and how its fallbacks judge a request (RunTime below);
- `/quantization_adaptation_rate` and `/kv_quantization/{tier_fractions, fp16_window, hotness_decay,
  hot_token_ids}`: the tier policy the runtime applies between calls (runtime.policy).
Everything else in bundle.json is tied to a graph's shapes, attributes or constants (NEEDS_REBUILD says which flag
makes it anew). A running server holds the same document (`RunKnobs.document`) and answers with it and its checksum.

Standard library only (plus gsm.config, gsm.tiers): the runtime imports this, never torch.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gsm.config import ConfigError, KVQuantConfig, canonical_json
from gsm.tiers import NAMES as TIER_NAMES
from gsm.tiers import region_rows

KV_NOISE_AUTO = "auto"  # max_kv_noise: the threshold the runtime derives from the bundle's calibrated tier errors
OPS = ("add", "remove", "replace", "move", "copy", "test")  # RFC 6902


class KnobError(ValueError):
    """A patch that cannot be applied: the message names the path (or the field) and the reason."""

    @property
    def path(self) -> str | None:
        """The JSON pointer the message starts with, None where it names none (a malformed patch)."""
        head = str(self).split(":", 1)[0]
        return head if head.startswith("/") else None


@dataclass(frozen=True)
class RunTime:
    """bundle.json `run_time`: the runtime's own choices for every request, which `runtime.load(...)` arguments and
    `runtime serve` flags override."""

    sparse_window: int | None = None  # None: each layer's own (layer_selection, else the model's), resolved in-graph
    sparse_top_k: int | None = None  # None: each layer's own budget, likewise
    # the fallback policies (docs/serving.md "Fallback policies"; thresholds of the GSM deployment description)
    min_hit_rate: float = 0.85  # a probed hit rate below this -> dense attention for the sequence; 0: off
    hit_rate_every: int = 64  # probe decode steps 0, n, 2n, ... (0: never)
    max_kv_noise: float | str | None = KV_NOISE_AUTO  # a re-tier pass noisier -> FP16 refresh; None: off

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> RunTime:
        if not isinstance(d, dict):
            raise KnobError(f"/run_time: expected an object, got {type(d).__name__}")
        stray = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if stray:
            raise KnobError(f"/run_time/{stray[0]}: not a run-time knob (knobs: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))})")
        kw = {}
        for name, parse in _RUN_TIME_PARSERS.items():
            if name in d:
                kw[name] = parse(f"/run_time/{name}", d[name])
        return cls(**kw)


def _int_or_none(lo: int) -> Callable[[str, Any], int | None]:
    def parse(path: str, v: Any) -> int | None:
        if v is None:
            return None
        return _int(lo)(path, v)

    return parse


def _int(lo: int) -> Callable[[str, Any], int]:
    def parse(path: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise KnobError(f"{path}: expected an integer >= {lo}, got {v!r}")
        return v

    return parse


def parse_fraction(path: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise KnobError(f"{path}: expected a number in [0, 1], got {v!r}")
    return float(v)


def parse_noise(path: str, v: Any) -> float | str | None:
    if v is None or v == KV_NOISE_AUTO:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise KnobError(f"{path}: expected a finite number >= 0, {KV_NOISE_AUTO!r} or null (off), got {v!r}")
    return float(v)


_RUN_TIME_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "sparse_window": _int_or_none(1), "sparse_top_k": _int_or_none(0), "min_hit_rate": parse_fraction,
    "hit_rate_every": _int(0), "max_kv_noise": parse_noise}

RATE = "/quantization_adaptation_rate"
POLICY_FIELDS = ("tier_fractions", "fp16_window", "hotness_decay", "hot_token_ids")  # of kv_quantization
# every path a patch may address (or address inside), what it is
KNOBS: dict[str, str] = {
    "/run_time/sparse_window": "the selection's recent window of every layer (null: each layer's own)",
    "/run_time/sparse_top_k": "the selection budget of every layer (null: each layer's own)",
    "/run_time/min_hit_rate": "hit-rate floor of the dense fallback (0: off)",
    "/run_time/hit_rate_every": "decode steps between hit-rate probes (0: never)",
    "/run_time/max_kv_noise": "KV-noise ceiling of the FP16-refresh fallback ('auto', a number, null: off)",
    RATE: "decode steps between re-tier passes",
    "/kv_quantization/tier_fractions": "share of positions kept at each precision (FP16, INT12, INT8[, INT4])",
    "/kv_quantization/fp16_window": "the last positions kept FP16",
    "/kv_quantization/hotness_decay": "decay of the hotness average that ranks positions",
    "/kv_quantization/hot_token_ids": "token ids always kept FP16",
}
_MODEL = "python -m gsm patch CHECKPOINT (gsm_config), then python -m builder build"
_CONVERT = "python -m gsm convert, then python -m builder build"
_CALIBRATE = "python -m calibration run, then python -m builder build"
# bundle.json fields a patch may not change, and what makes them anew
NEEDS_REBUILD: dict[str, str] = {
    "n_max": "--max-seq", "max_batch": "--max-batch", "max_input": "--max-input", "logits": "--logits",
    "debug_outputs": "a build of its own", "max_top_k": "--max-top-k", "weights": "--weights",
    "pool_rows": "--max-seq, --tier-fractions or --max-adaptation-rate (the memory plan's regions)",
    "graph_revision": "python -m builder build",
    "sparse_window": f"the model's window, a constant of the graphs: {_MODEL}; the run-time window is "
                     "/run_time/sparse_window",
    "sparse_top_k": f"the model's budget, a constant of the graphs: {_MODEL}; the run-time budget is "
                    "/run_time/sparse_top_k",
    "max_sparse_window": f"the graphs' selection width: {_MODEL}",
    "layer_selection": f"each layer's window and budget, constants of the graphs: {_MODEL}",
    "sparse_top_k_divisor": f"the budget's growth, a constant of the graphs: {_MODEL}",
    "sink_tokens": f"an attribute of the attention nodes: {_MODEL}",
    "vocab_size": _CONVERT, "bos_token_id": _CONVERT, "eos_token_id": _CONVERT, "owning_layers": _CONVERT,
    "ranks": _CONVERT, "index_dim": _CONVERT,
    "kv_tier_noise": _CALIBRATE,
    "kv_quantization": f"its calibration fields: {_CALIBRATE}; index_key_bits: --index-keys",
}


@dataclass(frozen=True)
class RunKnobs:
    """The knobs in force for a request: the bundle's (bundle.json), as patched or overridden."""

    run_time: RunTime
    quantization_adaptation_rate: int
    tier_fractions: tuple[float, ...]
    fp16_window: int
    hotness_decay: float
    hot_token_ids: tuple[int, ...]

    @property
    def sparse_window(self) -> int | None:
        return self.run_time.sparse_window

    @property
    def sparse_top_k(self) -> int | None:
        return self.run_time.sparse_top_k

    def with_run_time(self, **kw: Any) -> RunKnobs:
        """These knobs with run_time fields replaced (a None value: keep the current one)."""
        changes = {k: v for k, v in kw.items() if v is not None}
        return dataclasses.replace(self, run_time=dataclasses.replace(self.run_time, **changes))

    @classmethod
    def of(cls, run_time: RunTime, rate: int, kv: KVQuantConfig) -> RunKnobs:
        return cls(run_time, rate, tuple(kv.tier_fractions), kv.fp16_window, kv.hotness_decay,
                   tuple(kv.hot_token_ids))

    def document(self) -> dict[str, Any]:
        """The knob document: bundle.json's knob fields, at their bundle.json paths."""
        return {"run_time": self.run_time.to_json(), "quantization_adaptation_rate": self.quantization_adaptation_rate,
                "kv_quantization": {"tier_fractions": list(self.tier_fractions), "fp16_window": self.fp16_window,
                                    "hotness_decay": self.hotness_decay, "hot_token_ids": list(self.hot_token_ids)}}

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """What decides a sequence's cache given its tokens: the selection (window, budget) and the tier policy, not
        the fallback thresholds, which judge a request without changing its rows (prefixes are shared by this)."""
        return (self.run_time.sparse_window, self.run_time.sparse_top_k, self.quantization_adaptation_rate,
                self.tier_fractions, self.fp16_window, self.hotness_decay, self.hot_token_ids)

    @property
    def checksum(self) -> str:
        """`sha256:` of the canonical JSON of the knob document: what a server answers a patch with."""
        return "sha256:" + hashlib.sha256(canonical_json(self.document()).encode()).hexdigest()


@dataclass(frozen=True)
class KnobLimits:
    """What the bundle's graphs and memory plan were built for (bundle.json)."""

    n_max: int
    max_input: int
    max_sparse_window: int
    max_top_k: int | None  # the TensorRT graph's largest per-sequence budget (None: not stated)
    sink_tokens: int
    vocab_size: int
    pool_rows: tuple[int, int, int, int]  # FP16, INT12, INT8, INT4 rows per sequence
    adaptation_rate: int  # the bundle's quantization_adaptation_rate
    kv: KVQuantConfig  # the bundle's kv_quantization (bit widths, index keys, calibration fields)

    def check(self, k: RunKnobs, *, top_k_cap: int | None = None) -> None:
        """KnobError naming the path unless every knob is within what the bundle was built for. top_k_cap: the
        largest budget the graphs that will run take (None: the bundle's max_top_k, what every backend takes; 0: any
        up to max-seq, the ONNX Runtime graphs')."""
        w, top = k.run_time.sparse_window, k.run_time.sparse_top_k
        if w is not None and w > self.max_sparse_window:
            raise KnobError(f"/run_time/sparse_window: {w} is above the graphs' max_sparse_window "
                            f"{self.max_sparse_window} (a larger one: {NEEDS_REBUILD['max_sparse_window']})")
        cap = self.max_top_k if top_k_cap is None else top_k_cap
        top_max = self.n_max if not cap else min(self.n_max, cap)
        if top is not None and top > top_max:
            flag = "--max-top-k" if top_max < self.n_max else "--max-seq"
            raise KnobError(f"/run_time/sparse_top_k: {top} is above the graphs' largest budget {top_max} (rebuild "
                            f"with a larger {flag})")
        try:
            dataclasses.replace(self.kv, tier_fractions=k.tier_fractions, fp16_window=k.fp16_window,
                                hotness_decay=k.hotness_decay, hot_token_ids=k.hot_token_ids)
        except ConfigError as e:
            raise KnobError(f"/kv_quantization: {e}") from None
        bad = [t for t in k.hot_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise KnobError(f"/kv_quantization/hot_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        need = region_rows(self.n_max, self.max_input, self.sink_tokens, k.fp16_window, k.tier_fractions,
                           k.quantization_adaptation_rate)
        for t in range(1, 4):  # a row may live in a wider region: each prefix of regions must hold its tiers
            if sum(need[:t]) > sum(self.pool_rows[:t]):
                raise KnobError(self._no_room(k, t, sum(need[:t])))

    def _no_room(self, k: RunKnobs, t: int, need: int) -> str:
        """What a patch whose tier policy does not fit the pools is told: the rows, and the rebuild that has them."""
        paths, flags = [], []
        if k.quantization_adaptation_rate != self.adaptation_rate:
            paths.append(RATE)
            flags.append(f"--max-adaptation-rate {k.quantization_adaptation_rate}")
        if tuple(k.tier_fractions) != tuple(self.kv.tier_fractions):
            paths.append("/kv_quantization/tier_fractions")
            flags.append(f"--tier-fractions {','.join(f'{f:g}' for f in k.tier_fractions)}")
        if k.fp16_window != self.kv.fp16_window:
            paths.append("/kv_quantization/fp16_window")
            flags.append(f"a checkpoint with kv_quantization.fp16_window {k.fp16_window} (python -m gsm patch)")
        held = "/".join(TIER_NAMES[:t]).upper()
        return (f"{', '.join(paths) or RATE}: the cache would need {need} {held} rows per sequence (sinks "
                f"{self.sink_tokens} + fp16_window {k.fp16_window} + the ranked share + max(max-input "
                f"{self.max_input}, rate {k.quantization_adaptation_rate}) written between re-tier passes), the memory "
                f"plan holds {sum(self.pool_rows[:t])}; rebuild with {' and '.join(flags) or 'a larger --max-seq'}")


def addressed(path: Any, op: int, key: str = "path") -> None:
    """KnobError unless `path` is a JSON pointer to a knob (or inside one, or the whole run_time section)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise KnobError(f"operation {op}: {key} {path!r} is not a JSON pointer (expected e.g. "
                        "'/run_time/sparse_window')")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    if parts == ["run_time"]:
        return
    for knob in KNOBS:
        kp = knob.split("/")[1:]
        if parts[:len(kp)] == kp:
            return
    field = parts[0]
    if field == "run_time" and len(parts) > 1:
        raise KnobError(f"{path}: run_time.{parts[1]} is not a run-time knob (knobs: "
                        f"{', '.join(RunTime.__dataclass_fields__)})")
    if field in NEEDS_REBUILD:
        raise KnobError(f"{path}: cannot change without a rebuild ({NEEDS_REBUILD[field]})")
    raise KnobError(f"{path}: not a knob of a bundle (knobs: {', '.join(KNOBS)})")


def check_operations(ops: Any) -> list[dict[str, Any]]:
    """The operations of a well-formed RFC 6902 patch that addresses knobs only, else KnobError naming it."""
    if not isinstance(ops, list) or not ops:
        raise KnobError("the patch must be a non-empty JSON array of operations (RFC 6902)")
    for i, o in enumerate(ops):
        if not isinstance(o, dict) or o.get("op") not in OPS:
            raise KnobError(f"operation {i}: expected an object with op one of {', '.join(OPS)}, got {o!r}")
        if o["op"] in ("add", "replace", "test") and "value" not in o:
            raise KnobError(f"operation {i} ({o['op']} {o.get('path')}): no value")
        if o["op"] != "test":  # a test changes nothing, wherever it looks
            addressed(o.get("path"), i)
            if o["op"] in ("move", "copy"):
                addressed(o.get("from"), i, "from")
    return ops


def apply_operations(doc: dict[str, Any], ops: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`doc` with the operations applied one at a time (so a failure names its operation); the input is untouched."""
    import jsonpatch

    new = copy.deepcopy(doc)
    for i, o in enumerate(ops):
        try:
            new = jsonpatch.apply_patch(new, [o])
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            why = str(e).split(" in {", 1)[0]  # jsonpatch appends the whole document
            raise KnobError(f"{o.get('path')}: operation {i} ({o.get('op')}) does not apply: {why}") from None
    return new


def knobs_of_document(doc: dict[str, Any], kv: KVQuantConfig) -> RunKnobs:
    """The knobs a (patched) document states, each parsed by its range; `kv` supplies the fields a document has not."""
    q = doc.get("kv_quantization")
    if not isinstance(q, dict):
        raise KnobError("/kv_quantization: expected an object")
    rate = _int(1)(RATE, doc.get("quantization_adaptation_rate"))
    try:
        kq = KVQuantConfig.from_json({"kv_quantization": {**kv.to_json()["kv_quantization"],
                                                          **{f: q[f] for f in POLICY_FIELDS if f in q}}})
    except ConfigError as e:
        raise KnobError(f"/kv_quantization: {e}") from None
    return RunKnobs.of(RunTime.from_json(doc.get("run_time", {})), rate, kq)


def patch_knobs(knobs: RunKnobs, ops: Any, limits: KnobLimits, *, top_k_cap: int | None = None) -> RunKnobs:
    """`knobs` with a patch applied (a running server's config): checked operations, ranges and limits (top_k_cap:
    KnobLimits.check's); the knobs in force are untouched on any refusal."""
    new = knobs_of_document(apply_operations(knobs.document(), check_operations(ops)), limits.kv)
    limits.check(new, top_k_cap=top_k_cap)
    return new
