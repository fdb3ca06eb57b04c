"""Run-time knobs without a rebuild (gsm.bundle_knobs): `python -m runtime patch` on a bundle, the limits a bundle was
built for, Engine.patch and PATCH /admin/config on a running server, whose later requests select with the new knobs
while the running ones keep theirs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from runtime_bundles import build_demo, run_module

from gsm.bundle_knobs import KnobError, KnobLimits, RunKnobs, RunTime, patch_knobs
from gsm.config import KVQuantConfig

DEMO_BUILD = dict(max_seq=64, max_input=16, max_batch=8)  # demo: sinks 1, window 3 (max 8), top-k 8 (max_top_k 8)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo(tmp_path_factory.mktemp("knobs") / "demo", **DEMO_BUILD)


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def patch_cli(bundle: Path, ops, tmp: Path, *extra: str):
    f = tmp / "patch.json"
    f.write_text(ops if isinstance(ops, str) else json.dumps(ops))
    return run_module("runtime", "patch", str(bundle), "--patch", str(f), *extra, cwd=tmp)


def test_patch_changes_knobs_in_place_rehashes_and_links_the_rest(demo, tmp_path):
    import runtime
    from runtime.bundle import verify_bundle

    b = tmp_path / "b"
    shutil.copytree(demo, b)
    inode = os.stat(b / "weights.bin").st_ino
    ops = [{"op": "replace", "path": "/run_time/sparse_window", "value": 2},
           {"op": "replace", "path": "/run_time/sparse_top_k", "value": 0},
           {"op": "replace", "path": "/run_time/min_hit_rate", "value": 0.5},
           {"op": "replace", "path": "/run_time/max_kv_noise", "value": None},
           {"op": "replace", "path": "/quantization_adaptation_rate", "value": 500},
           {"op": "replace", "path": "/kv_quantization/tier_fractions", "value": [0.5, 0.25, 0.25]},
           {"op": "replace", "path": "/kv_quantization/hotness_decay", "value": 0.8},
           {"op": "add", "path": "/kv_quantization/hot_token_ids/-", "value": 5}]
    r = patch_cli(b, ops, tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads((b / "bundle.json").read_text())
    expected = {"run_time": {"sparse_window": 2, "sparse_top_k": 0, "min_hit_rate": 0.5, "hit_rate_every": 64,
                             "max_kv_noise": None},
                "quantization_adaptation_rate": 500,
                "kv_quantization": {"tier_fractions": [0.5, 0.25, 0.25], "fp16_window": 32, "hotness_decay": 0.8,
                                    "hot_token_ids": [5]}}
    assert d["run_time"] == expected["run_time"] and d["quantization_adaptation_rate"] == 500
    assert {k: d["kv_quantization"][k] for k in expected["kv_quantization"]} == expected["kv_quantization"]
    # the checksum the command prints and the manifest keeps: sha256 of the sorted, compact knob document
    canonical = json.dumps(expected, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(canonical).hexdigest()
    manifest = verify_bundle(b)  # every file against its (re-)hash
    assert manifest["knobs_checksum"] == digest and digest in r.stdout
    assert os.stat(b / "weights.bin").st_ino == inode  # linked, not copied
    rt = runtime.load(b, "onnxruntime", threads=1)
    seq = rt.new_sequence()
    assert (seq.window_input, seq.budget_input, seq.policy.rate, seq.policy.hot_token_ids) == (2, 0, 500,
                                                                                                 frozenset({5}))


def test_patch_to_another_directory_copies_and_leaves_the_source(demo, tmp_path):
    from runtime.bundle import verify_bundle

    before = tree_hashes(demo)
    r = patch_cli(demo, [{"op": "replace", "path": "/run_time/hit_rate_every", "value": 8}], tmp_path,
                  "--out", str(tmp_path / "copy"))
    assert r.returncode == 0, r.stderr
    assert tree_hashes(demo) == before
    verify_bundle(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "bundle.json").read_text())["run_time"]["hit_rate_every"] == 8
    assert os.stat(tmp_path / "copy" / "weights.bin").st_ino != os.stat(demo / "weights.bin").st_ino


REFUSALS = [
    ([{"op": "replace", "path": "/max_top_k", "value": 4}], "/max_top_k: cannot change without a rebuild "
                                                             "(--max-top-k)"),
    ([{"op": "replace", "path": "/n_max", "value": 32}], "(--max-seq)"),
    ([{"op": "replace", "path": "/max_batch", "value": 2}], "(--max-batch)"),
    ([{"op": "replace", "path": "/pool_rows/fp16", "value": 2}], "--tier-fractions or --max-adaptation-rate"),
    ([{"op": "add", "path": "/layer_selection/0", "value": [2, 2]}], "python -m gsm patch CHECKPOINT"),
    ([{"op": "replace", "path": "/sink_tokens", "value": 2}], "an attribute of the attention nodes"),
    ([{"op": "replace", "path": "/sparse_window", "value": 2}], "the run-time window is /run_time/sparse_window"),
    ([{"op": "replace", "path": "/ranks/0", "value": [4, 4]}], "python -m gsm convert"),
    ([{"op": "replace", "path": "/kv_quantization/index_key_bits", "value": 8}], "--index-keys"),
    ([{"op": "replace", "path": "/kv_quantization/bit_widths", "value": [16, 12, 8, 4]}], "calibration run"),
    ([{"op": "replace", "path": "/run_time/sparse_window", "value": 9}], "above the graphs' max_sparse_window 8"),
    ([{"op": "replace", "path": "/run_time/sparse_top_k", "value": 9}], "largest budget 8 (rebuild with a larger "
                                                                         "--max-top-k)"),
    ([{"op": "replace", "path": "/run_time/sparse_window", "value": 0}], "expected an integer >= 1"),
    ([{"op": "replace", "path": "/quantization_adaptation_rate", "value": 0}], "expected an integer >= 1"),
    ([{"op": "replace", "path": "/kv_quantization/hotness_decay", "value": 1.0}], "hotness_decay must be in [0, 1)"),
    ([{"op": "replace", "path": "/kv_quantization/tier_fractions", "value": [0.5, 0.5, 0.5]}], "summing to 1"),
    ([{"op": "replace", "path": "/kv_quantization/tier_fractions", "value": [0, 0, 0.5, 0.5]}], "has no 4"),
    ([{"op": "add", "path": "/kv_quantization/hot_token_ids/-", "value": 384}], "outside the vocabulary [0, 384)"),
    ([{"op": "replace", "path": "/run_time/max_kv_noise", "value": "often"}], "'auto' or null (off)"),
    ([{"op": "replace", "path": "/run_time/min_hit_rate", "value": 1.5}], "a number in [0, 1]"),
    ([{"op": "add", "path": "/run_time/window", "value": 2}], "run_time.window is not a run-time knob"),
    ([{"op": "add", "path": "/colour", "value": 2}], "/colour: not a knob of a bundle"),
    ({"op": "replace"}, "a non-empty JSON array"),
    ([], "a non-empty JSON array"),
    ([{"op": "frobnicate", "path": "/run_time/sparse_window"}], "op one of add, remove"),
    ([{"op": "replace", "path": "/run_time/sparse_window"}], "no value"),
    ([{"op": "replace", "path": "run_time/sparse_window", "value": 2}], "is not a JSON pointer"),
    ([{"op": "remove", "path": "/kv_quantization/hot_token_ids/3"}], "operation 0 (remove) does not apply"),
    ([{"op": "test", "path": "/n_max", "value": 63}], "operation 0 (test) does not apply"),
    # all or nothing: a good operation before a bad one changes nothing either
    ([{"op": "replace", "path": "/run_time/sparse_window", "value": 2},
      {"op": "replace", "path": "/max_input", "value": 8}], "/max_input: cannot change without a rebuild"),
    ("[{not json", "not a JSON file"),
]


@pytest.mark.parametrize("ops,words", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_every_refusal_names_the_path_and_writes_nothing(demo, tmp_path, ops, words):
    b = tmp_path / "b"
    shutil.copytree(demo, b)
    before = tree_hashes(b)
    r = patch_cli(b, ops, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert tree_hashes(b) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "patch.json"]  # no temporary directory left


def test_a_modified_bundle_is_not_re_signed(demo, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(demo, b)
    d = json.loads((b / "bundle.json").read_text())
    d["sparse_top_k"] = 7  # a hand edit: the manifest's hash no longer matches
    (b / "bundle.json").write_text(json.dumps(d))
    r = patch_cli(b, [{"op": "replace", "path": "/run_time/sparse_window", "value": 2}], tmp_path)
    assert r.returncode == 2 and "bundle.json" in r.stderr and "integrity" in r.stderr, r.stderr
    assert json.loads((b / "bundle.json").read_text()) == d


def test_a_missing_patch_file_is_named(demo, tmp_path):
    r = run_module("runtime", "patch", str(demo), "--patch", str(tmp_path / "none.json"), cwd=tmp_path)
    assert r.returncode == 2 and "--patch" in r.stderr and "no such file" in r.stderr


def _limits(pools, *, rate=1000, fractions=(0.0, 0.0, 0.25, 0.75)) -> KnobLimits:
    kv = KVQuantConfig(bit_widths=(16, 12, 8, 4), tier_fractions=fractions)
    return KnobLimits(n_max=8192, max_input=512, max_sparse_window=32, max_top_k=455, sink_tokens=1, vocab_size=100,
                      pool_rows=pools, adaptation_rate=rate, kv=kv)


def _knobs(rate=1000, fractions=(0.0, 0.0, 0.25, 0.75), fp16_window=32) -> RunKnobs:
    return RunKnobs(RunTime(), rate, fractions, fp16_window, 0.9, ())


def test_the_tier_policy_must_fit_the_pools_the_plan_made():
    # SmolLM2's INT4-mix bundle at 8K: FP16 1 + 32 + 0 + max(512, 1000) = 1033, INT8 2048, INT4 the rest
    lim = _limits((1033, 0, 2048, 5111))
    lim.check(_knobs())
    lim.check(_knobs(rate=600))  # fewer rows between passes: fits
    with pytest.raises(KnobError, match=r"^/quantization_adaptation_rate: .* 2033 FP16 rows .* holds 1033; rebuild "
                                        r"with --max-adaptation-rate 2000$"):
        lim.check(_knobs(rate=2000))
    with pytest.raises(KnobError, match="/kv_quantization/tier_fractions: .* --tier-fractions 0.1,0,0.25,0.65"):
        lim.check(_knobs(fractions=(0.1, 0.0, 0.25, 0.65)))  # 819 more FP16 rows
    # more INT8 rows than the INT8 region, but the FP16 region is wide enough for the surplus: a row may live in a
    # wider region, so only each prefix of regions must hold its tiers
    wide = _limits((1033 + 2048, 0, 1024, 4087))
    wide.check(_knobs(fractions=(0.0, 0.0, 0.35, 0.65)))  # needs 1033 FP16 + 2867 INT8 <= 3081 + 1024
    with pytest.raises(KnobError, match="FP16/INT12/INT8 rows"):
        wide.check(_knobs(fractions=(0.0, 0.0, 0.4, 0.6)))  # 1033 + 3276 > 4105


def test_max_adaptation_rate_makes_room_in_the_fp16_region():
    from builder.plan import pool_rows
    from gsm.synth import PRESETS, preset_config

    cfg = preset_config(PRESETS["tiny"])
    quant = KVQuantConfig(tier_fractions=(0.25, 0.25, 0.5))
    base = pool_rows(4096, 64, cfg, quant)
    room = pool_rows(4096, 64, cfg, quant, max_rate=3000)
    rate = cfg.gsm.quantization_adaptation_rate
    assert room.fp16 - base.fp16 == 3000 - max(64, rate) and room.total == base.total == 4096
    assert pool_rows(4096, 64, cfg, quant, max_rate=1) == base  # never less room than the model's own rate


def test_patch_knobs_is_all_or_nothing():
    lim = _limits((1033, 0, 2048, 5111))
    k = _knobs()
    with pytest.raises(KnobError, match="/n_max"):
        patch_knobs(k, [{"op": "replace", "path": "/run_time/sparse_window", "value": 4},
                        {"op": "replace", "path": "/n_max", "value": 4}], lim)
    assert k.run_time.sparse_window is None  # the input is never modified
    new = patch_knobs(k, [{"op": "replace", "path": "/run_time/sparse_window", "value": 4}], lim)
    assert new.run_time.sparse_window == 4 and new.checksum != k.checksum


def test_verify_judges_the_graphs_with_the_knobs_the_golden_ran_with(demo, tmp_path):
    """A patched bundle selects otherwise, yet `runtime verify` still passes: it replays the probe with the knobs
    recorded beside it. A probe that names none is refused with the rebuild command."""
    from runtime.verify import verify

    b = tmp_path / "b"
    shutil.copytree(demo, b)
    assert patch_cli(b, [{"op": "replace", "path": "/run_time/sparse_window", "value": 1},
                         {"op": "replace", "path": "/run_time/sparse_top_k", "value": 0}], tmp_path).returncode == 0
    assert verify(b, "onnxruntime").passed


# -- a running engine and server -------------------------------------------------------------------------------
class Selections:
    """Wraps a backend's forward so every call returns (and records) each sequence's selected positions, by the
    engine request whose sequence it is at that call: request id -> list of (the decode step's query position,
    {layer: selected positions})."""

    def __init__(self, backend):
        self.backend, self.inner = backend, backend.forward
        self.engine = None
        self.seen: dict[int, list[tuple[int, dict[int, frozenset[int]]]]] = {}
        self.windows: list[tuple[int, int]] = []  # (call's window input, sequences)
        backend.forward = self.forward

    def forward(self, caches, ids, past, new, sparse_window, top_k, **kw):
        kw["probes"] = True
        out = self.inner(caches, ids, past, new, sparse_window, top_k, **kw)
        if self.engine is not None and kw.get("commit", True) and int(np.max(new)) == 1:
            # the scheduler thread makes this call and owns the running list
            owner = {id(r.sequence.cached.cache): r.id for r in self.engine._running if r.sequence.cached is not None}
            self.windows.append((int(sparse_window), len(caches)))
            for b, c in enumerate(caches):
                sel = {l: frozenset(int(p) for p in v[b, 0] if p >= 0) for l, v in out.selected.items()}
                if id(c) in owner:
                    self.seen.setdefault(owner[id(c)], []).append((int(past[b]), sel))
        return out

    def restore(self):
        self.backend.forward = self.inner


def test_a_patch_reaches_new_requests_only_and_mixed_windows_never_share_a_call(rts):
    """16 requests, 8 submitted before a window patch and 8 after (they queue for the 8 rows): every decode step of a
    later one selects with the new window, every step of an earlier one with the model's own, to their ends."""
    from runtime.engine import Engine, EngineConfig

    rt = rts["demo"]
    spy = Selections(rt.backend)
    try:
        with Engine(rt, EngineConfig(max_running=8, min_hit_rate=0.0, max_kv_noise=None)) as eng:
            spy.engine = eng
            old = [eng.submit([1, 40 + i, 50, 60], max_new_tokens=24, temperature=0.0, speculative="off")
                   for i in range(8)]
            t0 = time.monotonic()
            while not all(r.ids for r in old):
                assert time.monotonic() - t0 < 30
                time.sleep(0.002)
            with pytest.raises(KnobError, match="/run_time/sparse_window: 9 is above"):
                eng.patch([{"op": "replace", "path": "/run_time/sparse_window", "value": 9}])
            assert eng.config_generation == 0
            knobs = eng.patch([{"op": "replace", "path": "/run_time/sparse_window", "value": 2},
                               {"op": "replace", "path": "/run_time/sparse_top_k", "value": 0}])
            assert eng.config_generation == 1 and eng.knobs == knobs
            new = [eng.submit([1, 70 + i, 80, 90], max_new_tokens=12, temperature=0.0, speculative="off")
                   for i in range(8)]
            for r in old + new:
                r.result(60)
    finally:
        spy.restore()
    assert all(r.finish_reason == "length" for r in old + new)
    assert {r.knobs.run_time.sparse_window for r in old} == {None} and {r.knobs for r in new} == {knobs}
    new_ids = {r.id for r in new}
    checked = {"old": 0, "new": 0}
    for rid, steps in spy.seen.items():
        for t, sel in steps:
            for s in sel.values():
                if rid in new_ids:  # sink 0, window 2, no indexer pick
                    assert s == {0, t - 1, t}, (rid, t, sorted(s))
                    checked["new"] += 1
                elif t >= 3:  # the model's own: window 3 + top-k 8 + sink, dense below that
                    assert len(s) == min(t + 1, 12) and {0, t - 2, t - 1, t} <= s, (rid, t, sorted(s))
                    checked["old"] += 1
    assert set(spy.seen) == {r.id for r in old + new}  # every request's decode steps were seen
    assert checked["new"] >= 8 * 11 and checked["old"] >= 8 * 20
    assert {w for w, _ in spy.windows} >= {0, 2}  # both windows ran, never in one call (forward_batch refuses it)


