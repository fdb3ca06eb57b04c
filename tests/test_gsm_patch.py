"""`python -m gsm patch`: an RFC 6902 patch of a checkpoint's run-time knobs (gsm/patch.py), checksum re-computed,
checker run, written atomically; every refusal names the path and writes nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gsm.__main__ import main
from gsm.atomic import verify_manifest
from gsm.checker import verify
from gsm.synth import synth_checkpoint

pytest.importorskip("jsonpatch")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("patch") / "ck", seed=4)


@pytest.fixture
def ck(base, tmp_path) -> Path:
    """A private copy of the checkpoint (a patch may rewrite it)."""
    import shutil

    dst = tmp_path / "alone" / "ck"  # its parent holds nothing else: a temporary directory left there would show
    shutil.copytree(base, dst)
    return dst


def run(ck: Path, ops, tmp_path: Path, *extra: str) -> int:
    p = tmp_path / "patch.json"
    p.write_text(json.dumps(ops))
    return main(["patch", str(ck), "--patch", str(p), *extra])


def state(d: Path) -> dict[str, str]:
    """Every file's bytes hashed, and the directories beside d (a temporary directory left behind shows here)."""
    files = {f.relative_to(d).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
             for f in sorted(d.rglob("*")) if f.is_file()}
    return {**files, "..": ",".join(sorted(p.name for p in d.parent.iterdir()))}


def canonical_sha(gc: dict) -> str:
    body = {k: v for k, v in gc.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_knobs_change_in_place_with_a_new_checksum(ck, tmp_path, capsys) -> None:
    weights_inode = (ck / "model.safetensors").stat().st_ino
    ops = [{"op": "replace", "path": "/gsm_config/sparse_window", "value": 2},
           {"op": "replace", "path": "/gsm_config/quantization_adaptation_rate", "value": 500},
           {"op": "replace", "path": "/kv_quantization/hotness_decay", "value": 0.8},
           {"op": "add", "path": "/kv_quantization/hot_token_ids", "value": [5, 7]}]
    assert run(ck, ops, tmp_path) == 0
    cfg = json.loads((ck / "config.json").read_text())
    gc = cfg["gsm_config"]
    assert (gc["sparse_window"], gc["quantization_adaptation_rate"]) == (2, 500)
    assert gc["checksum"] == canonical_sha(gc)
    kvq = json.loads((ck / "quant_config.json").read_text())["kv_quantization"]
    assert (kvq["hotness_decay"], kvq["hot_token_ids"]) == (0.8, [5, 7])
    assert verify(ck).ok and verify_manifest(ck) == []
    assert (ck / "model.safetensors").stat().st_ino == weights_inode  # hard-linked, not copied
    assert gc["checksum"] in capsys.readouterr().out


def test_out_writes_a_copy_and_leaves_the_source(ck, tmp_path) -> None:
    before = state(ck)
    out = tmp_path / "patched"
    assert run(ck, [{"op": "replace", "path": "/gsm_config/sparse_top_k", "value": 3}], tmp_path,
               "--out", str(out)) == 0
    assert state(ck) == {**before, "..": state(ck)[".."]}  # the source is as it was (its parent now holds out)
    assert json.loads((out / "config.json").read_text())["gsm_config"]["sparse_top_k"] == 3
    assert (out / "model.safetensors").stat().st_ino != (ck / "model.safetensors").stat().st_ino
    assert verify(out).ok
    assert run(ck, [{"op": "replace", "path": "/gsm_config/sparse_top_k", "value": 4}], tmp_path,
               "--out", str(out)) == 2, "an existing --out needs --overwrite"


@pytest.mark.parametrize(("ops", "message"), [
    ([{"op": "replace", "path": "/gsm_config/indexer_dim", "value": 16}],
     "/gsm_config/indexer_dim: gsm_config.indexer_dim cannot change in place (the indexer's tensor shapes"),
    ([{"op": "replace", "path": "/gsm_config/kv_compression_ratio", "value": 2.0}],
     "cannot change in place (the latent ranks"),
    ([{"op": "remove", "path": "/gsm_config/kv_sharing"}], "gsm_config.kv_sharing cannot change in place"),
    ([{"op": "replace", "path": "/gsm_config/checksum", "value": "sha256:00"}], "the patch recomputes it"),
    ([{"op": "replace", "path": "/kv_quantization/index_key_bits", "value": 8}], "kv_quantization.index_key_bits"),
    ([{"op": "add", "path": "/gsm_config/speed", "value": 1}], "gsm_config.speed is not a knob"),
    ([{"op": "replace", "path": "/vocab_size", "value": 1}], "'/vocab_size' is outside the knobs"),
    ([{"op": "copy", "from": "/gsm_config/indexer_heads", "path": "/gsm_config/sparse_window"}],
     "/gsm_config/indexer_heads: gsm_config.indexer_heads cannot change"),
    ([{"op": "replace", "path": "/gsm_config/sparse_window", "value": 99}],
     "max_sparse_window (8) must be >= sparse_window (99)"),
    ([{"op": "replace", "path": "/kv_quantization/hotness_decay", "value": 2.0}], "hotness_decay"),
    ([{"op": "replace", "path": "/kv_quantization/hot_token_ids", "value": [100000]}],
     "/kv_quantization/hot_token_ids: [100000] outside the vocabulary [0, 384)"),
    ([{"op": "replace", "path": "/gsm_config/sparse_top_k", "value": 5},
      {"op": "test", "path": "/gsm_config/sparse_window", "value": 7}],
     "/gsm_config/sparse_window: operation 1 (test) does not apply"),
    ([{"op": "replace", "path": "/gsm_config/sparse_window"}], "operation 0 (replace) does not apply"),
    ({"op": "replace"}, "non-empty JSON array"),
    ([], "non-empty JSON array"),
])
def test_a_refused_patch_names_the_path_and_writes_nothing(ck, tmp_path, capsys, ops, message) -> None:
    before = state(ck)
    assert run(ck, ops, tmp_path) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert state(ck) == before


def test_a_modified_checkpoint_is_not_re_signed(ck, tmp_path, capsys) -> None:
    (ck / "tokenizer.json").write_text((ck / "tokenizer.json").read_text() + " ")
    assert run(ck, [{"op": "replace", "path": "/gsm_config/sparse_window", "value": 2}], tmp_path) == 2
    assert "refusing to re-sign a modified checkpoint" in capsys.readouterr().err
