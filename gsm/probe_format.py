"""The golden probe file of a bundle (`golden_probe.npz`), declared once: `python -m builder build` writes it from
the golden model, `python -m runtime verify` reads it (docs/verify.md).

The file is an uncompressed numpy .npz (a zip of .npy arrays, readable with numpy alone), at most
`MAX_PROBE_BYTES` whatever the model. It holds one *record* per (case, weight form):
- a case is one sequence the probe runs: `text` (a few hundred tokens of fixed prose, prefilled in several calls,
  then decoded greedily) and, where the bundle has a chat template, `chat` (one rendered user turn);
- a weight form is the set of dequantised weights the golden ran with: `portable` (what model.portable.onnx and
  model.cpu.onnx hold) and, only where they differ (grouped INT8: TensorRT's form is per output channel),
  `tensorrt` (what model.onnx holds).

A record's *outputs* are the last-row logits of each of its calls in order: the prefill calls, then one decode call
per continuation token but the last (feeding tokens[0..G-2]); output C-1+j is what predicts tokens[j].

Standard library and numpy only: the runtime imports this, never torch.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gsm.bundle_format import REBUILD, BundleError

PROBE_FORMAT = "gsm-edge-golden-probe"
PROBE_VERSION = 2  # 2: the golden settings name the knobs it ran with (PROBE_KNOBS)
MAX_PROBE_BYTES = 2 << 20  # the whole file, whatever the vocabulary
LOGIT_BYTES = 3 << 19  # of MAX_PROBE_BYTES, for the float16 logit rows of all records together
SELECTION_BYTES = 1 << 18  # of MAX_PROBE_BYTES, for the selection bits of all records together
LOGIT_DTYPE = np.float16
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so the same probe is the same bytes

CASES = ("text", "chat")
FORMS = ("portable", "tensorrt")
META = "meta"  # uint8: the JSON header (format, version, vocab_size, records, golden settings)
PROBE_KNOBS = "knobs"  # golden settings: the bundle's knob document the golden ran with (gsm.bundle_knobs)

# a record's arrays: field -> numpy dtype
IDS = "ids"  # [T] the prompt
CALLS = "calls"  # [C] prefill call lengths, summing to T
TOKENS = "tokens"  # [G] the golden's greedy continuation
TOP1 = "top1"  # [K] the golden's top-1 of each output, K = C + G - 1
MARGIN = "margin"  # [K] the golden's top-1 minus top-2 logit
SCALE = "scale"  # [K] the golden's largest |logit|
SEL_GAP = "sel_gap"  # [K] the smallest relative top-k boundary gap of the call's last row over owning layers
LOGIT_OUTPUTS = "logit_outputs"  # [P] the outputs whose logits are stored, ascending
LOGITS = "logits"  # [P, V] those logits, float16
SEL_LAYERS = "sel_layers"  # [Ls] owning layers whose selections are stored
SEL_ROWS = "sel_rows"  # [Q] query positions whose selections are stored, ascending
SEL_BITS = "sel_bits"  # [Ls, Q, ceil(N / 8)] np.packbits of the selected positions (N = T + G - 1)
TIERS = "tiers"  # [4] rows per cache tier (FP16, INT12, INT8, INT4) of the golden after the last call
FIELDS = {IDS: np.int32, CALLS: np.int32, TOKENS: np.int32, TOP1: np.int32, MARGIN: np.float32, SCALE: np.float32,
          SEL_GAP: np.float32, LOGIT_OUTPUTS: np.int32, LOGITS: LOGIT_DTYPE, SEL_LAYERS: np.int32, SEL_ROWS: np.int32,
          SEL_BITS: np.uint8, TIERS: np.int32}


class ProbeError(BundleError):
    """The probe file is missing, of another format or version, or does not hold what its header says."""


@dataclass(frozen=True)
class ProbeRecord:
    """One case run by the golden on one weight form (the module docstring)."""

    case: str
    form: str
    ids: np.ndarray
    calls: np.ndarray
    tokens: np.ndarray
    top1: np.ndarray
    margin: np.ndarray
    scale: np.ndarray
    sel_gap: np.ndarray
    logit_outputs: np.ndarray
    logits: np.ndarray
    sel_layers: np.ndarray
    sel_rows: np.ndarray
    sel_bits: np.ndarray
    tiers: np.ndarray

    @property
    def key(self) -> str:
        return f"{self.case}.{self.form}"

    @property
    def positions(self) -> int:
        """N: the positions the sequence holds after its last call."""
        return len(self.ids) + len(self.tokens) - 1

    @property
    def outputs(self) -> int:
        """K: calls made (prefill calls, then decode calls)."""
        return len(self.calls) + len(self.tokens) - 1

    def output_rows(self) -> np.ndarray:
        """[K] the query position of each output (its call's last row)."""
        return np.concatenate([np.cumsum(self.calls) - 1, len(self.ids) + np.arange(len(self.tokens) - 1)])

    def selected(self) -> np.ndarray:
        """bool [Ls, Q, N]: the golden's selected positions of each stored (layer, query row)."""
        return np.unpackbits(self.sel_bits, axis=-1, count=self.positions).astype(bool)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f: getattr(self, f) for f in FIELDS}


@dataclass(frozen=True)
class GoldenProbe:
    """The probe file: its records and the header's golden settings (how the golden ran, for the report)."""

    vocab_size: int
    records: tuple[ProbeRecord, ...]
    golden: dict[str, Any]

    def for_form(self, form: str) -> tuple[ProbeRecord, ...]:
        """The records of weight form `form`, else the portable ones (the forms agree where only those exist)."""
        own = tuple(r for r in self.records if r.form == form)
        return own or tuple(r for r in self.records if r.form == FORMS[0])


