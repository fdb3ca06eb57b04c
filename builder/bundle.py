"""The bundle directory: atomic write, and the manifest with the bundle's identity fields.

A bundle is written like a checkpoint (gsm.atomic): into a temp dir beside the destination, hashed
into manifest.json, renamed into place, deleted on any error. `atomic_output_dir` writes a manifest
of files only; a bundle's manifest also carries its identity (format version, gsm-edge version,
checkpoint hash, device profile, opset, plugin names + versions), so this module reuses
gsm.atomic's manifest writer and swap but adds those fields before the rename. What the files are
called and what bundle.json holds is gsm.bundle_format, shared with the runtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gsm.atomic import MANIFEST_NAME, atomic_output_dir, read_manifest, sha256_file
from gsm.bundle_format import BUNDLE_FORMAT, BUNDLE_VERSION, check_identity


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def checkpoint_hash(d: Path) -> str:
    """`sha256:` over the sorted (relative path, file sha256) list of a checkpoint directory, manifest
    excluded: the same files give the same hash whether or not a manifest is present."""
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            h.update(f"{p.relative_to(d).as_posix()}\0{sha256_file(p)}\n".encode())
    return "sha256:" + h.hexdigest()


@contextmanager
def atomic_bundle_dir(final: Path, meta: dict[str, Any], *, overwrite: bool = False) -> Iterator[Path]:
    """gsm.atomic.atomic_output_dir with the bundle's identity and `meta` (which the body fills in)
    stored in the manifest beside the file hashes."""
    meta.update({"bundle_format": BUNDLE_FORMAT, "bundle_version": BUNDLE_VERSION})
    with atomic_output_dir(final, overwrite=overwrite, manifest_extra=meta) as tmp:
        yield tmp


def read_bundle_manifest(root: Path) -> dict[str, Any]:
    """The whole manifest after checking it is a bundle manifest of this version."""
    read_manifest(root)  # format/version/files checks, ManifestError otherwise
    data = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    check_identity(root, data)
    return data


def add_file_to_bundle(root: Path, src: Path, name: str, meta_update: dict[str, Any]) -> None:
    """Move `src` into the bundle as `name` and re-hash the manifest (used by `builder engine`).

    The new manifest is written beside and renamed over the old one (atomic per file); the file is
    moved in last, so an interruption leaves a manifest naming a missing file (detected at load),
    never an unlisted file that looks valid.
    """
    data = read_bundle_manifest(root)
    data["files"][name] = "sha256:" + sha256_file(src)
    data.update(meta_update)
    tmp = root / f".{MANIFEST_NAME}.tmp-{secrets.token_hex(4)}"
    write_json(tmp, data)
    os.replace(tmp, root / MANIFEST_NAME)
    os.replace(src, root / name)
