"""`GsmPoolAttention` (plugins/ortCpu): GsmCachedAttention's math over the plugins' own pools (engine_io section 3),
against the plugins' C++ CPU reference (`gsm_edge_plugins.ref`: GsmKVCacheUpdate then GsmSparseAttention) on the
same pools, call after call: prefill chunks, decode steps, a re-tier pass (rows re-encoded to INT12 / INT8 / INT4
and moved), a rollback, several sequences in one call, and a row cache too small for a selection (evictions and
overflow). The op writes the call's new rows and keys into the pools exactly as the reference's update does."""

from __future__ import annotations

import numpy as np
import pytest
from gsm_edge_plugins import ort_ops_library, reference_available

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
ref = pytest.importorskip("gsm_edge_plugins.ref")
from onnx import TensorProto, helper  # noqa: E402

from runtime.slots import SlotTable  # noqa: E402

LIB = ort_ops_library()
pytestmark = pytest.mark.skipif(LIB is None or not reference_available(),
                                reason="libgsm_ort_ops.so or the plugins' CPU reference is not built")

DOMAIN = "ai.gsm_edge.cpu"
INPUTS = ["q", "index_q", "index_w", "new_latent_k", "new_latent_v", "new_index_keys", "kv_pool", "index_keys",
          "kv_slots", "quant", "row_cache", "row_cache_tags", "k_up", "v_up", "rope_cos", "rope_sin", "cache_rows",
          "past_lengths", "new_lengths", "sparse_window", "sparse_top_k", "logit_rows", "selections"]
OUTPUTS = ["attn_out", "selected", "attn_mass", "row_cache_misses"]
SHARED_INPUTS = ["q", "kv_pool", "kv_slots", "quant", "row_cache", "row_cache_tags", "kv_proj_weight", "kv_proj_bias",
                 "rope_cos", "rope_sin", "selected", "cache_rows", "past_lengths", "new_lengths"]
SHARED_OUTPUTS = ["attn_out", "row_cache_misses"]
I32 = {"kv_pool", "kv_slots", "row_cache_tags", "cache_rows", "past_lengths", "new_lengths", "sparse_window",
       "sparse_top_k", "logit_rows", "selections", "selected", "row_cache_misses"}
# (nH, nKV, D, nI, dI, rk, rv): odd ranks (INT12 / INT4 padding), SmolLM2's heads with an index dim that is not a
# multiple of 4 (INT8 keys padded to words)
GEOMETRIES = {"odd": (4, 2, 6, 3, 12, 5, 9), "gqa3": (9, 3, 64, 3, 30, 23, 52)}
N_MAX, ROWS, SINKS, WINDOW, TOP_K = 96, 3, 2, 4, 9
TIERS = (70, 24, 24, 40)  # C16, C12, C8, C4


