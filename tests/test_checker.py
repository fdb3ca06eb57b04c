"""The checker: a corpus of malformed checkpoints, one per error code, and random corruption.

Every malformed checkpoint is a synth tiny checkpoint mutated in a tmp dir; its manifest is
removed (unless the case is about the manifest) so each case isolates the rule it breaks.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gsm import names
from gsm.checker import ERROR_CODES, verify
from gsm.config import gsm_checksum
from gsm.safetensors_io import LazySafetensors, StreamingSafetensorsWriter, TensorSpec
from gsm.synth import synth_checkpoint

ROOT = Path(__file__).resolve().parents[1]
L = "model.layers.{}."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("ck") / "tiny")


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = synth_checkpoint("tiny", tmp_path_factory.mktemp("ck") / "sharded", max_shard_bytes=200_000)
    assert len(list(d.glob("model-*-of-*.safetensors"))) >= 3
    return d


# ---- helpers that mutate a copy --------------------------------------------------------------

class Ctx:
    def __init__(self, tiny: Path, sharded: Path, tmp: Path) -> None:
        self.tiny, self.sharded, self.tmp = tiny, sharded, tmp

    def copy(self, *, sharded: bool = False, manifest: bool = False) -> Path:
        d = self.tmp / "ck"
        shutil.copytree(self.sharded if sharded else self.tiny, d)
        if not manifest:
            (d / "manifest.json").unlink()
        return d


def edit_json(path: Path, fn: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def set_gsm(d: Path, **kw: object) -> None:
    """Change gsm_config fields and recompute the checksum (so only the intended rule breaks)."""
    def f(c: dict) -> None:
        c["gsm_config"].update(kw)
        c["gsm_config"]["checksum"] = gsm_checksum(c["gsm_config"])
    edit_json(d / "config.json", f)


def load(path: Path) -> dict[str, np.ndarray]:
    f = LazySafetensors(path)
    return {n: f.array(n) for n in f.names}


def save(path: Path, arrays: dict[str, np.ndarray], dtypes: dict[str, str] | None = None) -> None:
    specs = [TensorSpec(n, a.shape, (dtypes or {}).get(n, "F32")) for n, a in arrays.items()]
    with StreamingSafetensorsWriter(path, specs) as w:
        for n, a in arrays.items():
            w.write(n, a)


def edit_tensors(d: Path, fn: Callable[[dict[str, np.ndarray]], object],
                 dtypes: dict[str, str] | None = None) -> None:
    a = load(d / "model.safetensors")
    fn(a)
    save(d / "model.safetensors", a, dtypes)


def rewrite_header(path: Path, fn: Callable[[dict], object]) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    fn(h)
    hb = json.dumps(h).encode()
    path.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])


def write_calibration(d: Path, mutate: Callable[[dict[str, np.ndarray]], object] | None = None) -> None:
    f = LazySafetensors(d / "model.safetensors")
    a: dict[str, np.ndarray] = {}
    for i in (0, 1, 2):  # tiny's owning layers
        for x in ("k", "v"):
            r = f.shape(names.layer_name(f"{x}_S", i))[0]
            a[names.calib_name(i, x, "scale_int8")] = np.full(r, 0.01, np.float32)
            a[names.calib_name(i, x, "scale_int12")] = np.full(r, 0.01 * 127 / 2047, np.float32)
            a[names.calib_name(i, x, "comp_int8")] = np.zeros(r, np.float32)
    if mutate:
        mutate(a)
    save(d / "kv_calibration.safetensors", a)


def first_shard(d: Path, k: int = 0) -> Path:
    return sorted(d.glob("model-*-of-*.safetensors"))[k]


# ---- the corpus: one malformed checkpoint per error code -------------------------------------

CASES: dict[str, Callable[[Ctx], Path]] = {}


def case(code: str) -> Callable[[Callable[[Ctx], Path]], Callable[[Ctx], Path]]:
    def deco(fn: Callable[[Ctx], Path]) -> Callable[[Ctx], Path]:
        assert code not in CASES
        CASES[code] = fn
        return fn
    return deco


@case("DIR_NOT_FOUND")
def _(c: Ctx) -> Path:
    return c.tmp / "nope"


@case("NOT_A_DIRECTORY")
def _(c: Ctx) -> Path:
    p = c.tmp / "file"
    p.write_text("x")
    return p


@case("SYMLINK_ESCAPE")
def _(c: Ctx) -> Path:
    d = c.copy()
    outside = c.tmp / "outside.json"
    shutil.move(d / "tokenizer.json", outside)
    (d / "tokenizer.json").symlink_to(outside)
    return d


@case("FILE_UNREADABLE")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    return d


@case("CONFIG_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "config.json").unlink()
    return d


@case("CONFIG_INVALID_JSON")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "config.json").write_text('{"hidden_size": 64,')
    return d


@case("CONFIG_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_json(d / "config.json", lambda j: j.update(num_key_value_heads=3))
    return d


@case("CONFIG_SHARING_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy()
    set_gsm(d, shared_layers=[2])  # kv_sharing {3: 1} reads layer 1
    return d


@case("CHECKSUM_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_json(d / "config.json", lambda j: j["gsm_config"].pop("checksum"))
    return d


@case("CHECKSUM_MISMATCH")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_json(d / "config.json", lambda j: j["gsm_config"].update(sparse_top_k=9))
    return d


@case("QUANT_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "quant_config.json").unlink()
    return d


@case("QUANT_INVALID_JSON")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "quant_config.json").write_bytes(b"\xff\xfe not json")
    return d


@case("QUANT_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_json(d / "quant_config.json",
              lambda j: j["kv_quantization"].update(tier_fractions=[0.5, 0.5, 0.5]))
    return d


@case("MARK_GSM_CONFIG")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_json(d / "config.json", lambda j: j.pop("gsm_config"))
    return d


@case("MARK_SPARSE_MASK_GENERATOR")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_tensors(d, lambda a: [a.pop(n) for n in list(a) if names.MASK_GENERATOR_MARK in n])
    return d


@case("MARK_SVD_FACTORS")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_tensors(d, lambda a: a.pop(names.layer_name("v_Vt", 2)))
    return d


@case("MARK_KV_PROJECTOR")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_tensors(d, lambda a: a.update({names.layer_name("proj_b", 0): np.zeros(64, np.float32)}))
    return d


@case("MARK_ADAPTIVE_QUANT")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_json(d / "quant_config.json", lambda j: j["kv_quantization"].update(bit_widths=[16, 8, 4]))
    return d


@case("WEIGHTS_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "model.safetensors").unlink()
    return d


@case("WEIGHTS_AMBIGUOUS")
def _(c: Ctx) -> Path:
    d = c.copy()
    wmap = dict.fromkeys(LazySafetensors(d / "model.safetensors").names, "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return d


@case("INDEX_INVALID_JSON")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    (d / "model.safetensors.index.json").write_text("{weight_map: nope}")
    return d


@case("INDEX_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    return d


@case("SHARD_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    first_shard(d, 1).unlink()
    return d


@case("SHARD_PATH_ESCAPE")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    edit_json(d / "model.safetensors.index.json",
              lambda j: j["weight_map"].update({names.EMBED: "../outside.safetensors"}))
    return d


@case("INDEX_TENSOR_NOT_IN_SHARD")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    shard = first_shard(d).name
    edit_json(d / "model.safetensors.index.json",
              lambda j: j["weight_map"].update({L.format(0) + "self_attn.ghost.weight": shard}))
    return d


@case("SHARD_TENSOR_NOT_IN_INDEX")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    edit_json(d / "model.safetensors.index.json", lambda j: j["weight_map"].pop(names.EMBED))
    return d


@case("TENSOR_DUPLICATE")
def _(c: Ctx) -> Path:
    d = c.copy(sharded=True)
    extra = load(first_shard(d))
    second = load(first_shard(d, 1))
    name = next(iter(extra))
    save(first_shard(d, 1), {**second, name: extra[name]})
    return d


@case("SAFETENSORS_HEADER_SIZE")
def _(c: Ctx) -> Path:
    d = c.copy()
    with open(d / "model.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))
    return d


@case("SAFETENSORS_TRUNCATED")
def _(c: Ctx) -> Path:
    d = c.copy()
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    return d


@case("SAFETENSORS_HEADER_JSON")
def _(c: Ctx) -> Path:
    d = c.copy()
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"[")
    return d


@case("SAFETENSORS_DTYPE")
def _(c: Ctx) -> Path:
    d = c.copy()
    rewrite_header(d / "model.safetensors", lambda h: h[names.FINAL_NORM].update(dtype="F33"))
    return d


@case("SAFETENSORS_ENTRY")
def _(c: Ctx) -> Path:
    d = c.copy()
    rewrite_header(d / "model.safetensors", lambda h: h[names.FINAL_NORM].update(shape=["64"]))
    return d


@case("SAFETENSORS_OFFSETS")
def _(c: Ctx) -> Path:
    d = c.copy()  # two [64] F32 tensors claim the same bytes: the header lies about offsets
    def f(h: dict) -> None:
        h[L.format(0) + "post_attention_layernorm.weight"]["data_offsets"] = \
            h[L.format(0) + "input_layernorm.weight"]["data_offsets"]
    rewrite_header(d / "model.safetensors", f)
    return d


@case("TENSOR_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_tensors(d, lambda a: a.pop(names.layer_name("up_proj", 1)))
    return d


@case("TENSOR_UNEXPECTED")
def _(c: Ctx) -> Path:
    d = c.copy()  # SVD factors in a sharing layer
    edit_tensors(d, lambda a: a.update({names.layer_name("k_S", 3): np.ones(12, np.float32)}))
    return d


@case("SHAPE_MISMATCH")
def _(c: Ctx) -> Path:
    d = c.copy()
    n = names.layer_name("gate_proj", 0)
    edit_tensors(d, lambda a: a.update({n: np.ascontiguousarray(a[n].T)}))
    return d


@case("RANK_MISMATCH")
def _(c: Ctx) -> Path:
    d = c.copy()
    n = names.layer_name("k_U", 0)
    edit_tensors(d, lambda a: a.update({n: np.ascontiguousarray(a[n][:, :11])}))
    return d


@case("RANK_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy()  # layer 0 is not a sharing source, so only its own tensors change
    edit_tensors(d, lambda a: a.update({
        names.layer_name("k_U", 0): np.zeros((32, 0), np.float32),
        names.layer_name("k_S", 0): np.zeros((0,), np.float32),
        names.layer_name("k_Vt", 0): np.zeros((0, 64), np.float32)}))
    return d


@case("DTYPE_NOT_FLOAT")
def _(c: Ctx) -> Path:
    d = c.copy()
    rewrite_header(d / "model.safetensors", lambda h: h[names.FINAL_NORM].update(dtype="I32"))
    return d


@case("DTYPE_MISMATCH")
def _(c: Ctx) -> Path:
    d = c.copy()  # config says float32; F16 is neither that nor F32
    edit_tensors(d, lambda a: None, dtypes={names.FINAL_NORM: "F16"})
    return d


@case("TENSOR_NONFINITE")
def _(c: Ctx) -> Path:
    d = c.copy()
    edit_tensors(d, lambda a: a[names.EMBED].__setitem__((3, 5), np.inf))
    return d


@case("MANIFEST_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy(manifest=True)
    edit_json(d / "manifest.json", lambda j: j.update(version=99))
    return d


@case("MANIFEST_MISMATCH")
def _(c: Ctx) -> Path:
    d = c.copy(manifest=True)
    with open(d / "tokenizer.json", "a") as f:
        f.write("\n")
    return d


@case("CALIB_TENSOR_MISSING")
def _(c: Ctx) -> Path:
    d = c.copy()
    write_calibration(d, lambda a: a.pop(names.calib_name(1, "v", "comp_int8")))
    return d


@case("CALIB_SHAPE_MISMATCH")
def _(c: Ctx) -> Path:
    d = c.copy()
    write_calibration(d, lambda a: a.update({names.calib_name(0, "k", "scale_int8"):
                                             np.ones(5, np.float32)}))
    return d


@case("CALIB_SCALE_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy()
    write_calibration(d, lambda a: a[names.calib_name(2, "k", "scale_int8")].__setitem__(0, -1.0))
    return d


@case("CALIB_UNEXPECTED")
def _(c: Ctx) -> Path:
    d = c.copy()  # layer 3 shares: it has no cache of its own to calibrate
    write_calibration(d, lambda a: a.update({names.calib_name(3, "k", "scale_int8"):
                                             np.ones(12, np.float32)}))
    return d


@case("TOKENIZER_INVALID")
def _(c: Ctx) -> Path:
    d = c.copy()
    (d / "tokenizer.json").write_text('{"model": 7}')
    return d


@pytest.fixture
def ctx(tiny: Path, tiny_sharded: Path, tmp_path: Path) -> Ctx:
    return Ctx(tiny, tiny_sharded, tmp_path)


def test_corpus_covers_every_code_but_internal() -> None:
    assert len(CASES) >= 25
    assert set(CASES) == set(ERROR_CODES) - {"INTERNAL"}


@pytest.mark.parametrize("code", sorted(CASES))
def test_malformed_checkpoint_rejected_with_its_code(ctx: Ctx, code: str) -> None:
    r = verify(CASES[code](ctx))
    assert not r.ok
    assert code in r.codes, r.to_json()
    assert "INTERNAL" not in r.codes, r.to_json()
    json.dumps(r.to_json())  # the report is always serialisable


def test_mark_errors_name_first_offending_tensor(ctx: Ctx) -> None:
    r = verify(CASES["MARK_SVD_FACTORS"](ctx))
    assert r.marks == {"gsm_config": True, "sparse_mask_generator": True, "svd_factors": False,
                       "kv_projector": True, "adaptive_quant": True}
    (e,) = [e for e in r.errors if e.code == "MARK_SVD_FACTORS"]
    assert e.tensor == names.layer_name("v_Vt", 2)


def test_every_mark_fails_on_plain_llama_like_dir(ctx: Ctx) -> None:
    d = ctx.copy()
    edit_json(d / "config.json", lambda j: j.pop("gsm_config"))
    edit_json(d / "quant_config.json", lambda j: j["kv_quantization"].update(scheme="uniform"))
    gsm_only = ("_svd_", names.MASK_GENERATOR_MARK, "kv_projector")
    edit_tensors(d, lambda a: [a.pop(n) for n in list(a) if any(g in n for g in gsm_only)])
    r = verify(d)
    assert not any(r.marks.values())
    assert {"MARK_GSM_CONFIG", "MARK_ADAPTIVE_QUANT"} <= set(r.codes)


def test_valid_checkpoints_pass(ctx: Ctx) -> None:
    for d in (ctx.tiny, ctx.sharded):
        r = verify(d)
        assert r.ok, r.to_json()
        assert all(r.marks.values())
    d = ctx.copy(manifest=False)
    write_calibration(d)  # a valid calibration file
    edit_tensors(d, lambda a: a.update({names.layer_name("k_proj", 0): np.zeros((32, 64), np.float32)}))
    assert verify(d).ok, verify(d).to_json()


def test_gsm_spec_v2_int4_tier_passes(ctx: Ctx) -> None:
    """bit_widths [16, 12, 8, 4] with four tier fractions and the INT4 pair in the calibration file."""
    d = ctx.copy(manifest=False)

    def int4(a: dict[str, np.ndarray]) -> None:
        for n in [n for n in a if n.endswith(".scale_int8")]:
            a[n.replace("scale_int8", "scale_int4")] = a[n] * np.float32(127 / 7)
            a[n.replace("scale_int8", "comp_int4")] = np.zeros_like(a[n])

    write_calibration(d, int4)
    edit_json(d / "quant_config.json", lambda j: j["kv_quantization"].update(
        bit_widths=[16, 12, 8, 4], tier_fractions=[0.25, 0, 0.25, 0.5]))
    r = verify(d)
    assert r.ok and r.marks["adaptive_quant"], r.to_json()
    write_calibration(d, lambda a: (int4(a), a[next(n for n in a if n.endswith("scale_int4"))].__setitem__(0, 0.0)))
    assert "CALIB_SCALE_INVALID" in verify(d).codes  # an INT4 scale is checked like the others


def test_int8_index_keys_need_their_scales(ctx: Ctx) -> None:
    """index_key_bits 8 (decisions "INT8 indexer keys"): every owning layer's index_key.scale_int8 [dI], checked
    like the latent scales; without the flag the tensors are still allowed (and checked)."""
    d = ctx.copy(manifest=False)
    d_i = json.loads((d / "config.json").read_text())["gsm_config"]["indexer_dim"]

    def keys(a: dict[str, np.ndarray], layers: tuple[int, ...] = (0, 1, 2), dim: int = d_i) -> None:
        for i in layers:
            a[names.index_key_scale_name(i)] = np.full(dim, 0.02, np.float32)

    edit_json(d / "quant_config.json", lambda j: j["kv_quantization"].update(index_key_bits=8))
    write_calibration(d, keys)
    assert verify(d).ok, verify(d).to_json()
    write_calibration(d, lambda a: keys(a, (0, 2)))
    r = verify(d)
    assert r.codes == ["CALIB_TENSOR_MISSING"] and names.index_key_scale_name(1) in r.errors[0].message
    write_calibration(d, lambda a: keys(a, dim=d_i + 1))
    assert set(verify(d).codes) == {"CALIB_SHAPE_MISMATCH"} and "indexer dim" in verify(d).errors[0].message
    write_calibration(d, lambda a: (keys(a), a[names.index_key_scale_name(0)].__setitem__(3, -1.0)))
    assert verify(d).codes == ["CALIB_SCALE_INVALID"]
    edit_json(d / "quant_config.json", lambda j: j["kv_quantization"].update(index_key_bits=16))
    write_calibration(d)
    assert verify(d).ok  # FP16 keys need no key scales
    edit_json(d / "quant_config.json", lambda j: j["kv_quantization"].update(index_key_bits=4))
    assert "QUANT_INVALID" in verify(d).codes


def test_head_input_moment_is_optional_and_checked(ctx: Ctx) -> None:
    """head.input_moment (decisions "Quantised embedding and LM head"): allowed at [H, H], finite; another shape or a
    non-finite value is an error naming it."""
    d = ctx.copy(manifest=False)
    h = json.loads((d / "config.json").read_text())["hidden_size"]
    write_calibration(d, lambda a: a.__setitem__(names.HEAD_INPUT_MOMENT, np.eye(h, dtype=np.float32)))
    assert verify(d).ok, verify(d).to_json()
    write_calibration(d, lambda a: a.__setitem__(names.HEAD_INPUT_MOMENT, np.eye(h + 1, dtype=np.float32)))
    r = verify(d)
    assert r.codes == ["CALIB_SHAPE_MISMATCH"] and names.HEAD_INPUT_MOMENT in r.errors[0].message
    assert f"expected [{h}, {h}]" in r.errors[0].message
    bad = np.eye(h, dtype=np.float32)
    bad[1, 2] = np.nan
    write_calibration(d, lambda a: a.__setitem__(names.HEAD_INPUT_MOMENT, bad))
    assert "CALIB_SCALE_INVALID" in verify(d).codes


def test_params_counts_elements(tiny: Path) -> None:
    f = LazySafetensors(tiny / "model.safetensors")
    assert verify(tiny).params == sum(int(np.prod(f.shape(n))) for n in f.names)


def test_unexpected_failure_becomes_internal(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gsm.checker as checker

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("boom")
    monkeypatch.setattr(checker._Checker, "_check_manifest", boom)
    r = verify(tiny)
    assert r.codes == ["INTERNAL"] and "boom" in r.errors[0].message


def test_codes_raised_by_the_loaders_are_documented() -> None:
    used: set[str] = set()
    for mod in ("checkpoint", "safetensors_io", "checker"):
        src = (ROOT / "gsm" / f"{mod}.py").read_text()
        used |= set(re.findall(r'\bcode="([A-Z_]+)"', src))
        used |= set(re.findall(r'missing_code="([A-Z_]+)"', src))
        for prefix, missing in re.findall(r'code_prefix="([A-Z_]+)"(?:, missing_code="([A-Z_]+)")?', src):
            used |= {missing or f"{prefix}_MISSING", f"{prefix}_INVALID_JSON"}
        used |= set(re.findall(r'self\.error\("([A-Z_]+)"', src))
    assert len(used) > 30
    assert used <= set(ERROR_CODES), used - set(ERROR_CODES)


def test_docs_table_lists_exactly_the_codes() -> None:
    doc = (ROOT / "docs" / "checker.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", doc, re.M))
    assert documented == set(ERROR_CODES)


# ---- the CLI never shows a traceback ---------------------------------------------------------

def _cli(d: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gsm", "verify", str(d), *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("code", ["DIR_NOT_FOUND", "CONFIG_INVALID_JSON", "SAFETENSORS_HEADER_SIZE",
                                  "SHARD_MISSING", "SYMLINK_ESCAPE", "TENSOR_NONFINITE"])
def test_cli_json_on_malformed(ctx: Ctx, code: str) -> None:
    p = _cli(CASES[code](ctx), "--json")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    report = json.loads(p.stdout)
    assert report["ok"] is False and code in [e["code"] for e in report["errors"]]


def test_cli_human_output(ctx: Ctx) -> None:
    ok = _cli(ctx.tiny)
    assert ok.returncode == 0 and "svd_factors" in ok.stdout and "params" in ok.stdout
    bad = _cli(CASES["SAFETENSORS_OFFSETS"](ctx))
    assert bad.returncode == 2 and "SAFETENSORS_OFFSETS" in bad.stdout
    assert "Traceback" not in bad.stdout + bad.stderr


# ---- random corruption never crashes the checker ---------------------------------------------

@pytest.fixture(scope="module")
def corrupt_targets(tiny: Path, tiny_sharded: Path, tmp_path_factory: pytest.TempPathFactory,
                    ) -> dict[str, tuple[Path, Path]]:
    """Private copies: examples corrupt one file in place and restore it afterwards."""
    base = tmp_path_factory.mktemp("corrupt")
    single = Path(shutil.copytree(tiny, base / "single"))
    sharded = Path(shutil.copytree(tiny_sharded, base / "sharded"))
    return {"model": (single, single / "model.safetensors"),
            "config": (single, single / "config.json"),
            "index": (sharded, sharded / "model.safetensors.index.json"),
            "shard": (sharded, first_shard(sharded, 1))}


corruption = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("overwrite"), st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(None)),
)


def _corrupt(data: bytes, op: tuple[str, float, object]) -> bytes:
    kind, where, arg = op
    pos = int(where * len(data))
    # header bytes matter most: aim half of the positions at the first 1 KiB
    if kind == "flip":
        b = bytearray(data)
        b[pos] ^= 1 << int(arg)  # type: ignore[call-overload]
        return bytes(b)
    if kind == "overwrite":
        return data[:pos] + arg + data[pos + len(arg):]  # type: ignore[operator]
    return data[:pos]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["model", "config", "index", "shard"]), op=corruption,
       head=st.booleans())
def test_random_corruption_gives_a_report(corrupt_targets: dict[str, tuple[Path, Path]], target: str,
                                          op: tuple[str, float, object], head: bool) -> None:
    d, path = corrupt_targets[target]
    original = path.read_bytes()
    if head:  # concentrate half the examples on the header / start of the file
        op = (op[0], op[1] * min(1.0, 1024 / len(original)), op[2])
    changed = _corrupt(original, op)
    try:
        path.write_bytes(changed)
        r = verify(d)
    finally:
        path.write_bytes(original)
    assert "INTERNAL" not in r.codes, r.to_json()
    if changed != original:  # the manifest catches any change the other rules miss
        assert not r.ok