def write_probe(path: Path, probe: GoldenProbe) -> int:
    """Write the file (fixed zip times: the same probe gives the same bytes); returns its size. ValueError where
    the records do not fit MAX_PROBE_BYTES (the writer sizes them not to)."""
    header = {"format": PROBE_FORMAT, "version": PROBE_VERSION, "vocab_size": probe.vocab_size,
              "records": [{"case": r.case, "form": r.form} for r in probe.records], "golden": probe.golden}
    arrays = {META: np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)}
    for r in probe.records:
        for f, dtype in FIELDS.items():
            arrays[f"{r.key}.{f}"] = np.ascontiguousarray(getattr(r, f), dtype=dtype)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, a in arrays.items():
            with z.open(zipfile.ZipInfo(name + ".npy", date_time=ZIP_TIME), "w") as f:
                np.lib.format.write_array(f, a, allow_pickle=False)
    data = buf.getvalue()
    if len(data) > MAX_PROBE_BYTES:
        raise ValueError(f"{path}: a golden probe of {len(data)} bytes, above its bound {MAX_PROBE_BYTES}")
    Path(path).write_bytes(data)
    return len(data)


def read_probe(path: Path) -> GoldenProbe:
    """The probe file, every array checked against the header; ProbeError naming the file and the key otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"{path}: no golden probe (bundles built before `runtime verify` existed have none); "
                         f"rebuild the bundle with `{REBUILD}`")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        header = json.loads(arrays.pop(META).tobytes().decode())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ProbeError(f"{path}: not a readable golden probe ({e}); rebuild the bundle with `{REBUILD}`") from None
    if not isinstance(header, dict) or header.get("format") != PROBE_FORMAT:
        raise ProbeError(f"{path}: not a {PROBE_FORMAT} file; rebuild the bundle with `{REBUILD}`")
    if header.get("version") != PROBE_VERSION:
        raise ProbeError(f"{path}: golden probe version {header.get('version')!r}, this code reads {PROBE_VERSION}; "
                         f"rebuild the bundle with `{REBUILD}`")
    vocab = header.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ProbeError(f"{path}: header vocab_size must be an integer >= 1, got {vocab!r}")
    if not isinstance((header.get("golden") or {}).get(PROBE_KNOBS), dict):
        raise ProbeError(f"{path}: the header names no knobs the golden ran with; rebuild the bundle with `{REBUILD}`")
    records = tuple(_record(path, arrays, e, vocab) for e in header.get("records") or [])
    if not records:
        raise ProbeError(f"{path}: the header lists no records")
    return GoldenProbe(vocab, records, dict(header.get("golden") or {}))


def _record(path: Path, arrays: dict[str, np.ndarray], entry: Any, vocab: int) -> ProbeRecord:
    case, form = (entry.get("case"), entry.get("form")) if isinstance(entry, dict) else (None, None)
    if case not in CASES or form not in FORMS:
        raise ProbeError(f"{path}: record {entry!r} must name a case in {CASES} and a form in {FORMS}")
    got = {}
    for f, dtype in FIELDS.items():
        key = f"{case}.{form}.{f}"
        if key not in arrays or arrays[key].dtype != np.dtype(dtype):
            raise ProbeError(f"{path}: array {key!r} missing or not {np.dtype(dtype).name}")
        got[f] = arrays[key]
    rec = ProbeRecord(case, form, **got)
    problem = _shape_problem(rec, vocab)
    if problem:
        raise ProbeError(f"{path}: record {rec.key}: {problem}")
    return rec


def _shape_problem(r: ProbeRecord, vocab: int) -> str | None:
    """What in a record's arrays disagrees with the others (None: nothing). Checked in order, each only once the
    ones before it hold (a 2-D `ids` is named as such, not met with an arithmetic error)."""
    if not all(a.ndim == 1 for a in (r.ids, r.calls, r.tokens, r.top1, r.margin, r.scale, r.sel_gap,
                                     r.logit_outputs, r.sel_layers, r.sel_rows, r.tiers)):
        return "an array meant to be 1-D is not"
    t, g, k = len(r.ids), len(r.tokens), r.outputs
    checks = [
        (lambda: t >= 1 and g >= 1 and len(r.calls) >= 1 and (r.calls >= 1).all() and int(r.calls.sum()) == t,
         f"calls {r.calls.tolist()} do not split the {t} prompt tokens"),
        (lambda: len(r.top1) == len(r.margin) == len(r.scale) == len(r.sel_gap) == k,
         f"top1 / margin / scale / sel_gap must have {k} entries"),
        (lambda: ((r.ids >= 0) & (r.ids < vocab)).all() and ((r.tokens >= 0) & (r.tokens < vocab)).all(),
         f"token ids outside 0..{vocab - 1}"),
        (lambda: r.logits.shape == (len(r.logit_outputs), vocab), f"logits must be [P, {vocab}]"),
        (lambda: ((r.logit_outputs >= 0) & (r.logit_outputs < k)).all() and (np.diff(r.logit_outputs) > 0).all(),
         f"logit_outputs must ascend within 0..{k - 1}"),
        (lambda: ((r.sel_rows >= 0) & (r.sel_rows < r.positions)).all() and (np.diff(r.sel_rows) > 0).all(),
         f"sel_rows must ascend within 0..{r.positions - 1}"),
        (lambda: r.sel_bits.shape == (len(r.sel_layers), len(r.sel_rows), -(-r.positions // 8)),
         "sel_bits has the wrong shape"),
        (lambda: r.tiers.shape == (4,), "tiers must hold 4 counts"),
    ]
    return next((why for ok, why in checks if not ok()), None)
