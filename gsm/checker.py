"""`python -m gsm verify DIR`: is this directory a real, intact GSM checkpoint?

Why a dedicated checker: a "Flash"/GSM name proves nothing (community re-quantisations drop the
GSM tensors), and the builder must refuse a bad input before spending an hour on an engine. The
checker evaluates the five marks of spec section 1, every shape against config.json, dtypes,
NaN/Inf (chunk by chunk, never a whole model in memory), the gsm_config checksum, sharding,
the manifest, the calibration file and the tokenizer. Hostile input never produces a traceback:
every problem becomes an error with a stable code from `ERROR_CODES` (also docs/checker.md).

Decisions:
- dtypes: every model tensor must be a float tensor whose dtype is the config's torch_dtype or
  F32 (full-precision norms/biases/singular values are common and harmless); F64 is rejected.
- marks that cannot be evaluated (config.json unusable, or a weight file unreadable) are reported
  false without an error of their own; the error that prevented the evaluation is reported.
- unlisted files are a manifest error (an added file is as suspicious as a changed one).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gsm import names, tiers
from gsm.atomic import MANIFEST_NAME, ManifestError, is_inside, verify_manifest
from gsm.checkpoint import (
    CALIB_FILE,
    CONFIG_FILE,
    CONFIG_PARSE_ERRORS,
    QUANT_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    CheckpointTensors,
    read_json,
)
from gsm.config import KVQuantConfig, ModelConfig, gsm_checksum
from gsm.safetensors_io import FLOAT_DTYPES, LazySafetensors, SafetensorsFormatError

# The one table of error codes: code -> what it means. docs/checker.md repeats it.
ERROR_CODES: dict[str, str] = {
    "DIR_NOT_FOUND": "the checkpoint directory does not exist",
    "NOT_A_DIRECTORY": "the path exists but is not a directory",
    "SYMLINK_ESCAPE": "a file is a symlink resolving outside the directory (or a symlink loop)",
    "FILE_UNREADABLE": "a checkpoint file cannot be read (I/O error, or it is a directory)",
    "CONFIG_MISSING": "config.json is missing",
    "CONFIG_INVALID_JSON": "config.json is not valid UTF-8 JSON",
    "CONFIG_INVALID": "config.json parses but breaks spec section 2 (ModelConfig rejects it)",
    "CONFIG_SHARING_INVALID": "kv_sharing / shared_layers disagree (source not in shared_layers, ...)",
    "CHECKSUM_MISSING": "gsm_config has no checksum",
    "CHECKSUM_MISMATCH": "gsm_config.checksum differs from the sha256 of its canonical JSON",
    "QUANT_MISSING": "quant_config.json is missing",
    "QUANT_INVALID_JSON": "quant_config.json is not valid UTF-8 JSON",
    "QUANT_INVALID": "quant_config.json kv_quantization breaks spec section 5",
    "MARK_GSM_CONFIG": "mark 1: config.json has no gsm_config object",
    "MARK_SPARSE_MASK_GENERATOR": "mark 2: no self_attn.sparse_mask_generator.* tensor at all",
    "MARK_SVD_FACTORS": "mark 3: a KV-owning layer lacks one of k/v_svd_U/S/Vt",
    "MARK_KV_PROJECTOR": "mark 4: a sharing layer lacks kv_projector, or an owning layer has one",
    "MARK_ADAPTIVE_QUANT": "mark 5: quant_config.json lacks scheme 'adaptive' with bit_widths [16, 12, 8] "
                           "or [16, 12, 8, 4]",
    "WEIGHTS_MISSING": "neither model.safetensors nor model.safetensors.index.json exists",
    "WEIGHTS_AMBIGUOUS": "both model.safetensors and model.safetensors.index.json exist",
    "INDEX_INVALID_JSON": "model.safetensors.index.json is not valid UTF-8 JSON",
    "INDEX_INVALID": "the index has no weight_map object of tensor name -> shard file",
    "SHARD_MISSING": "a shard named by the index does not exist",
    "SHARD_PATH_ESCAPE": "the index names a shard path that is absolute or leaves the directory",
    "INDEX_TENSOR_NOT_IN_SHARD": "the index maps a tensor to a shard that does not hold it",
    "SHARD_TENSOR_NOT_IN_INDEX": "a shard holds a tensor the index does not map to that shard",
    "TENSOR_DUPLICATE": "the same tensor is stored in two shards",
    "SAFETENSORS_HEADER_SIZE": "safetensors header length is absurd (> 100 MiB)",
    "SAFETENSORS_TRUNCATED": "safetensors file shorter than its header says (truncated)",
    "SAFETENSORS_HEADER_JSON": "safetensors header is not a JSON object (or __metadata__ is not str->str)",
    "SAFETENSORS_DTYPE": "safetensors header names an unknown dtype",
    "SAFETENSORS_ENTRY": "safetensors header entry is malformed (shape not a list of ints, ...)",
    "SAFETENSORS_OFFSETS": "data_offsets lie: wrong size for dtype/shape, overlap, gap or uncovered bytes",
    "TENSOR_MISSING": "a tensor spec section 3 requires is absent (outside the five marks)",
    "TENSOR_UNEXPECTED": "a tensor that spec section 3 does not allow for this config",
    "SHAPE_MISMATCH": "a tensor's shape differs from the one config.json implies",
    "RANK_MISMATCH": "U / S / Vt of one layer disagree on the latent rank",
    "RANK_INVALID": "a latent rank is 0 or exceeds min(kvD, H)",
    "DTYPE_NOT_FLOAT": "a model or calibration tensor is not a floating-point tensor",
    "DTYPE_MISMATCH": "a float tensor is neither the config's torch_dtype nor F32",
    "TENSOR_NONFINITE": "a tensor holds NaN or Inf",
    "MANIFEST_INVALID": "manifest.json exists but is not a gsm-edge manifest v1",
    "MANIFEST_MISMATCH": "a file is missing, changed or unlisted with respect to manifest.json",
    "CALIB_TENSOR_MISSING": "kv_calibration.safetensors lacks scale_int8/comp_int8 of an owning layer (or the "
                            "index_key.scale_int8 that index_key_bits 8 needs)",
    "CALIB_SHAPE_MISMATCH": "a calibration tensor's shape is not [rank of its latent] ([indexer dim] for a key's)",
    "CALIB_SCALE_INVALID": "a calibration scale is not positive and finite (or comp is not finite)",
    "CALIB_UNEXPECTED": "kv_calibration.safetensors holds a tensor spec section 5 does not name",
    "TOKENIZER_INVALID": "tokenizer.json does not load, or has more tokens than vocab_size",
    "INTERNAL": "the checker itself failed on this input (a bug: please report it)",
}

MARKS = ("gsm_config", "sparse_mask_generator", "svd_factors", "kv_projector", "adaptive_quant")
MAX_ERRORS_PER_CODE = 20  # a model with every shape wrong need not print 10,000 lines
MAX_LAYERS = 4096  # far beyond any real model; bounds the work a hostile config can ask for
_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_GSM_INT_FIELDS = ("sparse_window", "max_sparse_window", "sparse_top_k", "sink_tokens",
                   "indexer_heads", "indexer_dim", "quantization_adaptation_rate")


@dataclass(frozen=True)
class VerifyError:
    code: str
    file: str | None
    tensor: str | None
    message: str


@dataclass
class VerifyReport:
    ok: bool
    marks: dict[str, bool]
    errors: list[VerifyError] = field(default_factory=list)
    params: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "marks": dict(self.marks),
                "errors": [{"code": e.code, "file": e.file, "tensor": e.tensor, "message": e.message}
                           for e in self.errors],
                "params": self.params}

    @property
    def codes(self) -> list[str]:
        return [e.code for e in self.errors]


class _Checker:
    def __init__(self, d: Path) -> None:
        self.dir = d
        self.marks = dict.fromkeys(MARKS, False)
        self.errors: list[VerifyError] = []
        self._counts: dict[str, int] = {}
        self._seen: set[tuple[str, str | None, str | None]] = set()
        self.params = 0
        self.cfg: ModelConfig | None = None
        self.ranks: dict[int, tuple[int, int]] = {}
        self.quant: KVQuantConfig | None = None

    # reporting
    def error(self, code: str, file: str | os.PathLike[str] | None, tensor: str | None,
              message: str) -> None:
        if code not in ERROR_CODES:  # a checker bug, not an input problem
            message, code = f"undocumented code {code}: {message}", "INTERNAL"
        rel = self._rel(file)
        if (code, rel, tensor) in self._seen:
            return
        self._seen.add((code, rel, tensor))
        n = self._counts[code] = self._counts.get(code, 0) + 1
        if n <= MAX_ERRORS_PER_CODE:
            self.errors.append(VerifyError(code, rel, tensor, message))
        elif n == MAX_ERRORS_PER_CODE + 1:
            self.errors.append(VerifyError(code, None, None, f"further {code} errors not listed"))

    def _rel(self, file: str | os.PathLike[str] | None) -> str | None:
        if file is None:
            return None
        p = Path(file)
        if p == self.dir:
            return str(p)
        try:
            return p.relative_to(self.dir).as_posix() or "."
        except ValueError:
            return str(p)

    def from_exc(self, e: CheckpointError | SafetensorsFormatError) -> None:
        file = e.file if isinstance(e, CheckpointError) else e.path
        self.error(e.code, file, e.tensor, str(e))

    def report(self) -> VerifyReport:
        return VerifyReport(ok=not self.errors, marks=self.marks, errors=self.errors,
                            params=self.params)

    # checks, in the order a reader would want them
    def run(self) -> None:
        if not self.dir.exists() and not self.dir.is_symlink():
            self.error("DIR_NOT_FOUND", self.dir, None, f"{self.dir}: no such directory")
            return
        if not self.dir.is_dir():
            self.error("NOT_A_DIRECTORY", self.dir, None, f"{self.dir}: not a directory")
            return
        self.bad_links = self._check_symlinks()
        self._check_config()
        self._check_quant()
        tensors = CheckpointTensors(self.dir, strict=False, reject_outside_links=True)
        for p in tensors.problems:
            self.from_exc(p)
        # Only these leave every tensor locatable; after any other problem some tensors are
        # unknown, and mark/missing-tensor verdicts would blame the wrong thing.
        complete = all(p.code in ("WEIGHTS_AMBIGUOUS", "TENSOR_DUPLICATE") for p in tensors.problems)
        self._check_tensors(tensors, complete=complete)
        self._check_manifest()
        self._check_calibration()
        self._check_tokenizer()

    def _check_symlinks(self) -> set[str]:
        base = self.dir.resolve()
        bad: set[str] = set()
        for dirpath, dirs, files in os.walk(self.dir, followlinks=False):
            for name in dirs + files:
                p = Path(dirpath) / name
                if p.is_symlink() and not is_inside(base, p):
                    rel = p.relative_to(self.dir).as_posix()
                    bad.add(rel)
                    self.error("SYMLINK_ESCAPE", p, None, f"{rel}: symlink to {os.readlink(p)!r} "
                               f"resolves outside {self.dir} (or loops)")
        return bad

    def _json(self, name: str, prefix: str) -> Any | None:
        if name in self.bad_links:
            return None
        try:
            return read_json(self.dir / name, code_prefix=prefix)
        except CheckpointError as e:
            self.from_exc(e)
            return None

    def _check_config(self) -> None:
        data = self._json(CONFIG_FILE, "CONFIG")
        if data is None:
            return
        path = self.dir / CONFIG_FILE
        gc = data.get("gsm_config") if isinstance(data, dict) else None
        if not isinstance(gc, dict):
            self.error("MARK_GSM_CONFIG", path, None, f"{CONFIG_FILE}: no gsm_config object "
                       "(mark 1 of spec section 1)")
            return
        self.marks["gsm_config"] = True
        if "checksum" not in gc:
            self.error("CHECKSUM_MISSING", path, None, f"{CONFIG_FILE}: gsm_config.checksum missing; "
                       f"expected {gsm_checksum(gc)}")
        elif gc["checksum"] != gsm_checksum(gc):
            self.error("CHECKSUM_MISMATCH", path, None, f"{CONFIG_FILE}: gsm_config.checksum is "
                       f"{gc['checksum']!r}, the canonical JSON hashes to {gsm_checksum(gc)}")
        try:
            cfg = ModelConfig.from_json(data)
        except CONFIG_PARSE_ERRORS as e:
            self.error("CONFIG_INVALID", path, None, f"{CONFIG_FILE}: {e}")
            return
        problems = []
        if cfg.num_hidden_layers > MAX_LAYERS:
            problems.append(f"num_hidden_layers {cfg.num_hidden_layers} exceeds {MAX_LAYERS}")
        for k in _GSM_INT_FIELDS:
            v = getattr(cfg.gsm, k)
            if not isinstance(v, int) or isinstance(v, bool):
                problems.append(f"gsm_config.{k} must be an integer, got {v!r}")
        for k in ("rms_norm_eps", "rope_theta"):
            v = getattr(cfg, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf:
                problems.append(f"{k} must be a positive number, got {v!r}")
        if not isinstance(cfg.tie_word_embeddings, bool):
            problems.append(f"tie_word_embeddings must be true/false, got {cfg.tie_word_embeddings!r}")
        if problems:
            self.error("CONFIG_INVALID", path, None, f"{CONFIG_FILE}: " + "; ".join(problems))
            return
        layers = range(cfg.num_hidden_layers)
        shared = [s for s in cfg.gsm.shared_layers if isinstance(s, int) and not isinstance(s, bool)]
        for s in cfg.gsm.shared_layers:
            if s not in shared or s not in layers or not cfg.is_owning(s):
                self.error("CONFIG_SHARING_INVALID", path, None, f"{CONFIG_FILE}: gsm_config."
                           f"shared_layers holds {s!r}, expected KV-owning layer indices "
                           f"0..{cfg.num_hidden_layers - 1}")
        fatal = False
        for dst, src in sorted(cfg.gsm.kv_sharing.items()):
            if src not in layers:  # shapes of layer dst would be undefined
                fatal = True
                self.error("CONFIG_SHARING_INVALID", path, None, f"{CONFIG_FILE}: gsm_config."
                           f"kv_sharing maps layer {dst} to {src}, not a layer index")
            elif src not in shared:
                self.error("CONFIG_SHARING_INVALID", path, None, f"{CONFIG_FILE}: gsm_config."
                           f"kv_sharing maps layer {dst} to {src}, which is not in shared_layers "
                           f"{sorted(shared)}")
        if not fatal:
            self.cfg = cfg

    def _check_quant(self) -> None:
        data = self._json(QUANT_FILE, "QUANT")
        if data is None:
            return
        path = self.dir / QUANT_FILE
        q = data.get("kv_quantization") if isinstance(data, dict) else None
        if not isinstance(q, dict) or q.get("scheme") != "adaptive" or \
                q.get("bit_widths") not in [list(b) for b in tiers.BIT_WIDTHS]:
            got = {k: q.get(k) for k in ("scheme", "bit_widths")} if isinstance(q, dict) else q
            self.error("MARK_ADAPTIVE_QUANT", path, None, f"{QUANT_FILE}: kv_quantization must have "
                       f"scheme 'adaptive' and bit_widths {list(tiers.BIT_WIDTHS_V1)} (or GSM_SPEC v2's "
                       f"{list(tiers.BIT_WIDTHS_V2)}), got {got!r}")
            return
        self.marks["adaptive_quant"] = True
        try:
            self.quant = KVQuantConfig.from_json(data)
        except CONFIG_PARSE_ERRORS as e:
            self.error("QUANT_INVALID", path, None, f"{QUANT_FILE}: {e}")

    def _file_of(self, t: CheckpointTensors, name: str) -> Path:
        return self.dir / t.where[name]

    def _check_tensors(self, t: CheckpointTensors, *, complete: bool) -> None:
        present = set(t.names)
        self.params = sum(math.prod(t.shape(n)) for n in t.names)
        self.marks["sparse_mask_generator"] = any(names.MASK_GENERATOR_MARK in n for n in present)
        cfg = self.cfg
        allowed = {"F32", _ST_DTYPE[cfg.torch_dtype]} if cfg else {"F32", "F16", "BF16"}
        for n in t.names:
            self._check_values(t.reader(n), n, allowed)
        if cfg is None or not complete:
            self.marks["sparse_mask_generator"] &= complete
            return
        marked = self._check_marks(present)
        self.ranks, unknown = self._ranks(t, present)
        filled = {i: self.ranks.get(i, (-1, -1)) for i in cfg.owning_layers}
        expected = names.expected_shapes(cfg, filled)
        optional = names.optional_shapes(cfg)
        for n, shape in expected.items():
            if n not in present and n not in marked:
                self.error("TENSOR_MISSING", None, n, f"tensor {n} {list(shape)} missing "
                           f"(config.json: {cfg.num_hidden_layers} layers, "
                           f"kv_sharing {cfg.gsm.kv_sharing})")
        for n in t.names:
            want = expected.get(n, optional.get(n))
            if want is None:
                if n not in marked:
                    self.error("TENSOR_UNEXPECTED", self._file_of(t, n), n,
                               f"tensor {n} is not part of a GSM checkpoint with this config.json")
            elif n not in unknown and -1 not in want and t.shape(n) != want:
                self.error("SHAPE_MISMATCH", self._file_of(t, n), n,
                           f"tensor {n} has shape {list(t.shape(n))}, config.json implies {list(want)}")

    def _check_values(self, r: LazySafetensors, n: str, allowed: set[str]) -> None:
        dtype = r.dtype(n)
        if dtype not in FLOAT_DTYPES:
            self.error("DTYPE_NOT_FLOAT", r.path, n, f"tensor {n} is {dtype}, expected a float tensor")
            return
        if dtype not in allowed:
            self.error("DTYPE_MISMATCH", r.path, n, f"tensor {n} is {dtype}, expected one of "
                       f"{sorted(allowed)} (config torch_dtype or F32)")
        try:
            bad = r.count_nonfinite(n)
        except SafetensorsFormatError as e:
            self.from_exc(e)
            return
        except OSError as e:
            self.error("FILE_UNREADABLE", r.path, n, f"{r.path}: reading {n} failed ({e})")
            return
        if bad:
            self.error("TENSOR_NONFINITE", r.path, n, f"tensor {n} holds {bad} NaN/Inf value(s)")

    def _check_marks(self, present: set[str]) -> set[str]:
        """Marks 2-4; returns the tensor names their errors already cover."""
        cfg = self.cfg
        assert cfg is not None
        covered: set[str] = set()
        if not self.marks["sparse_mask_generator"]:
            idx = [names.layer_name(k, i) for i in cfg.owning_layers for k in ("idx_q", "idx_k", "idx_w")]
            covered.update(idx)
            self.error("MARK_SPARSE_MASK_GENERATOR", None, idx[0] if idx else None,
                       "no self_attn.sparse_mask_generator.* tensor in the checkpoint (mark 2); "
                       f"first expected: {idx[0] if idx else None}")
        svd = [names.layer_name(k, i) for i in cfg.owning_layers
               for k in ("k_U", "k_S", "k_Vt", "v_U", "v_S", "v_Vt")]
        missing = [n for n in svd if n not in present]
        covered.update(missing)
        self.marks["svd_factors"] = not missing
        if missing:
            self.error("MARK_SVD_FACTORS", None, missing[0], f"{len(missing)} SVD factor tensor(s) of "
                       f"KV-owning layers missing (mark 3), first {missing[0]}")
        proj = []
        for i in range(cfg.num_hidden_layers):
            for k in ("proj_w", "proj_b"):
                n = names.layer_name(k, i)
                if cfg.is_owning(i) == (n in present):
                    proj.append((n, "present in KV-owning layer" if cfg.is_owning(i) else
                                 f"missing in layer {i}, which shares layer {cfg.gsm.kv_sharing.get(i)}"))
        covered.update(n for n, _ in proj)
        self.marks["kv_projector"] = not proj
        if proj:
            self.error("MARK_KV_PROJECTOR", None, proj[0][0], f"{len(proj)} kv_projector problem(s) "
                       f"(mark 4), first {proj[0][0]}: {proj[0][1]}")
        return covered

    def _ranks(self, t: CheckpointTensors, present: set[str]
               ) -> tuple[dict[int, tuple[int, int]], set[str]]:
        """(r_k, r_v) from the S tensors, checked against U and Vt; names already reported."""
        cfg = self.cfg
        assert cfg is not None
        ranks: dict[int, tuple[int, int]] = {}
        reported: set[str] = set()
        for i in cfg.owning_layers:
            r: list[int] = []
            for x in ("k", "v"):
                u, s, vt = (names.layer_name(f"{x}_{k}", i) for k in ("U", "S", "Vt"))
                if s not in present or len(t.shape(s)) != 1:
                    if s in present:
                        self.error("SHAPE_MISMATCH", self._file_of(t, s), s, f"tensor {s} has shape "
                                   f"{list(t.shape(s))}, expected [rank]")
                        reported.add(s)
                    break
                rank = t.shape(s)[0]
                if rank < 1 or rank > min(cfg.kv_dim, cfg.hidden_size):
                    self.error("RANK_INVALID", self._file_of(t, s), s, f"layer {i} {x} latent rank "
                               f"{rank} outside 1..min(kvD={cfg.kv_dim}, H={cfg.hidden_size})")
                for n, axis in ((u, 1), (vt, 0)):
                    shape = t.shape(n) if n in present else None
                    if shape is not None and len(shape) == 2 and shape[axis] != rank:
                        self.error("RANK_MISMATCH", self._file_of(t, n), n, f"tensor {n} has shape "
                                   f"{list(shape)}: rank {shape[axis]}, but {s} has rank {rank}")
                        reported.add(n)
                r.append(rank)
            if len(r) == 2:
                ranks[i] = (r[0], r[1])
        return ranks, reported

    def _check_manifest(self) -> None:
        if not (self.dir / MANIFEST_NAME).exists() or MANIFEST_NAME in self.bad_links:
            return
        try:
            problems = verify_manifest(self.dir)
        except ManifestError as e:
            self.error("MANIFEST_INVALID", self.dir / MANIFEST_NAME, None, str(e))
            return
        for p in problems:
            self.error("MANIFEST_MISMATCH", self.dir / p.split(":", 1)[0], None, p)

    def _check_calibration(self) -> None:
        path = self.dir / CALIB_FILE
        if not path.exists() and self.quant is not None and self.quant.int8_keys:
            self.error("CALIB_TENSOR_MISSING", path, None, f"{CALIB_FILE} is missing, but {QUANT_FILE} index_key_bits "
                       "is 8: the INT8 indexer keys need their scales (index_key.scale_int8 of every owning layer)")
        if not path.exists() or CALIB_FILE in self.bad_links:
            return
        try:
            f = LazySafetensors(path)
        except SafetensorsFormatError as e:
            self.from_exc(e)
            return
        except OSError as e:
            self.error("FILE_UNREADABLE", path, None, f"{path}: unreadable ({e})")
            return
        for n in f.names:
            self._check_values(f, n, {"F32", "F16", "BF16"})
        if self.cfg is None or not self.marks["svd_factors"]:
            return  # ranks unknown: names and values only
        expected: dict[str, tuple[int, ...]] = {names.HEAD_INPUT_MOMENT: (self.cfg.hidden_size,) * 2}
        for i, (rk, rv) in self.ranks.items():
            for x, r in (("k", rk), ("v", rv)):
                for what in names.CALIB_TENSORS:
                    expected[names.calib_name(i, x, what)] = (r,)
                    if what in names.CALIB_REQUIRED and names.calib_name(i, x, what) not in f:
                        n = names.calib_name(i, x, what)
                        self.error("CALIB_TENSOR_MISSING", path, n, f"{CALIB_FILE}: {n} [{r}] missing")
            n, d_i = names.index_key_scale_name(i), self.cfg.gsm.indexer_dim
            expected[n] = (d_i,)
            if self.quant is not None and self.quant.int8_keys and n not in f:
                self.error("CALIB_TENSOR_MISSING", path, n, f"{CALIB_FILE}: {n} [{d_i}] missing "
                           f"({QUANT_FILE} index_key_bits is 8)")
        for n in f.names:
            if n not in expected:
                self.error("CALIB_UNEXPECTED", path, n, f"{CALIB_FILE}: {n} is not a spec section 5 "
                           f"name of a KV-owning layer, nor {names.HEAD_INPUT_MOMENT}")
            elif f.shape(n) != expected[n]:
                what = ("the hidden size, twice" if n == names.HEAD_INPUT_MOMENT
                        else "the indexer dim" if ".index_key." in n else "the latent rank")
                self.error("CALIB_SHAPE_MISMATCH", path, n, f"{CALIB_FILE}: {n} has shape "
                           f"{list(f.shape(n))}, expected {list(expected[n])} ({what})")
            elif f.dtype(n) in FLOAT_DTYPES:
                a = f.array(n)
                bad = ~(a > 0) | ~(a < math.inf) if "scale" in n else ~(abs(a) < math.inf)
                if bad.any():
                    self.error("CALIB_SCALE_INVALID", path, n, f"{CALIB_FILE}: {n} has "
                               f"{int(bad.sum())} value(s) that are not "
                               f"{'positive and finite' if 'scale' in n else 'finite'}")

    def _check_tokenizer(self) -> None:
        path = self.dir / TOKENIZER_FILE
        if not path.exists() or TOKENIZER_FILE in self.bad_links:
            return
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_str(path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            self.error("TOKENIZER_INVALID", path, None, f"{TOKENIZER_FILE}: unreadable ({e})")
            return
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            self.error("TOKENIZER_INVALID", path, None, f"{TOKENIZER_FILE}: does not load ({e})")
            return
        n = tok.get_vocab_size(with_added_tokens=True)
        if self.cfg is not None and n > self.cfg.vocab_size:
            self.error("TOKENIZER_INVALID", path, None, f"{TOKENIZER_FILE}: {n} tokens, config.json "
                       f"vocab_size is {self.cfg.vocab_size} (ids beyond the embedding)")


def verify(d: str | os.PathLike[str]) -> VerifyReport:
    """Check checkpoint directory `d`; never raises on bad input (problems are in the report)."""
    c = _Checker(Path(d))
    try:
        c.run()
    except Exception as e:  # hostile input must give a report, never a traceback
        c.error("INTERNAL", None, None, f"checker failed: {type(e).__name__}: {e}")
    return c.report()


def _print_human(d: str | os.PathLike[str], r: VerifyReport) -> None:
    from rich.table import Table

    from gsm.cli_support import console as make_console

    console = make_console(stderr=False, highlight=False)
    marks = Table(title=f"GSM checkpoint {d}", title_justify="left")
    marks.add_column("mark")
    marks.add_column("", justify="center")
    for m in MARKS:
        marks.add_row(m, "[green]✓[/]" if r.marks[m] else "[red]✗[/]")
    console.print(marks)
    if r.errors:
        errs = Table(title=f"{len(r.errors)} error(s)", title_justify="left", show_lines=False)
        errs.add_column("code", no_wrap=True)
        for col in ("file", "tensor", "message"):
            errs.add_column(col, overflow="fold")
        for e in r.errors:
            errs.add_row(f"[red]{e.code}[/]", e.file or "", e.tensor or "", e.message)
        console.print(errs)
    console.print(f"params: {r.params:,}")
    console.print("[green]OK: a valid GSM checkpoint[/]" if r.ok
                  else "[red]NOT a valid GSM checkpoint[/]")


def verify_command(d: str | os.PathLike[str], *, as_json: bool = False) -> int:
    """CLI body of `python -m gsm verify`: 0 when the checkpoint is valid, 1 otherwise."""
    r = verify(d)
    if as_json:
        sys.stdout.write(json.dumps(r.to_json(), indent=2) + "\n")
    else:
        _print_human(d, r)
    return 0 if r.ok else 2  # bad input (gsm.cli_support convention)
