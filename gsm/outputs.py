"""What an output flag (--out, --output, --report) may point at, checked before any work.

A careless `--out` must never cost data: `gsm convert SRC.bin --out DIR --overwrite` once deleted
the model, its tokenizer and the text files beside it. The rule, shared by every command that
writes (convert, synth, calibration, builder build/engine):

- an output never is, contains, or lies inside an input of the same command;
- an existing output is replaced only with `--overwrite`, and then only if it is what we would
  write there: a directory that gsm-edge wrote (its manifest.json says so, and it holds no file
  the manifest does not list, so nobody's notes are deleted with it), or, for a report, a file;
- the place must be writable, probed by creating (and removing) a temp entry beside it, because a
  permission bit says little on /proc, read-only mounts or for root.

An empty existing directory holds nothing to lose and counts as absent (users `mkdir` first).
Violations raise `OutputPathError` naming the flag, the path and why; CLIs print it as one line.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterable
from pathlib import Path

from gsm.atomic import replace_refusal

OVERWRITE_FLAG = "--overwrite"


class OutputPathError(ValueError):
    """An output path is unsafe or unwritable; the message names the flag, the path and why."""


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError):  # symlink loop
        return p.absolute()


def _overlap(out: Path, flag: str, inputs: Iterable[tuple[str, Path | None]]) -> None:
    dst = _resolved(out)
    for in_flag, src in inputs:
        if src is None:
            continue
        s = _resolved(Path(src))
        if dst == s:
            why = "is"
        elif s.is_relative_to(dst):
            why = "contains"
        elif dst.is_relative_to(s):
            why = "lies inside"
        else:
            continue
        raise OutputPathError(f"{flag} {out} {why} the input {in_flag} {src}; an output must be a separate "
                              "path (nothing was written)")


def _probe_writable(target: Path, flag: str) -> None:
    """Create and remove a temp dir in the nearest existing ancestor of target (its parent chain)."""
    anc = target.parent
    while not anc.exists():
        if anc.is_symlink():
            raise OutputPathError(f"{flag} {target}: {anc} is a dangling symlink")
        if anc.parent == anc:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise OutputPathError(f"{flag} {target}: {anc} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=f".gsm-edge-probe-{secrets.token_hex(3)}-", dir=anc)
        os.rmdir(probe)
    except OSError as e:
        raise OutputPathError(f"{flag} {target}: cannot write in {anc} ({e.strerror or e})") from None


def check_output_dir(out: Path, *, flag: str, overwrite: bool,
                     inputs: Iterable[tuple[str, Path | None]] = ()) -> None:
    """Raise OutputPathError unless writing the directory `out` (atomically) is safe and possible."""
    out = Path(out)
    _overlap(out, flag, inputs)
    if out.is_symlink() and not out.exists():
        raise OutputPathError(f"{flag} {out} is a dangling symlink; remove it or choose another path")
    if out.exists():
        if not out.is_dir():
            raise OutputPathError(f"{flag} {out} exists and is not a directory; gsm-edge replaces only a "
                                  "directory it wrote (nothing was written)")
        if out.is_symlink() or any(out.iterdir()):
            if not overwrite:
                raise OutputPathError(f"{flag} {out} already exists; pass {OVERWRITE_FLAG} to replace it "
                                      "(only a directory gsm-edge wrote can be replaced)")
            why = replace_refusal(out)
            if why is not None:
                raise OutputPathError(f"{flag} {out}: refusing to replace it: {why} (nothing was written)")
    _probe_writable(out, flag)


def check_output_file(out: Path, *, flag: str, overwrite: bool,
                      inputs: Iterable[tuple[str, Path | None]] = (),
                      beside: tuple[str, Path] | None = None) -> None:
    """Raise OutputPathError unless writing the file `out` (a report) is safe and possible.

    `beside`: (flag, directory) the same command writes atomically; a report inside it would be
    added to it unhashed (or lost when it is renamed into place)."""
    out = Path(out)
    _overlap(out, flag, inputs)
    if beside is not None and _resolved(out).is_relative_to(_resolved(Path(beside[1]))):
        raise OutputPathError(f"{flag} {out} lies inside {beside[0]} {beside[1]}, which this command writes; "
                              "write it beside that directory")
    if out.exists() or out.is_symlink():
        if out.is_dir():
            raise OutputPathError(f"{flag} {out} is a directory; it must name a file")
        if not overwrite:
            raise OutputPathError(f"{flag} {out} already exists; pass {OVERWRITE_FLAG} to replace it")
    _probe_writable(out, flag)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small file (a report) via a temp file and rename: readers never see half of it."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """write_text_atomic for bytes (a scales file): temp file beside it, rename, temp removed on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
