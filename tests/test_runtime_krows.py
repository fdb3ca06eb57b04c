"""Cached K rows. The portable graph (docs/engine_io.md 5) caches every layer's K rows beside the float32 latents
(and its V sum takes a prefill and a decode form, last test); model.cpu.onnx reads the plugins' pools and keeps the
K rows of recently selected positions in a bounded row cache per layer. What must hold is what the golden
computes on every step: K_s = RoPE(U_k c_s, s) from the
latent row as the cache holds it now (spec 4.1; 4.2 for a sharing layer, from the source's [c_k; c_v]
through the kv_projector), also after a re-tier pass re-encoded c_s to INT12/INT8. The expected rows
here are made with numpy from the checkpoint's tensors and the spec's RoPE (HF rotate-half layout),
not by the graph; the golden comparisons of whole generations are in test_runtime_golden.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import retiering_copy

from builder.build import BuildConfig, build
from gsm import checkpoint, names
from gsm.synth import synth_checkpoint

N_MAX = 96


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("krows")
    ck = retiering_copy(synth_checkpoint("tiny", root / "tiny", seed=5), root / "retier")
    out = root / "bundle"
    build(BuildConfig(device="orin", checkpoint=ck, output=out, max_seq=N_MAX, max_input=16, max_batch=2))
    return ck, out


def rope(x: np.ndarray, pos: np.ndarray, theta: float, n_kv: int) -> np.ndarray:
    """x [n, nKV*D] rotated per head at positions pos [n]: x cos + rotate_half(x) sin (float64)."""
    n, kvd = x.shape
    d = kvd // n_kv
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv  # [n, D/2]
    cos, sin = np.cos(ang), np.sin(ang)
    h = x.reshape(n, n_kv, 2, d // 2).astype(np.float64)
    a, b = h[:, :, 0], h[:, :, 1]
    out = np.stack([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], axis=2)
    return out.reshape(n, kvd)


def expected_k_rows(ck, cache, n: int) -> dict[int, np.ndarray]:
    """K rows of positions 0..n-1 of every layer, from the latents `cache` (a sequence's cache) holds now."""
    cfg, sd = checkpoint.load_config(ck), checkpoint.load_state_dict(ck)
    kvd, pos = cfg.kv_dim, np.arange(n)
    out = {}
    for i in range(cfg.num_hidden_layers):
        src = i if cfg.is_owning(i) else cfg.gsm.kv_sharing[i]
        ck_, cv_ = (np.asarray(a, np.float64) for a in cache.latents(src, n))
        if cfg.is_owning(i):
            k = ck_ @ sd[names.layer_name("k_U", i)].astype(np.float64).T
        else:
            w, b = sd[names.layer_name("proj_w", i)], sd[names.layer_name("proj_b", i)]
            k = np.concatenate([ck_, cv_], axis=1) @ w[:kvd].astype(np.float64).T + b[:kvd]
        out[i] = rope(k, pos, cfg.rope_theta, cfg.num_key_value_heads)
    return out


def test_cached_k_rows_are_the_rope_of_the_held_latents_after_retiering(built):
    import runtime

    ck, bundle = built
    rt = runtime.load(bundle, backend="onnxruntime", threads=1, graph="portable")
    cfg = checkpoint.load_config(ck)
    assert set(rt.backend.k_rows) == set(range(cfg.num_hidden_layers))  # owning and sharing layers alike
    assert cfg.gsm.kv_sharing, "the tiny model should have a sharing layer"
    seq = rt.new_sequence()
    logits = seq.prefill(np.random.default_rng(1).integers(3, 259, 30).tolist())
    before = {}
    for step in range(26):  # re-tier passes every 8 decode steps (retiering_copy)
        logits = seq.decode(int(np.argmax(logits)))
        if step == 6:  # just before the pass at step 8: the rows as written, FP16 latents
            n0 = seq.length
            before = {i: rt.backend.buffers[f"k_rows.{i}"][seq.cache.row, :n0].copy()
                      for i in range(cfg.num_hidden_layers)}
    n, row = seq.length, seq.cache.row
    tiers = seq.state.tier[:n]
    assert seq.retier_passes >= 3 and (tiers > 0).sum() >= 10, "the run should have demoted rows"
    want = expected_k_rows(ck, seq.cache, n)
    changed = 0
    for i, w in want.items():
        got = rt.backend.buffers[f"k_rows.{i}"][row, :n]
        scale = np.abs(w).max()
        np.testing.assert_allclose(got, w, rtol=0, atol=2e-6 * scale, err_msg=f"layer {i}")
        # the demotion graph rewrote the demoted rows: they moved from the FP16-latent rows written at first
        demoted = np.nonzero(tiers[: before[i].shape[0]] > 0)[0]
        changed += int(np.any(np.abs(got[demoted] - before[i][demoted]) > 1e-4 * scale))
    assert changed == cfg.num_hidden_layers


def test_row_cache_holds_the_rope_of_the_pools_latents_after_retiering(built):
    """model.cpu.onnx: after re-tier passes re-encoded rows (to INT12 / INT8) and moved them, every row of every
    layer's row cache whose tag still names the slot table's entry is K of the latent the pool holds now (owning:
    RoPE(U_k c_k); sharing: RoPE(W_k [c_k; c_v] + b_k) of the source's), each position at most once; a re-encoded
    row's tag no longer matches until a step reads it again."""
    import runtime

    ck, bundle = built
    rt = runtime.load(bundle, backend="onnxruntime", threads=1, graph="cpu")
    cfg = checkpoint.load_config(ck)
    seq = rt.new_sequence()
    logits = seq.prefill(np.random.default_rng(2).integers(3, 259, 30).tolist())
    for _ in range(26):
        logits = seq.decode(int(np.argmax(logits)))
    n, row = seq.length, seq.cache.row
    assert seq.retier_passes >= 3 and (seq.state.tier[:n] > 0).sum() >= 10, "the run should have demoted rows"
    want = expected_k_rows(ck, seq.cache, n)
    entries = seq.cache.slots.entries
    checked = 0
    for i, w in want.items():
        tags, rows = rt.backend.buffers[f"row_cache_tags.{i}"][row], rt.backend.buffers[f"row_cache.{i}"][row]
        pos, ent = tags[0], tags[1]
        held = np.nonzero(pos >= 0)[0]
        assert len(set(pos[held].tolist())) == held.size, f"layer {i}: a position held twice"
        assert held.size > 0 and (pos[held] < n).all()
        scale = np.abs(w).max()
        for c in held:
            if ent[c] == entries[pos[c]]:
                np.testing.assert_allclose(rows[c], w[pos[c]], rtol=0, atol=2e-6 * scale, err_msg=f"layer {i}")
                checked += 1
    assert checked > 10 * cfg.num_hidden_layers


def test_cache_bytes_per_position_counts_the_k_rows(built):
    """The portable graph holds float32 latents, keys and every layer's K rows per position."""
    import runtime

    ck, bundle = built
    rt = runtime.load(bundle, backend="onnxruntime", threads=1, graph="portable")
    cfg = checkpoint.load_config(ck)
    ranks = rt.backend.cfg.ranks
    want = sum(4 * (rk + rv) + 2 * cfg.gsm.indexer_dim for rk, rv in ranks.values())
    want += 4 * cfg.kv_dim * cfg.num_hidden_layers
    assert rt.backend.cache_bytes_per_position() == want


def test_prefill_and_decode_forms_of_the_v_sum_agree(built):
    """The attention's V sum has two forms chosen by an `If` on S (docs/runtime.md "The attention's
    arithmetic"): a prefill chunk rebuilds V per distinct row and sums in float32, a decode step attends
    over the latents in float64 and up-projects after. Feeding the same 24 tokens as one chunk or one token
    per call must give the same last logits (to float32 rounding) and the same cached rows; the graph has
    one `If` per layer whose branches are those two forms."""
    import onnx

    import runtime

    ck, bundle = built
    cfg = checkpoint.load_config(ck)
    model = onnx.load(str(bundle / "model.portable.onnx"), load_external_data=False)
    ifs = [n for n in model.graph.node if n.op_type == "If"]
    assert len(ifs) == cfg.num_hidden_layers
    for n in ifs:
        branches = {a.name: a.g for a in n.attribute}
        casts = {k: {a.i for node in b.node for a in node.attribute if a.name == "to"} for k, b in branches.items()}
        assert onnx.TensorProto.DOUBLE in casts["then_branch"]  # the float64 latent sum
        assert onnx.TensorProto.DOUBLE not in casts["else_branch"]
    rt = runtime.load(bundle, backend="onnxruntime", threads=1, graph="portable")
    ids = np.random.default_rng(9).integers(3, 259, 24).tolist()
    whole, single = rt.new_sequence(), rt.new_sequence()
    for seq in (whole, single):
        seq.keep_fp16()  # no re-tier pass: the two would re-tier at different steps
    chunk_logits = whole.prefill(ids)  # max_input 16: chunks of 16 and 8, the rebuilt form
    one_logits = single.prefill(ids[:1])
    for t in ids[1:]:
        one_logits = single.decode(t)  # S = 1: the latent form
    scale = float(np.abs(chunk_logits).max())
    np.testing.assert_allclose(one_logits, chunk_logits, rtol=0, atol=1e-5 * scale)
    for i in range(cfg.num_hidden_layers):
        a = rt.backend.buffers[f"k_rows.{i}"][whole.cache.row, :24]
        b = rt.backend.buffers[f"k_rows.{i}"][single.cache.row, :24]
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(a).max()))