class Case:
    """Pools of ROWS sequences, the op's session and row cache, and the reference's copy of the same pools."""

    def __init__(self, geo: tuple[int, ...], key_bits: int, capacity: int, seed: int = 0, threads: int = 1,
                 half_up: bool = False) -> None:
        nH, nKV, D, nI, dI, rk, rv = geo
        self.geo, self.rng = geo, np.random.default_rng(seed)
        self.d = ref.Dims(num_heads=nH, num_kv_heads=nKV, head_dim=D, rank_k=rk, rank_v=rv, n_max=N_MAX,
                          rows_fp16=TIERS[0], rows_int12=TIERS[1], rows_int8=TIERS[2], rows_int4=TIERS[3],
                          index_heads=nI, index_dim=dI, sink_tokens=SINKS, max_top_k=N_MAX,
                          max_sparse_window=WINDOW, index_key_bits=key_bits)
        r = rk + rv
        f = lambda *s: self.rng.standard_normal(s).astype(np.float32)  # noqa: E731
        s8 = (np.abs(f(r)) * 0.02 + 0.01).astype(np.float32)
        self.quant = np.stack([s8 * np.float32(127 / 2047), s8, f(r) * np.float32(0.003),
                               s8 * np.float32(127 / 7), f(r) * np.float32(0.01)]).astype(np.float32)
        self.k_up, self.v_up = f(nKV * D, rk) * np.float32(0.3), f(nKV * D, rv) * np.float32(0.3)
        if half_up:  # U on the FP16 grid, given to the op as float16 (the reference keeps float32 copies)
            self.k_up, self.v_up = (u.astype(np.float16).astype(np.float32) for u in (self.k_up, self.v_up))
        self.up_dtype = np.float16 if half_up else np.float32
        inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
        ang = np.arange(N_MAX)[:, None] * inv[None, :]
        ang = np.concatenate([ang, ang], axis=1)
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.pool = ref.empty_pool(self.d, ROWS)
        self.keys = self.d.empty_index_keys(ROWS)
        self.ref_pool, self.ref_keys = self.pool.copy(), self.keys.copy()
        self.row_cache = np.zeros((ROWS, capacity, nKV * D), np.float32)
        self.tags = np.full((ROWS, 3, capacity), -1, np.int32)
        self.tables = [SlotTable(N_MAX, TIERS) for _ in range(ROWS)]
        node = helper.make_node("GsmPoolAttention", INPUTS, OUTPUTS, domain=DOMAIN, num_heads=nH, num_kv_heads=nKV,
                                head_dim=D, index_heads=nI, index_dim=dI, sink_tokens=SINKS, rows_fp16=TIERS[0],
                                rows_int12=TIERS[1], rows_int8=TIERS[2], rows_int4=TIERS[3])
        types = {n: TensorProto.INT32 if n in I32 else TensorProto.FLOAT for n in INPUTS + OUTPUTS + SHARED_INPUTS}
        int8 = key_bits == 8
        types["new_index_keys"] = TensorProto.INT8 if int8 else TensorProto.FLOAT16
        types["index_keys"] = TensorProto.INT32 if int8 else TensorProto.FLOAT16
        if half_up:
            types["k_up"] = types["v_up"] = TensorProto.FLOAT16
        graph = helper.make_graph([node], "pool_attention",
                                  [helper.make_tensor_value_info(n, types[n], None) for n in INPUTS],
                                  [helper.make_tensor_value_info(n, types[n], None) for n in OUTPUTS])
        self.session = self._session(graph, threads)
        # a KV-sharing layer over this pool, with its own row cache and kv_projector
        self.shared_d = ref.Dims(**{**self.d.__dict__, "layer_kind": 1})
        self.proj_w, self.proj_b = f(2 * nKV * D, r) * np.float32(0.2), f(2 * nKV * D) * np.float32(0.1)
        self.shared_cache = np.zeros_like(self.row_cache)
        self.shared_tags = np.full_like(self.tags, -1)
        shared = helper.make_node("GsmPoolSharedAttention", SHARED_INPUTS, SHARED_OUTPUTS, domain=DOMAIN, num_heads=nH,
                                  num_kv_heads=nKV, head_dim=D, rank_k=rk, rows_fp16=TIERS[0], rows_int12=TIERS[1],
                                  rows_int8=TIERS[2], rows_int4=TIERS[3])
        graph = helper.make_graph([shared], "pool_shared_attention",
                                  [helper.make_tensor_value_info(n, types[n], None) for n in SHARED_INPUTS],
                                  [helper.make_tensor_value_info(n, types[n], None) for n in SHARED_OUTPUTS])
        self.shared_session = self._session(graph, threads)

    @staticmethod
    def _session(graph: onnx.GraphProto, threads: int) -> ort.InferenceSession:
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
        m.ir_version = 8
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(LIB))
        so.intra_op_num_threads = threads
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def run(self, session: ort.InferenceSession, x: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        binding = session.io_binding()
        for name, a in x.items():  # in place: the pools, keys and row cache are the buffers the op writes
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(a))
        for name in outputs:
            binding.bind_output(name)
        session.run_with_iobinding(binding)
        return dict(zip(outputs, binding.copy_outputs_to_cpu()))

    def call(self, rows: list[int], past: list[int], new: list[int], S: int, top_k: int = TOP_K,
             entry: tuple[int, int] | None = None, selections: int = 1) -> dict[str, np.ndarray]:
        """One call over sequences in pool rows `rows`, through the op and through the reference; checks that they
        agree (selection, outputs, pools, keys) and returns the op's outputs. entry: (position, slot entry) put into
        the first sequence's kv_slots after the allocation (a runtime bug). selections: the op's input (0: it
        returns no selection, so only the rest is checked)."""
        nH, nKV, D, nI, dI, rk, rv = self.geo
        B = len(rows)
        f = lambda *s: self.rng.standard_normal(s).astype(np.float32)  # noqa: E731
        for row, p0, n in zip(rows, past, new):
            t = self.tables[row]
            moves = t.compaction(n)
            if moves:  # rows moved to free FP16 rows: the same moves on both copies (the demotion graph's job)
                entries = np.array([(row, a, b) for a, b in moves], np.int32)
                ref.kv_demote(self.d, entries, self.pool, self.quant)
                ref.kv_demote(self.d, entries, self.ref_pool, self.quant)
            t.allocate(range(p0, p0 + n))
        slots = np.stack([self.tables[r].entries for r in rows]).astype(np.int32)
        if entry is not None:
            slots[0, entry[0]] = entry[1]
        ck = f(B, S, rk).astype(np.float16).astype(np.float32)
        cv = f(B, S, rv).astype(np.float16).astype(np.float32)
        if self.d.index_key_bits == 8:
            key = self.rng.integers(-127, 128, (B, S, dI)).astype(np.float32)
            new_keys = key.astype(np.int8)
        else:
            new_keys = f(B, S, dI).astype(np.float16)
            key = new_keys.astype(np.float32)
        x = {"q": f(B, S, nH * D), "index_q": f(B, S, nI * dI), "index_w": f(B, S, nI), "new_latent_k": ck,
             "new_latent_v": cv, "new_index_keys": new_keys, "kv_pool": self.pool, "index_keys": self.keys,
             "kv_slots": slots, "quant": self.quant, "row_cache": self.row_cache, "row_cache_tags": self.tags,
             "k_up": self.k_up.astype(self.up_dtype), "v_up": self.v_up.astype(self.up_dtype), "rope_cos": self.cos,
             "rope_sin": self.sin, "cache_rows": np.array(rows, np.int32), "past_lengths": np.array(past, np.int32),
             "new_lengths": np.array(new, np.int32), "sparse_window": np.array([WINDOW], np.int32),
             "sparse_top_k": np.full(B, top_k, np.int32), "logit_rows": np.zeros((B, 1), np.int32),
             "selections": np.array([selections], np.int32)}
        out = self.run(self.session, x, OUTPUTS)

        rrows = np.array(rows, np.int32)
        ref.kv_update(self.d, ck, cv, key, self.ref_pool, self.ref_keys, slots, x["past_lengths"], x["new_lengths"],
                      cache_rows=rrows)
        r = ref.sparse_attention(self.d, x["q"], self.ref_pool, slots, x["past_lengths"], x["new_lengths"],
                                 self.quant, self.cos, self.sin, self.k_up, self.v_up, index_q=x["index_q"],
                                 index_w=x["index_w"], index_keys=self.ref_keys, sparse_window=WINDOW,
                                 sparse_top_k=x["sparse_top_k"], cache_rows=rrows)
        np.testing.assert_array_equal(self.pool, self.ref_pool, err_msg="pools after the call")
        np.testing.assert_array_equal(self.keys, self.ref_keys, err_msg="indexer keys after the call")
        k = out["selected"].shape[-1]
        for b, n in enumerate(new):
            if selections:
                np.testing.assert_array_equal(out["selected"][b, :n], r.selected[b, :n, :k],
                                              err_msg=f"selection of {b}")
                assert (r.selected[b, :n, k:] == -1).all()
            scale = float(np.abs(r.out[b, :n]).max())
            np.testing.assert_allclose(out["attn_out"][b, :n], r.out[b, :n], rtol=0, atol=1e-5 * scale,
                                       err_msg=f"attention output of sequence {b}")
        L = out["attn_mass"].shape[1]
        np.testing.assert_allclose(out["attn_mass"], r.mass[:, :L], rtol=0, atol=2e-5 * max(new) * nH)
        for row, p0, n in zip(rows, past, new):
            self.check_row_cache(row, p0 + n)
        q_shared = f(B, S, nH * D)  # drawn either way: cases called with and without selections stay in step
        if not selections:
            return out
        # the sharing layer, after its source: the source's selection, the pool as the source left it
        xs = {"q": q_shared, "kv_pool": self.pool, "kv_slots": slots, "quant": self.quant,
              "row_cache": self.shared_cache, "row_cache_tags": self.shared_tags, "kv_proj_weight": self.proj_w,
              "kv_proj_bias": self.proj_b, "rope_cos": self.cos, "rope_sin": self.sin, "selected": out["selected"],
              "cache_rows": x["cache_rows"], "past_lengths": x["past_lengths"], "new_lengths": x["new_lengths"]}
        shared = self.run(self.shared_session, xs, SHARED_OUTPUTS)
        rs = ref.sparse_attention(self.shared_d, xs["q"], self.ref_pool, slots, x["past_lengths"], x["new_lengths"],
                                  self.quant, self.cos, self.sin, self.proj_w, self.proj_b, selected=r.selected,
                                  cache_rows=rrows)
        for b, n in enumerate(new):
            scale = float(np.abs(rs.out[b, :n]).max())
            np.testing.assert_allclose(shared["attn_out"][b, :n], rs.out[b, :n], rtol=0, atol=1e-5 * scale,
                                       err_msg=f"sharing layer's output of sequence {b}")
            assert not shared["attn_out"][b, n:].any(), "padding rows are zero"
        out["shared_misses"] = shared["row_cache_misses"]
        return out

    def check_row_cache(self, row: int, length: int) -> None:
        """What the row cache of `row` holds after a call: each position once, and every row whose entry is still
        the slot table's is RoPE(U_k c_k) of the latent the reference reads from the pool now."""
        nH, nKV, D, nI, dI, rk, rv = self.geo
        pos, ent = self.tags[row, 0], self.tags[row, 1]
        valid = pos >= 0
        assert len(set(pos[valid].tolist())) == int(valid.sum()), f"row cache of row {row} holds a position twice"
        assert (pos[valid] < length).all()
        entries = self.tables[row].entries
        ck, _ = ref.read_latents(self.d, self.pool[row:row + 1], entries[None], self.quant)
        for c in np.nonzero(valid)[0]:
            p = int(pos[c])
            if ent[c] != entries[p]:
                continue  # made from a row re-encoded since: the next read makes it again
            k = (self.k_up @ ck[0, p]).reshape(nKV, D)
            h = D // 2
            rot = np.concatenate([-k[:, h:], k[:, :h]], axis=1)
            want = (k * self.cos[p] + rot * self.sin[p]).reshape(-1)
            np.testing.assert_allclose(self.row_cache[row, c], want, rtol=0, atol=1e-5 * float(np.abs(want).max()),
                                       err_msg=f"row cache of row {row}, slot {c} (position {p})")

    def demote(self, row: int, length: int) -> int:
        """A re-tier pass of sequence `row`: positions past the sinks re-encoded to random lower tiers (moves
        included), on both copies; returns how many positions changed."""
        new_tier = np.full(N_MAX, -1, np.int32)
        cand = np.arange(SINKS, length - 2)
        pick = self.rng.choice(cand, size=len(cand) * 2 // 3, replace=False)
        new_tier[pick] = self.rng.integers(1, 4, pick.size)
        old = ref.slot_tier(self.tables[row].entries)
        new_tier[pick] = np.maximum(new_tier[pick], old[pick])
        moves = self.tables[row].demote(new_tier)
        entries = np.array([(row, a, b) for a, b in moves], np.int32).reshape(-1, 3)
        ref.kv_demote(self.d, entries, self.pool, self.quant)
        ref.kv_demote(self.d, entries, self.ref_pool, self.quant)
        return len(moves)


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("key_bits", [16, 8])
def test_decode_after_prefill_and_retier_matches_the_reference(geo: str, key_bits: int) -> None:
    c = Case(GEOMETRIES[geo], key_bits, capacity=64)
    c.call([1], [0], [40], 40)  # a prefill: every cached row is new, nothing read from the pool
    for t in range(40, 46):
        out = c.call([1], [t], [1], 1)
    assert out["row_cache_misses"][0] <= 2, "steady decode: the rows it read last step are in the row cache"
    assert out["shared_misses"][0] <= 2, "the sharing layer's own row cache, likewise"
    assert c.demote(1, 46) > 10
    out = c.call([1], [46], [1], 1)
    assert out["row_cache_misses"][0] > 0, "re-encoded rows are made again from the pool"
    c.call([1], [47], [5], 5)  # a prefill chunk over a re-tiered cache
    for t in range(52, 60):
        c.call([1], [t], [1], 1)


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_a_long_chunk_over_a_retiered_cache_matches_the_reference(geo: str) -> None:
    """A chunk of more queries than the latent-sum form takes (16): V rows rebuilt once per distinct position, the
    cached ones dequantised from their INT8 / INT4 pool rows as they are made (no copy of every latent at once)."""
    c = Case(GEOMETRIES[geo], 8, capacity=64, seed=3)
    c.call([1], [0], [40], 40)
    assert c.demote(1, 40) > 10
    c.call([1], [40], [24], 24)
    for t in range(64, 68):
        c.call([1], [t], [1], 1)


def test_batch_of_sequences_with_padding_and_a_small_row_cache() -> None:
    c = Case(GEOMETRIES["gqa3"], 8, capacity=6, seed=1, threads=2)
    c.call([2, 0], [0, 0], [30, 22], 30)
    c.call([0, 2], [22, 30], [4, 4], 4)
    c.demote(2, 34)
    for t in range(6):
        out = c.call([2, 0], [34 + t, 26 + t], [1, 1], 1)
        assert (out["row_cache_misses"] > 0).all(), "6 slots cannot hold a selection of ~15 rows"
    c.call([0], [32], [1], 1)


def test_a_prefill_of_more_queries_than_one_block_matches_the_reference() -> None:
    """Two sequences of 45 and 38 new tokens in one call: 90 queries (padding rows included), more than the op holds
    attention weights for at once (32), so blocks start inside each sequence."""
    c = Case(GEOMETRIES["gqa3"], 8, capacity=64, seed=5, threads=2)
    c.call([2, 0], [0, 0], [45, 38], 45)
    c.call([0, 2], [38, 45], [1, 1], 1)


def test_rollback_rewrites_positions_without_reading_stale_rows() -> None:
    """A speculative step's rejected positions are written again: the row cache must not serve their old rows."""
    c = Case(GEOMETRIES["odd"], 16, capacity=64, seed=2)
    c.call([0], [0], [30], 30)
    for t in range(30, 36):
        c.call([0], [t], [1], 1)
    # back to 31 positions (the runtime's rollback): positions 31.. get new latents in the same FP16 rows
    c.tables[0].truncate(31)
    for t in range(31, 40):
        out = c.call([0], [t], [1], 1)
    assert out["row_cache_misses"][0] <= 2


def test_refuses_a_new_position_without_an_fp16_row() -> None:
    c = Case(GEOMETRIES["odd"], 16, capacity=8)
    c.call([0], [0], [12], 12)
    before = c.pool.copy()
    with pytest.raises(Exception, match=r"GsmPoolAttention: kv_slots\[0, 12\] = .* is not an FP16 row"):
        c.call([0], [12], [1], 1, entry=(12, ref.make_slot(ref.INT8, TIERS[0] + TIERS[1])))  # a new row in INT8
    np.testing.assert_array_equal(c.pool, before, err_msg="a refused call writes nothing")
    with pytest.raises(Exception, match=r"GsmPoolAttention: kv_slots\[0, 3\] = -1 is not a row of the pool"):
        c.call([0], [13], [1], 1, top_k=20, entry=(3, -1))  # a cached position the selection reads has no row


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_a_row_made_from_the_pool_is_the_row_the_call_made(geo: str) -> None:
    """A K row made again from the pool (a row-cache miss: several rows through one multi-vector kernel) is the row
    the call that wrote its position made from the new latent (one vector at a time), bit for bit, when the pool holds
    that latent exactly (FP16 values, FP16 rows): which rows the cache kept must not change any value."""
    c = Case(GEOMETRIES[geo], 16, capacity=64, seed=3)
    c.call([0], [0], [40], 40)
    made = {int(p): c.row_cache[0, s].copy() for s, p in enumerate(c.tags[0, 0]) if p >= 0}
    assert len(made) > 30
    c.tags[0] = -1  # forget every row: the next call makes the rows it selects from the pool
    out = c.call([0], [40], [1], 1, top_k=30)
    assert out["row_cache_misses"][0] > 20
    again = {int(p): c.row_cache[0, s] for s, p in enumerate(c.tags[0, 0]) if 0 <= p < 40}
    assert len(again) > 20
    for p, row in again.items():
        np.testing.assert_array_equal(row.view(np.int32), made[p].view(np.int32), err_msg=f"position {p}")


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_float16_u_gives_the_float32_u_outputs_bit_for_bit(geo: str) -> None:
    """U on the FP16 grid given as float16 (as SmolLM2's bundles give it) and as float32: the same outputs and rows,
    bit for bit, through rows made from the pool in blocks (the float16 U_k widened a block of rows at a time by the
    thread making them: gqa3's 192 rows in blocks of 32, odd's head by head), two threads."""
    cases = [Case(GEOMETRIES[geo], 8, capacity=64, seed=6, threads=2, half_up=h) for h in (True, False)]
    cases[1].k_up, cases[1].v_up = cases[0].k_up, cases[0].v_up  # the same values, given as float32
    plan = [([1], [0], [40], 40), "demote", ([1], [40], [1], 1), ([1], [41], [6], 6), ([1], [47], [1], 1)]
    made = 0
    for step in plan:
        if step == "demote":
            for c in cases:
                c.tags[1] = -1  # every row made again from the pool
            assert cases[0].demote(1, 40) == cases[1].demote(1, 40) > 10
            continue
        half, full = (c.call(*step) for c in cases)
        assert half["row_cache_misses"][0] == full["row_cache_misses"][0]
        made += int(full["row_cache_misses"][0])
        for name in ("attn_out", "attn_mass"):
            np.testing.assert_array_equal(half[name].view(np.int32), full[name].view(np.int32), err_msg=name)
        np.testing.assert_array_equal(cases[0].row_cache.view(np.int32), cases[1].row_cache.view(np.int32))
    assert made > 10, "rows made from the pool"


def test_a_call_without_selections_computes_the_same_and_returns_none() -> None:
    """selections = 0 (a call that wants no probes): `selected` comes back [B, S, 0] and everything else, outputs,
    pools, keys and row caches, is the selecting call's bit for bit; a value other than 0 or 1 is refused."""
    cases = [Case(GEOMETRIES["gqa3"], 8, capacity=64, seed=7, threads=2) for _ in range(2)]
    for step in [([1], [0], [40], 40), "demote", ([1], [40], [1], 1), ([1], [41], [20], 20), ([1], [61], [1], 1)]:
        if step == "demote":
            assert cases[0].demote(1, 40) == cases[1].demote(1, 40) > 10
            continue
        kept, none = cases[0].call(*step), cases[1].call(*step, selections=0)
        S = step[3]
        assert kept["selected"].shape[:2] == (1, S) and kept["selected"].shape[2] > 0
        assert none["selected"].shape == (1, S, 0)
        for name in ("attn_out", "attn_mass", "row_cache_misses"):
            np.testing.assert_array_equal(kept[name], none[name], err_msg=name)
        for name in ("pool", "keys", "row_cache", "tags"):
            np.testing.assert_array_equal(getattr(cases[0], name), getattr(cases[1], name), err_msg=name)
    with pytest.raises(Exception, match=r"selections = 2 is neither 1 \(return the selection\) nor 0"):
        cases[1].call([1], [62], [1], 1, selections=2)


def test_rows_made_from_int8_and_int4_rows_use_the_references_latents_bit_for_bit() -> None:
    """A K row the op makes from an INT8 or INT4 row of the pool is U_k times the latent the plugins' reference
    dequantises (one rounded product, one rounded sum per value: no fused multiply-add), bit for bit: the row equals
    the one the op makes from that same float32 latent given as a call's new latent, at the same position."""
    c = Case(GEOMETRIES["gqa3"], 16, capacity=64, seed=4)
    nH, nKV, D, nI, dI, rk, rv = c.geo
    c.call([0], [0], [40], 40)
    assert c.demote(0, 40) > 10
    entries = c.tables[0].entries
    tiers = ref.slot_tier(entries[:40])
    low = [p for p in range(SINKS, 40) if tiers[p] in (ref.INT8, ref.INT4)]
    assert {int(tiers[p]) for p in low} == {ref.INT8, ref.INT4}
    ck, cv = ref.read_latents(c.d, c.pool[0:1], entries[None], c.quant)
    # sequence 2: a prefill whose new latents are those dequantised values (float32, not FP16 values)
    c.tables[2].allocate(range(40))
    f = lambda *s: c.rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = {"q": f(1, 40, nH * D), "index_q": f(1, 40, nI * dI), "index_w": f(1, 40, nI),
         "new_latent_k": ck[:, :40].copy(), "new_latent_v": cv[:, :40].copy(),
         "new_index_keys": f(1, 40, dI).astype(np.float16), "kv_pool": c.pool, "index_keys": c.keys,
         "kv_slots": c.tables[2].entries[None].astype(np.int32), "quant": c.quant, "row_cache": c.row_cache,
         "row_cache_tags": c.tags, "k_up": c.k_up, "v_up": c.v_up, "rope_cos": c.cos, "rope_sin": c.sin,
         "cache_rows": np.array([2], np.int32), "past_lengths": np.array([0], np.int32),
         "new_lengths": np.array([40], np.int32), "sparse_window": np.array([WINDOW], np.int32),
         "sparse_top_k": np.array([N_MAX], np.int32), "logit_rows": np.zeros((1, 1), np.int32),
         "selections": np.array([1], np.int32)}
    c.run(c.session, x, OUTPUTS)
    c.ref_pool[2], c.ref_keys[2] = c.pool[2], c.keys[2]  # (the reference's copy: only row 0 is compared below)
    fresh = {int(p): c.row_cache[2, s].copy() for s, p in enumerate(c.tags[2, 0]) if p >= 0}
    # sequence 0: every row forgotten, then a step that selects them all makes them from the pool
    c.tags[0] = -1
    out = c.call([0], [40], [1], 1, top_k=N_MAX)
    assert out["row_cache_misses"][0] >= 40
    made = {int(p): c.row_cache[0, s] for s, p in enumerate(c.tags[0, 0]) if 0 <= p < 40}
    for p in low:
        np.testing.assert_array_equal(made[p].view(np.int32), fresh[p].view(np.int32),
                                      err_msg=f"position {p} (tier {int(tiers[p])})")