def test_admin_config_over_http(rts):
    import httpx
    from test_serve import live_server, metric_samples

    from runtime.serve.guard import GuardConfig

    patch = [{"op": "replace", "path": "/run_time/sparse_window", "value": 2}]
    with live_server(rts["demo"], guard=GuardConfig()) as (srv, url):  # no key at all: admin off
        r = httpx.patch(url + "/admin/config", json=patch, timeout=10)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert srv.engine.config_generation == 0
    with live_server(rts["demo"], guard=GuardConfig(admin_key="sesame")) as (srv, url):
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30).status_code \
            == 200  # the API stays open: only /admin/ takes the admin key
        assert httpx.get(url + "/admin/config", timeout=10).status_code == 401  # loopback is no exemption
        assert httpx.patch(url + "/admin/config", json=patch, headers={"Authorization": "Bearer nope"},
                           timeout=10).status_code == 401
        auth = {"Authorization": "Bearer sesame"}
        before = httpx.get(url + "/admin/config", headers=auth, timeout=10).json()
        assert before["generation"] == 0 and before["config"]["run_time"]["sparse_window"] is None
        bad = httpx.patch(url + "/admin/config", headers=auth, timeout=10,
                          json=patch + [{"op": "replace", "path": "/n_max", "value": 8}])
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "/n_max"
        assert "--max-seq" in bad.json()["error"]["message"]
        assert httpx.patch(url + "/admin/config", headers=auth, content=b"{", timeout=10).status_code == 400
        assert httpx.get(url + "/admin/config", headers=auth, timeout=10).json() == before  # nothing changed
        ok = httpx.patch(url + "/admin/config", json=patch, headers=auth, timeout=10)
        assert ok.status_code == 200
        body = ok.json()
        assert body["generation"] == 1 and body["config"]["run_time"]["sparse_window"] == 2
        assert body["checksum"] == srv.engine.knobs.checksum != before["checksum"]
        assert metric_samples(url)[("gsm_config_generation", ())] == 1.0


@pytest.mark.skipif(not (Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories_eval.txt").is_file(),
                    reason="the held-out stories are not in ../shared/data")
def test_the_knob_bench_applies_each_setting_as_a_patch(demo, tmp_path):
    """bench/knobs.py on the demo: one row per setting, each its knobs' effect: the window setting selects fewer
    positions than the model's own, so its perplexity differs, while its bytes in use do not (the same tier policy)."""
    out = tmp_path / "knobs.json"
    r = run_module("bench.knobs", str(demo), "--prompt", "16", "--decode", "24", "--threads", "1",
                   "--settings", "as built,window 2", "--json", str(out), cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    rows = {row["setting"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"as built", "window 2"} and all(row["text"] == "story" for row in rows.values())
    assert rows["as built"]["perplexity"] != rows["window 2"]["perplexity"]
    assert rows["as built"]["bytes_per_position"] == rows["window 2"]["bytes_per_position"]
