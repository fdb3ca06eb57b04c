"""Atomic output directories with a manifest of hashes.

Every artefact directory we write (checkpoints, engine bundles) must either exist complete or not
at all: a crash or Ctrl-C halfway through must never leave a directory that looks like a valid
checkpoint. So writers fill a temporary directory beside the destination (same filesystem, so
the final `rename` is atomic), record the sha256 of every file in `manifest.json`, and only then
rename it into place. `verify_manifest` lets the checker (and the builder, before trusting its
inputs) detect files that were changed, lost or added afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "gsm-edge-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20


class ManifestError(ValueError):
    """manifest.json is missing, unreadable or not a manifest of this format/version."""


class OutputExistsError(FileExistsError):
    """The destination of an atomic write exists and may not be replaced (see `replace_refusal`)."""

    def __init__(self, path: Path, why: str | None = None) -> None:
        super().__init__(f"output directory {path} " + (why or "already exists; pass --overwrite to replace it "
                                                            "(only a directory gsm-edge wrote can be replaced)"))
        self.path = path


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks so big weight files never sit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def regular_files(root: Path) -> list[Path]:
    """Every regular file under root (no symlinks followed), as paths relative to root, sorted."""
    out: list[Path] = []
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                out.append(p.relative_to(root))
    return sorted(out)


def write_manifest(root: Path, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Hash every regular file under root (except the manifest itself) into root/manifest.json.

    `extra` fields (e.g. a bundle's identity) are stored beside the hashes.
    """
    files = {rel.as_posix(): "sha256:" + sha256_file(root / rel)
             for rel in regular_files(root) if rel.as_posix() != MANIFEST_NAME}
    manifest = {**(extra or {}), "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": files}
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


@contextmanager
def atomic_output_dir(final: str | os.PathLike[str], *, overwrite: bool = False,
                      manifest_extra: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """Yield a fresh temp dir beside `final`; on success write the manifest and rename it to `final`.

    `manifest_extra` is read when the body has finished, so the body may still fill it in.

    On any exception (KeyboardInterrupt included) the temp dir is deleted and the exception
    re-raised, so nothing is left behind. An existing `final` raises `OutputExistsError` before
    any work unless `overwrite`; then the old directory is moved aside, the new one renamed in,
    and the old one deleted (the destination is missing only between two renames).
    """
    final = Path(final)
    if _occupied(final):
        if not overwrite:
            raise OutputExistsError(final)
        why = replace_refusal(final)
        if why is not None:
            raise OutputExistsError(final, f"cannot be replaced: {why}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        yield tmp
        write_manifest(tmp, manifest_extra)
        _swap_into_place(tmp, final, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _occupied(final: Path) -> bool:
    """Whether final holds something to lose: anything but a missing path or an empty real directory."""
    if final.is_symlink():
        return True
    if not final.exists():
        return False
    return not final.is_dir() or any(final.iterdir())


def replace_refusal(path: Path) -> str | None:
    """Why `--overwrite` may not replace `path`; None when it may.

    Only a real directory that gsm-edge wrote (a manifest of our format) and that holds no file its
    manifest does not list: a plain file, a symlink, somebody's folder or notes added to one of
    ours would be lost with it.
    """
    if path.is_symlink():
        return "it is a symlink; pass the real directory"
    if not path.is_dir():
        return "it is not a directory; gsm-edge replaces only a directory it wrote"
    try:
        files = read_manifest(path)
    except ManifestError:
        return f"it has no gsm-edge {MANIFEST_NAME}, so it is not a directory this project wrote"
    unlisted = [r.as_posix() for r in regular_files(path)
                if r.as_posix() != MANIFEST_NAME and r.as_posix() not in files]
    if unlisted:
        more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
        return (f"it holds files its {MANIFEST_NAME} does not list ({', '.join(unlisted[:3])}{more}), "
                "which replacing it would delete")
    return None


def _swap_into_place(tmp: Path, final: Path, *, overwrite: bool) -> None:
    if not _occupied(final):
        if final.is_dir():
            final.rmdir()  # empty: nothing to keep
        os.rename(tmp, final)
        return
    if not overwrite:  # appeared while we were writing
        raise OutputExistsError(final)
    why = replace_refusal(final)
    if why is not None:
        raise OutputExistsError(final, f"cannot be replaced: {why}")
    old = final.parent / f".{final.name}.old-{secrets.token_hex(6)}"
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        os.rename(old, final)  # put the previous output back rather than leave nothing
        raise
    shutil.rmtree(old, ignore_errors=True)


def place_file(src: Path, dst: Path, link: bool) -> str | None:
    """`src` at `dst` in a directory being filled: hard-linked where `link`, else copied. Returns None, or, when a
    link was asked for and the filesystem refused it (another filesystem, no hard links there), why the file was
    copied instead.

    A hard link is safe for files no command of ours ever writes in place: every writer fills a new directory and
    renames it (atomic_output_dir), and a small file is replaced by rename (gsm.outputs.write_bytes_atomic), so
    a shared inode keeps its bytes. Only a write from outside changes both names at once, and the manifest of
    each directory says so (docs/decisions.md "Calibrated checkpoints share the weights")."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    why = None
    if link:
        try:
            os.link(src, dst)
            return None
        except OSError as e:  # another filesystem (EXDEV), links not supported (EPERM), too many links (EMLINK)
            why = e.strerror or str(e)
    shutil.copy2(src, dst)
    return why


def is_inside(base: Path, p: Path) -> bool:
    """Whether p, with every symlink resolved, lies inside the already-resolved directory base."""
    try:
        return p.resolve().is_relative_to(base)
    except (OSError, RuntimeError):  # symlink loop (RuntimeError before Python 3.13)
        return False


def read_manifest(root: str | os.PathLike[str]) -> dict[str, str]:
    """`files` of root/manifest.json after checking format and version; ManifestError otherwise."""
    path = Path(root) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ManifestError(f"{path}: no manifest") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path}: not a {MANIFEST_FORMAT} (format field is "
                            f"{data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{path}: manifest version {data.get('version')!r}, "
                            f"this reader knows {MANIFEST_VERSION}")
    files = data.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in files.items()):
        raise ManifestError(f"{path}: `files` must map relative paths to 'sha256:<hex>' strings")
    return files


def verify_manifest(root: str | os.PathLike[str]) -> list[str]:
    """Problems between root/manifest.json and the files on disk; [] when they agree.

    Reports listed files that are missing, hash mismatches, listed paths that escape root, and
    regular files present but not listed (an added file is as suspicious as a changed one).
    Raises ManifestError when the manifest itself is missing or malformed.
    """
    root = Path(root)
    files = read_manifest(root)
    problems: list[str] = []
    base = root.resolve()
    for rel, digest in sorted(files.items()):
        p = root / rel
        if Path(rel).is_absolute() or not is_inside(base, p):
            problems.append(f"{rel}: listed path escapes the directory")
            continue
        if not p.is_file():
            problems.append(f"{rel}: listed in {MANIFEST_NAME} but missing")
            continue
        if not digest.startswith("sha256:"):
            problems.append(f"{rel}: hash {digest!r} is not 'sha256:<hex>'")
            continue
        try:
            actual = "sha256:" + sha256_file(p)
        except OSError as e:
            problems.append(f"{rel}: unreadable ({e})")
            continue
        if actual != digest:
            problems.append(f"{rel}: sha256 mismatch (manifest {digest}, file {actual})")
    listed = set(files)
    for rel in regular_files(root):
        name = rel.as_posix()
        if name != MANIFEST_NAME and name not in listed:
            problems.append(f"{name}: present but not listed in {MANIFEST_NAME}")
    return problems
