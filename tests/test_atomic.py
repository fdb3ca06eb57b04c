"""Atomic output directories: all or nothing, and a manifest that notices any change."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from gsm.atomic import (
    MANIFEST_NAME,
    ManifestError,
    OutputExistsError,
    atomic_output_dir,
    sha256_file,
    verify_manifest,
)


def _write_sample(d: Path) -> None:
    (d / "a.txt").write_text("alpha")
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)


def test_sha256_file_matches_hashlib_across_chunks(tmp_path: Path) -> None:
    data = os.urandom((1 << 20) * 2 + 123)  # spans several 1 MiB chunks
    p = tmp_path / "x"
    p.write_bytes(data)
    assert sha256_file(p) == hashlib.sha256(data).hexdigest()


def test_success_renames_and_writes_manifest(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with atomic_output_dir(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        assert not final.exists()  # nothing visible until the end
        _write_sample(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left
    m = json.loads((final / MANIFEST_NAME).read_text())
    assert m["format"] == "gsm-edge-manifest" and m["version"] == 1
    assert m["files"] == {
        "a.txt": "sha256:" + hashlib.sha256(b"alpha").hexdigest(),
        "sub/b.bin": "sha256:" + hashlib.sha256(bytes(range(256)) * 10).hexdigest(),
    }
    assert verify_manifest(final) == []


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_leaves_nothing_behind(tmp_path: Path, exc: type[BaseException]) -> None:
    final = tmp_path / "out"
    with pytest.raises(exc):
        with atomic_output_dir(final) as tmp:
            _write_sample(tmp)
            raise exc("stop")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_before_any_work(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "keep").write_text("old")
    ran = False
    with pytest.raises(FileExistsError, match="out.*already exists") as ei:
        with atomic_output_dir(final):
            ran = True
    assert isinstance(ei.value, OutputExistsError) and not ran
    assert (final / "keep").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_old_output(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with atomic_output_dir(final) as tmp:  # only a directory we wrote may be replaced
        (tmp / "stale").write_text("old")
    with atomic_output_dir(final, overwrite=True) as tmp:
        _write_sample(tmp)
    assert not (final / "stale").exists() and (final / "a.txt").read_text() == "alpha"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert verify_manifest(final) == []


def test_overwrite_keeps_old_output_when_writer_fails(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with atomic_output_dir(final) as tmp:
        (tmp / "stale").write_text("old")
    with pytest.raises(ValueError):
        with atomic_output_dir(final, overwrite=True) as tmp:
            _write_sample(tmp)
            raise ValueError("bad tensor")
    assert (final / "stale").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.fixture
def done(tmp_path: Path) -> Path:
    final = tmp_path / "out"
    with atomic_output_dir(final) as tmp:
        _write_sample(tmp)
    return final


def test_verify_manifest_reports_changed_missing_and_unlisted(done: Path) -> None:
    (done / "a.txt").write_text("ALPHA")
    (done / "sub" / "b.bin").unlink()
    (done / "sub" / "new").write_text("x")
    problems = verify_manifest(done)
    assert len(problems) == 3
    assert any(p.startswith("a.txt: sha256 mismatch") for p in problems)
    assert any(p.startswith("sub/b.bin:") and "missing" in p for p in problems)
    assert any(p.startswith("sub/new:") and "not listed" in p for p in problems)


def test_verify_manifest_rejects_escaping_paths(done: Path) -> None:
    m = json.loads((done / MANIFEST_NAME).read_text())
    m["files"]["../elsewhere"] = "sha256:00"
    (done / MANIFEST_NAME).write_text(json.dumps(m))
    assert any("escapes" in p for p in verify_manifest(done))


@pytest.mark.parametrize("content", ["", "[]", '{"format": "other", "version": 1, "files": {}}',
                                     '{"format": "gsm-edge-manifest", "version": 2, "files": {}}',
                                     '{"format": "gsm-edge-manifest", "version": 1, "files": []}'])
def test_bad_manifest_raises(done: Path, content: str) -> None:
    (done / MANIFEST_NAME).write_text(content)
    with pytest.raises(ManifestError, match=MANIFEST_NAME):
        verify_manifest(done)


def test_missing_manifest_raises(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no manifest"):
        verify_manifest(tmp_path)
