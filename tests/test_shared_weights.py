"""`calibration run --out` shares the input's weights by hard link instead of copying them.

A calibrated copy must add the calibration tables to the disk, not a second model; it must still be a checkpoint
`gsm verify` accepts; and when the shared weights change from outside it must be refused like any modified
checkpoint (docs/decisions.md "Calibrated checkpoints share the weights"). A synthetic tiny checkpoint and a few
short sequences keep each run to about a second.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from conftest import CALIB_TEXT, needs_data

from calibration.cli import main as calibration_main
from gsm.checker import verify
from gsm.checkpoint import WEIGHTS_FILE
from gsm.synth import synth_checkpoint

pytestmark = needs_data
FAST = ["--samples", "4", "--seq-len", "48", "--tier-fractions", "0,0,1", "--eval-samples", "0"]
SMALL_FILES = ("config.json", "quant_config.json", "tokenizer.json")


@pytest.fixture
def parent(tmp_path) -> Path:
    return synth_checkpoint("tiny", tmp_path / "parent", seed=0)


def calibrate(ck: Path, out: Path, *more: str) -> int:
    return calibration_main(["run", "--checkpoint", str(ck), "--data", str(CALIB_TEXT), *FAST, "--out", str(out),
                             *more])


def flip_a_byte_in_place(path: Path) -> None:
    """What a tool writing into the file does: same inode, other bytes (past the safetensors header)."""
    with path.open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        b = f.read(1)
        f.seek(-4, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


def test_calibrated_copy_links_the_weights_copies_the_rest_and_verifies(parent, tmp_path):
    out = tmp_path / "cal"
    assert calibrate(parent, out) == 0
    w_in, w_out = (parent / WEIGHTS_FILE).stat(), (out / WEIGHTS_FILE).stat()
    assert (w_out.st_dev, w_out.st_ino) == (w_in.st_dev, w_in.st_ino) and w_out.st_nlink == 2  # one copy on disk
    for name in SMALL_FILES:  # what a person may edit in place is not shared
        assert (out / name).stat().st_ino != (parent / name).stat().st_ino
    assert verify(out).ok and verify(parent).ok
    # what the copy adds to the disk: everything but the shared weights, far below one copy of them
    added = sum(p.stat().st_size for p in out.iterdir() if p.name != WEIGHTS_FILE)
    assert added < w_in.st_size / 2


def test_changed_shared_weights_are_refused_everywhere(parent, tmp_path, capsys):
    from builder.__main__ import main as builder_main

    out = tmp_path / "cal"
    assert calibrate(parent, out) == 0
    flip_a_byte_in_place(parent / WEIGHTS_FILE)  # reaches both names of the inode
    rep = verify(out)
    assert not rep.ok and any(e.code == "MANIFEST_MISMATCH" and WEIGHTS_FILE in e.message for e in rep.errors)
    capsys.readouterr()
    assert builder_main(["build", "--device", "orin", "--checkpoint", str(out), "--output",
                         str(tmp_path / "bundle")]) == 2
    assert "not a valid GSM checkpoint" in capsys.readouterr().err and not (tmp_path / "bundle").exists()
    assert calibrate(out, tmp_path / "again") == 2
    assert "refusing to re-sign" in capsys.readouterr().err and not (tmp_path / "again").exists()


def test_a_reconverted_parent_leaves_the_calibrated_copy_intact(parent, tmp_path):
    out = tmp_path / "cal"
    assert calibrate(parent, out) == 0
    before = (out / WEIGHTS_FILE).read_bytes()
    synth_checkpoint("tiny", parent, seed=1, overwrite=True)  # new files renamed in: the old inode stays the copy's
    assert (parent / WEIGHTS_FILE).read_bytes() != before
    assert (out / WEIGHTS_FILE).read_bytes() == before and verify(out).ok


def test_across_filesystems_the_weights_are_copied_and_the_run_says_so(parent, tmp_path, monkeypatch, capsys):
    def no_link(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))

    monkeypatch.setattr(os, "link", no_link)
    out = tmp_path / "cal"
    assert calibrate(parent, out) == 0
    err = capsys.readouterr().err
    assert f"{WEIGHTS_FILE}: copied into {out}" in err and os.strerror(errno.EXDEV) in err
    assert (out / WEIGHTS_FILE).stat().st_ino != (parent / WEIGHTS_FILE).stat().st_ino
    assert (out / WEIGHTS_FILE).read_bytes() == (parent / WEIGHTS_FILE).read_bytes() and verify(out).ok
