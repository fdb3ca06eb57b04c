"""Read and write GSM checkpoint directories (spec section 1).

One module owns the file layout so the golden model, the converter, the synthesiser and the
builder never disagree on it. Reading is lazy (headers first, one tensor at a time, shards via
`model.safetensors.index.json` as Hugging Face writes them); writing streams through
`StreamingSafetensorsWriter` inside an `atomic_output_dir`, so peak memory is about one tensor
and a crash leaves nothing behind.

Errors are `CheckpointError`s naming the file (and tensor), with a stable `code` from the
checker's table (gsm/checker.py, docs/checker.md), so the checker can report loader failures
without a second implementation of the same rules.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gsm import names
from gsm.atomic import MANIFEST_NAME, atomic_output_dir, is_inside
from gsm.config import ConfigError, KVQuantConfig, ModelConfig
from gsm.remote_code import REMOTE_FILES, install_remote_code
from gsm.safetensors_io import (
    LazySafetensors,
    SafetensorsFormatError,
    StreamingSafetensorsWriter,
    TensorSpec,
)

CONFIG_FILE = "config.json"
QUANT_FILE = "quant_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CALIB_FILE = "kv_calibration.safetensors"
CALIB_REPORT_FILE = "calibration_report.json"  # `calibration run`'s measurements beside its tables
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # HF's: bos/eos tokens, add_bos_token, chat_template
# metadata["format"] of the AWQ input-scales file `python -m calibration.awq` writes and the builder reads
AWQ_SCALES_FORMAT = "gsm-edge-awq-scales"
# from_json raises ConfigError for what it checks; wrongly-typed JSON it does not check can leak
# the others (e.g. an empty eos_token_id list: IndexError)
CONFIG_PARSE_ERRORS = (ConfigError,)  # from_json turns every malformed field into a ConfigError
STANDARD_FILES = frozenset({CONFIG_FILE, QUANT_FILE, WEIGHTS_FILE, INDEX_FILE, MANIFEST_NAME, *REMOTE_FILES})


class CheckpointError(ValueError):
    """A checkpoint file is missing or wrong; `code` is a stable checker error code."""

    def __init__(self, message: str, *, file: str | os.PathLike[str] | None = None,
                 tensor: str | None = None, code: str) -> None:
        super().__init__(message)
        self.file = None if file is None else str(file)
        self.tensor = tensor
        self.code = code
        self.message = message


class CheckpointConfigError(CheckpointError, ConfigError):
    """config.json / quant_config.json parse but break the spec; catchable as either parent."""


def shard_name(i: int, n: int) -> str:
    """Hugging Face shard naming: model-00001-of-00003.safetensors (1-based)."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def read_json(path: Path, *, code_prefix: str, missing_code: str | None = None) -> Any:
    """JSON of `path`; CheckpointError `<prefix>_MISSING` (or missing_code) / `<prefix>_INVALID_JSON`."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing", file=path,
                              code=missing_code or f"{code_prefix}_MISSING") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a file", file=path,
                              code="FILE_UNREADABLE") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e})", file=path, code="FILE_UNREADABLE") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 ({e})", file=path,
                              code=f"{code_prefix}_INVALID_JSON") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})", file=path,
                              code=f"{code_prefix}_INVALID_JSON") from None


def load_config(d: str | os.PathLike[str]) -> ModelConfig:
    path = Path(d) / CONFIG_FILE
    data = read_json(path, code_prefix="CONFIG")
    try:
        return ModelConfig.from_json(data)
    except CONFIG_PARSE_ERRORS as e:
        code = "MARK_GSM_CONFIG" if isinstance(data, dict) and "gsm_config" not in data \
            else "CONFIG_INVALID"
        raise CheckpointConfigError(f"{path}: {e}", file=path, code=code) from e


def load_quant(d: str | os.PathLike[str]) -> KVQuantConfig:
    path = Path(d) / QUANT_FILE
    data = read_json(path, code_prefix="QUANT")
    try:
        return KVQuantConfig.from_json(data)
    except CONFIG_PARSE_ERRORS as e:
        raise CheckpointConfigError(f"{path}: {e}", file=path, code="QUANT_INVALID") from e


def _open_safetensors(path: Path, *, missing_code: str) -> LazySafetensors:
    try:
        return LazySafetensors(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing", file=path, code=missing_code) from None
    except SafetensorsFormatError as e:
        raise CheckpointError(str(e), file=path, tensor=e.tensor, code=e.code) from e
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e})", file=path, code="FILE_UNREADABLE") from e


class CheckpointTensors:
    """Lazy view of the model tensors of a checkpoint, single file or sharded.

    strict=True (the default) raises the first CheckpointError. strict=False (the checker) keeps
    going: every problem is appended to `problems` and the tensors that could be located stay
    available, so one bad shard does not hide the state of the others.
    """

    def __init__(self, d: str | os.PathLike[str], *, strict: bool = True,
                 reject_outside_links: bool = False) -> None:
        self.dir = Path(d)
        self.strict = strict
        # Off by default: Hugging Face caches symlink snapshot files to blobs outside the
        # snapshot directory. The checker turns it on: a GSM artefact must be self-contained.
        self.reject_outside_links = reject_outside_links
        self.problems: list[CheckpointError] = []
        self.files: dict[str, LazySafetensors] = {}  # relative file name -> reader
        self.where: dict[str, str] = {}  # tensor name -> relative file name
        self.sharded = False
        single, index = self.dir / WEIGHTS_FILE, self.dir / INDEX_FILE
        if single.exists() and index.exists():
            self._problem(CheckpointError(
                f"{self.dir}: both {WEIGHTS_FILE} and {INDEX_FILE} exist; keep exactly one",
                file=index, code="WEIGHTS_AMBIGUOUS"))
        if single.exists() or not index.exists():
            self._open_single(single)
        else:
            self._open_sharded(index)

    def _escapes(self, path: Path) -> bool:
        """With reject_outside_links, record a problem when path resolves outside the directory."""
        if not self.reject_outside_links or is_inside(self.dir.resolve(), path):
            return False
        self._problem(CheckpointError(f"{path}: symlink resolves outside {self.dir}", file=path,
                                      code="SYMLINK_ESCAPE"))
        return True

    def _problem(self, e: CheckpointError) -> None:
        if self.strict:
            raise e
        self.problems.append(e)

    def _open_single(self, path: Path) -> None:
        if not path.exists():
            self._problem(CheckpointError(f"{self.dir}: no {WEIGHTS_FILE} and no {INDEX_FILE}",
                                          file=path, code="WEIGHTS_MISSING"))
            return
        if self._escapes(path):
            return
        try:
            f = _open_safetensors(path, missing_code="WEIGHTS_MISSING")
        except CheckpointError as e:
            self._problem(e)
            return
        self.files[WEIGHTS_FILE] = f
        self.where = dict.fromkeys(f.names, WEIGHTS_FILE)

    def _open_sharded(self, index_path: Path) -> None:
        self.sharded = True
        if self._escapes(index_path):
            return
        try:
            index = read_json(index_path, code_prefix="INDEX", missing_code="WEIGHTS_MISSING")
        except CheckpointError as e:
            self._problem(e)
            return
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in wmap.items()):
            self._problem(CheckpointError(f"{index_path}: expected an object with a `weight_map` "
                                          "of tensor name -> shard file name", file=index_path,
                                          code="INDEX_INVALID"))
            return
        listed: dict[str, list[str]] = {}
        for tensor, shard in wmap.items():
            listed.setdefault(shard, []).append(tensor)
        seen: dict[str, str] = {}
        for shard in sorted(listed):
            path = self.dir / shard
            # Lexical check: the index may only name files inside the directory.
            if not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
                self._problem(CheckpointError(f"{index_path}: shard path {shard!r} escapes the "
                                              "checkpoint directory", file=index_path,
                                              tensor=listed[shard][0], code="SHARD_PATH_ESCAPE"))
                continue
            if self._escapes(path):
                continue
            try:
                f = _open_safetensors(path, missing_code="SHARD_MISSING")
            except CheckpointError as e:
                if e.code == "SHARD_MISSING":
                    e = CheckpointError(f"{path}: shard listed in {INDEX_FILE} (for "
                                        f"{listed[shard][0]!r}, ...) is missing", file=path,
                                        tensor=listed[shard][0], code="SHARD_MISSING")
                self._problem(e)
                continue
            self.files[shard] = f
            in_file = set(f.names)
            for tensor in listed[shard]:
                if tensor not in in_file:
                    self._problem(CheckpointError(f"{path}: {INDEX_FILE} puts tensor {tensor!r} in "
                                                  "this shard, the shard does not hold it",
                                                  file=path, tensor=tensor,
                                                  code="INDEX_TENSOR_NOT_IN_SHARD"))
            for tensor in f.names:
                if tensor in seen:
                    self._problem(CheckpointError(f"{path}: tensor {tensor!r} is also in "
                                                  f"{seen[tensor]}", file=path, tensor=tensor,
                                                  code="TENSOR_DUPLICATE"))
                    continue
                seen[tensor] = shard
                if wmap.get(tensor) != shard:
                    self._problem(CheckpointError(
                        f"{path}: holds tensor {tensor!r}, {INDEX_FILE} maps it to "
                        f"{wmap.get(tensor)!r}", file=path, tensor=tensor,
                        code="SHARD_TENSOR_NOT_IN_INDEX"))
                    continue
                self.where[tensor] = shard

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def reader(self, name: str) -> LazySafetensors:
        try:
            return self.files[self.where[name]]
        except KeyError:
            raise CheckpointError(f"{self.dir}: no tensor {name!r}", file=self.dir, tensor=name,
                                  code="TENSOR_MISSING") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader(name).shape(name)

    def dtype(self, name: str) -> str:
        return self.reader(name).dtype(name)

    def array(self, name: str) -> np.ndarray:
        """One tensor as float32 (reads only that tensor's bytes)."""
        r = self.reader(name)
        try:
            return r.array(name).astype(np.float32, copy=False)
        except SafetensorsFormatError as e:
            raise CheckpointError(str(e), file=r.path, tensor=name, code=e.code) from e

    def ranks(self, cfg: ModelConfig) -> dict[int, tuple[int, int]]:
        """(r_k, r_v) of every owning layer, from the k_svd_S / v_svd_S shapes."""
        out: dict[int, tuple[int, int]] = {}
        for i in cfg.owning_layers:
            r = []
            for key in ("k_S", "v_S"):
                name = names.layer_name(key, i)
                shape = self.shape(name)
                if len(shape) != 1:
                    raise CheckpointError(f"{self.dir}: {name} has shape {shape}, expected [rank]",
                                          file=self.dir / self.where[name], tensor=name,
                                          code="SHAPE_MISMATCH")
                r.append(shape[0])
            out[i] = (r[0], r[1])
        return out


def load_state_dict(d: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every model tensor as float32, in memory: for small models and tests only."""
    t = CheckpointTensors(d)
    return {name: t.array(name) for name in t.names}


def load_kv_calibration(d: str | os.PathLike[str]) -> dict[str, np.ndarray] | None:
    """kv_calibration.safetensors as float32 arrays (spec 5), or None before calibration."""
    path = Path(d) / CALIB_FILE
    if not path.exists():
        return None
    f = _open_safetensors(path, missing_code="FILE_UNREADABLE")
    return {n: f.array(n).astype(np.float32, copy=False) for n in f.names}


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Greedy, in spec order: start a new shard when the next tensor would exceed the limit."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if max_shard_bytes is not None and shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class CheckpointFiles:
    """The files a checkpoint holds beside its tensors, config.json and quant_config.json: tokenizer.json (its
    text), tokenizer_config.json (a JSON object) and any others by relative path (`extra`: name -> bytes)."""

    tokenizer_json: str | None = None
    tokenizer_config: dict[str, Any] | None = None
    extra: Mapping[str, bytes] = field(default_factory=dict)

    def check(self, out_dir: Path) -> None:
        """ValueError for an extra file that would replace a checkpoint file or land outside `out_dir`."""
        for rel in self.extra:
            if rel in STANDARD_FILES or rel == TOKENIZER_FILE and self.tokenizer_json is not None \
                    or rel == TOKENIZER_CONFIG_FILE and self.tokenizer_config is not None \
                    or Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"extra file name {rel!r} clashes with a checkpoint file or escapes "
                                 f"{out_dir}")

    def write(self, directory: Path) -> None:
        if self.tokenizer_json is not None:
            (directory / TOKENIZER_FILE).write_text(self.tokenizer_json, encoding="utf-8")
        if self.tokenizer_config is not None:
            _dump_json(directory / TOKENIZER_CONFIG_FILE, self.tokenizer_config)
        for rel, data in self.extra.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_bytes(data)


def write_checkpoint(out_dir: str | os.PathLike[str], cfg: ModelConfig, quant: KVQuantConfig,
                     specs: list[TensorSpec], produce: Callable[[TensorSpec], np.ndarray], *,
                     files: CheckpointFiles | None = None, max_shard_bytes: int | None = None,
                     overwrite: bool = False, progress: bool = True) -> Path:
    """Write a checkpoint directory atomically, calling `produce(spec)` once per tensor in order.

    Each produced array is written and dropped before the next is asked for, so peak memory is
    about the largest tensor. Shards (`model-0000i-of-0000N.safetensors` + index) are written
    when the tensors exceed `max_shard_bytes`; otherwise one `model.safetensors`. `files`: the tokenizer and
    other files beside the tensors (none when None).
    """
    out_dir = Path(out_dir)
    files = files if files is not None else CheckpointFiles()
    files.check(out_dir)
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"tensor {s.name!r} listed twice in specs")
        seen.add(s.name)
    plan = plan_shards(specs, max_shard_bytes)
    total = sum(s.nbytes for s in specs)
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        config = cfg.to_json()
        config["auto_map"] = install_remote_code(tmp)  # AutoModelForCausalLM(..., trust_remote_code=True)
        _dump_json(tmp / CONFIG_FILE, config)
        _dump_json(tmp / QUANT_FILE, quant.to_json())
        files.write(tmp)
        files = [WEIGHTS_FILE] if len(plan) == 1 else \
            [shard_name(i + 1, len(plan)) for i in range(len(plan))]
        with _Progress(total, f"writing {out_dir.name}", enabled=progress) as bar:
            for fname, shard in zip(files, plan):
                with StreamingSafetensorsWriter(tmp / fname, shard, {"format": "pt"}) as w:
                    for s in shard:
                        w.write(s.name, produce(s))  # the array is dropped right after writing
                        bar.advance(s.nbytes)
        if len(plan) > 1:
            _dump_json(tmp / INDEX_FILE, {
                "metadata": {"total_size": total},
                "weight_map": {s.name: f for f, shard in zip(files, plan) for s in shard}})
    return out_dir


def write_checkpoint_arrays(out_dir: str | os.PathLike[str], cfg: ModelConfig, quant: KVQuantConfig,
                            arrays: dict[str, np.ndarray], dtype: str = "F32", **kw: Any) -> Path:
    """write_checkpoint for tensors already in memory (small models, tests)."""
    specs = [TensorSpec(n, tuple(a.shape), dtype) for n, a in arrays.items()]
    return write_checkpoint(out_dir, cfg, quant, specs, lambda s: arrays[s.name], **kw)


class _Progress:
    """rich progress bar over bytes written; a no-op when disabled or rich is not wanted."""

    def __init__(self, total: int, description: str, *, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self.description = description

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                               TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                               console=Console(stderr=True))
            self._p.__enter__()
            self._task = self._p.add_task(self.description, total=self.total)
        return self

    def advance(self, n: int) -> None:
        if self.enabled:
            self._p.advance(self._task, n)

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._p.__exit__(*exc)
