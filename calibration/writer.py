"""Write a calibrated checkpoint atomically: in place (a rewritten directory) or a new one at --out.

The checkpoint directory is never edited file by file. A new directory is filled beside the
destination (gsm.atomic.atomic_output_dir): the checkpoint's files, the new
kv_calibration.safetensors, quant_config.json and calibration_report.json; then the manifest is
written and the directory renamed into place. A crash or Ctrl-C at any point leaves the original
checkpoint as it was.

The checkpoint's files are hard-linked for an in-place rewrite (the old directory goes afterwards).
For --out its weights (*.safetensors, hundreds of MB) are hard-linked too, so a calibrated copy
costs the calibration tables, not a second copy of the model; its small files (configs, tokenizer,
reports: what a person might edit in place) are copied. Where the filesystem refuses a link (--out
on another filesystem) the weights are copied and the command says so. A shared weights file is
safe because nothing of ours writes a file in place (gsm.atomic.place_file); a write from outside
changes both checkpoints' bytes, and each one's manifest then fails `gsm verify` and the builder's
check (docs/decisions.md "Calibrated checkpoints share the weights").

A checkpoint whose manifest no longer matches its files is refused: rewriting it would sign
someone else's modification with a fresh manifest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gsm.atomic import (
    MANIFEST_NAME,
    ManifestError,
    OutputExistsError,
    atomic_output_dir,
    place_file,
    sha256_file,
    verify_manifest,
)
from gsm.atomic import read_manifest as read_manifest_files
from gsm.checkpoint import CALIB_FILE, CALIB_REPORT_FILE, QUANT_FILE
from gsm.config import KVQuantConfig
from gsm.golden.weights import KVCalibration
from gsm.safetensors_io import StreamingSafetensorsWriter, TensorSpec

REPLACED = frozenset({MANIFEST_NAME, CALIB_FILE, QUANT_FILE, CALIB_REPORT_FILE})
WEIGHTS_SUFFIX = ".safetensors"  # the weight shards --out hard-links (model.safetensors, model-00001-of-00002...)


class CheckpointStateError(ValueError):
    """The input checkpoint changed or does not match its manifest."""


def check_unmodified(checkpoint: Path) -> dict[str, str] | None:
    """Manifest entries of the checkpoint after checking they match the files; None without manifest."""
    if not (checkpoint / MANIFEST_NAME).exists():
        return None
    try:
        problems = verify_manifest(checkpoint)
        files = read_manifest_files(checkpoint)
    except ManifestError as e:
        raise CheckpointStateError(f"--checkpoint {checkpoint}: {e}") from e
    if problems:
        raise CheckpointStateError(f"--checkpoint {checkpoint}: files do not match {MANIFEST_NAME} "
                                   f"({'; '.join(problems[:3])}); refusing to re-sign a modified "
                                   "checkpoint (run `python -m gsm verify` on it)")
    return files


def check_destination(checkpoint: Path, out: Path | None, overwrite: bool) -> bool:
    """Whether the write is in place; raises before any work if --out cannot be written."""
    if out is None or out.resolve() == checkpoint.resolve():
        return True
    src, dst = checkpoint.resolve(), out.resolve()
    if dst.is_relative_to(src) or src.is_relative_to(dst):
        raise CheckpointStateError(f"--out {out} is inside --checkpoint {checkpoint} or contains it; "
                                   "pass a separate directory (or omit --out to rewrite in place)")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise OutputExistsError(out)
    return False


def write_calibration_file(path: Path, calib: KVCalibration, metadata: dict[str, str]) -> None:
    """kv_calibration.safetensors: spec 5 names, float32, sorted by name (deterministic bytes)."""
    arrays = calib.to_tensors()
    specs = [TensorSpec(n, tuple(arrays[n].shape), "F32") for n in sorted(arrays)]
    with StreamingSafetensorsWriter(path, specs, {"format": "pt", **metadata}) as w:
        for s in specs:
            w.write(s.name, arrays[s.name])


def write_calibrated(checkpoint: Path, calib: KVCalibration, quant: KVQuantConfig, report: dict[str, Any], *,
                     out: Path | None = None, overwrite: bool = False, metadata: dict[str, str] | None = None,
                     expected: dict[str, str] | None = None, say: Callable[[str], Any] = lambda _: None) -> Path:
    """Write the calibrated checkpoint to `out` (or over `checkpoint`); returns the directory written.

    `expected`: manifest entries read when the run started; a file that changed since is an error.
    `say`: told of every file that was to be hard-linked and had to be copied.
    """
    in_place = check_destination(checkpoint, out, overwrite)
    dest = checkpoint if in_place else out
    with atomic_output_dir(dest, overwrite=in_place or overwrite) as tmp:
        for dirpath, _dirs, files in os.walk(checkpoint, followlinks=False):
            for name in sorted(files):
                src = Path(dirpath) / name
                rel = src.relative_to(checkpoint)
                if rel.as_posix() in REPLACED or not src.is_file():
                    continue
                link = (in_place or rel.suffix == WEIGHTS_SUFFIX) and not src.is_symlink()
                why = place_file(src, tmp / rel, link=link)
                if why is not None:
                    say(f"{rel}: copied into {dest} ({src.stat().st_size / 2**20:.0f} MiB), not hard-linked: {why}")
                want = (expected or {}).get(rel.as_posix())
                if want is not None and "sha256:" + sha256_file(tmp / rel) != want:
                    raise CheckpointStateError(f"--checkpoint {checkpoint}: {rel} changed while calibrating")
        write_calibration_file(tmp / CALIB_FILE, calib, metadata or {})
        (tmp / QUANT_FILE).write_text(json.dumps(quant.to_json(), indent=2) + "\n", encoding="utf-8")
        (tmp / CALIB_REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return dest
