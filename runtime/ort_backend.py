"""ONNX Runtime backend: runs model.cpu.onnx (or model.portable.onnx) on the CPU (or any ORT execution provider)
over cache buffers allocated once and bound once (docs/engine_io.md 5, 5.1).

Which network (`SessionTuning.graph`): `model.cpu.onnx` has each layer's attention as one custom op over the plugins'
pools (`GsmPoolAttention` / `GsmPoolSharedAttention`, libgsm_ort_ops.so from plugins/ortCpu, registered with the
session); where that library is not built, `model.portable.onnx` (standard ops only) runs.

model.cpu.onnx's cache is the TensorRT graph's (runtime/ort_pools.py): per owning layer the latent pool
`kv_pool.{l}` and indexer keys `index_keys.{l}`, per layer a row cache of K rows, and each sequence's slot table
(`kv_slots`, sent with every call); the nodes write the call's rows into them in place, and a re-tier pass re-encodes
rows through the plugins' C++ reference. The portable graph's cache is float32 latents `latent_k/v.{l}` [R, N_max, r],
the indexer keys and every layer's K rows `k_rows.{l}` [R, N_max, kvD] by position; it returns the call's new rows,
which the backend writes into the buffers (a decode call's by one memmove each), and its demotion graph
(gsm_demote.portable.onnx) re-encodes rows. Either way the buffers are numpy arrays wrapped as OrtValues (same
memory) bound to the session's I/O binding at creation; a call binds only the small per-call inputs, so a step
neither copies nor transfers anything that grows with N_max, and `np.zeros` takes zeroed pages from the OS lazily:
resident memory grows with the rows written (the portable buffers' pages are faulted in ahead of their writes, a span
of positions at a time: runtime/page_reserve.py).

The custom ops' weights (the quantised projections' tiles, the U matrices) are read once into an array of the
backend's own and handed to the session in place of ONNX Runtime's 4 KB file mappings (`cpu_weights`,
model.cpu.weights.json): large pages where the kernel offers them, fewer TLB misses a step.

The buffers have the memory plan's max_batch rows (bundle.json), allocated once: a sequence past them gets a
CacheFullError, never a larger buffer (the engine admits no more sequences than `capabilities.max_resident`).
One lock serialises calls on a backend: batch sequences (Runtime.decode_batch) to use the cores
together rather than running requests on threads.

The per-layer probe outputs `selected.{l}` / `attn_mass.{l}` are bound only when a call asks
for them (`probes=True`, or every call of a bundle built with debug outputs): an unbound output is an
intermediate tensor ONNX Runtime frees, never copied to the caller.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gsm import graph_io as io
from gsm.bundle_format import (
    FILES,
    REBUILD,
    VERIFY_ROWS,
    BundleConfig,
    BundleError,
    CpuWeightTable,
)
from runtime.backend import (
    Capabilities,
    PositionRows,
    RowPool,
    StepOutput,
    kv_noise_sums,
    relative_noise,
    step_feeds,
)
from runtime.host_memory import bound_heap, cache_zeros, trim_heap
from runtime.ort_pools import OrtPools
from runtime.page_reserve import PageReserve
from runtime.plugin_cache import PrefixRows, put_prefix, take_prefix
from runtime.slots import SlotTable

log = logging.getLogger("runtime.ort_backend")

GRAPHS = ("auto", "cpu", "portable")

_memmove = ctypes.memmove
_WEIGHT_ALIGN = 64  # each span of read_weight_spans starts on a cache line


def read_weight_spans(path: Path, table: CpuWeightTable) -> dict[str, np.ndarray]:
    """The table's tensors read from `path` into one array (views by name, each with its dtype and shape)."""
    starts, total = [], 0
    for w in table.spans:
        starts.append(total)
        total += -(-w.length // _WEIGHT_ALIGN) * _WEIGHT_ALIGN
    buf = np.empty(total + _WEIGHT_ALIGN, np.uint8)
    base = -buf.ctypes.data % _WEIGHT_ALIGN
    out = {}
    with path.open("rb") as f:
        for w, start in zip(table.spans, starts):
            view = buf[base + start:base + start + w.length]
            f.seek(w.offset)
            if f.readinto(memoryview(view)) != w.length:
                raise BundleError(f"{path}: {w.name} at {w.offset} + {w.length} bytes lies past the file's end; "
                                  f"rebuild the bundle with `{REBUILD}`")
            out[w.name] = view.view(w.dtype).reshape(w.shape)
    return out


@dataclass(frozen=True)
class _RowCopy:
    """Where a decode call's new rows ([B, 1, w], bound once) go in a cache buffer [R, N_max, w]: addresses and
    strides in bytes, both arrays kept alive by the backend that binds them."""

    dst: int
    dst_row: int
    dst_pos: int
    src: int
    src_seq: int
    nbytes: int

    @classmethod
    def of(cls, buf: np.ndarray, rows: np.ndarray) -> _RowCopy:
        if not (buf.flags.c_contiguous and rows.flags.c_contiguous and buf.dtype == rows.dtype
                and buf.shape[2:] == rows.shape[2:]):
            raise ValueError(f"new rows {rows.dtype}{list(rows.shape)} do not fit the cache buffer "
                             f"{buf.dtype}{list(buf.shape)}")
        return cls(buf.ctypes.data, buf.strides[0], buf.strides[1], rows.ctypes.data, rows.strides[0],
                   rows[0, 0].nbytes)


# model.cpu.onnx's `selections` input: whether a call returns the owning layers' selections (the probes') or keeps
# them in the nodes' scratch
_SELECTIONS = {False: np.zeros(1, np.int32), True: np.ones(1, np.int32)}
# A prefill call's tokens x positions at most: its working memory (each query's index scores over every position, the
# selections of a probed call) follows this product. 2^20 keeps max-input 512 up to ~1.5K positions and gives 128-token
# calls near 8K, where a smaller bound saved little memory and cost prefill speed (docs/decisions.md "CPU process
# memory").
CALL_POSITIONS = 1 << 20
# A verification's extra rows cost the CPU graph compute, not weight reads (the projections' INT8 dot products and each
# query's attention grow with the rows): `python bench/verify_cost.py --bundle B --batch-bundle B8` on SmolLM2 INT4, 2
# threads, gave 0.14 / 0.19 / 0.22 of a one-token step a row at n = 2 / 4 / 8 tokens a call after 256 positions, 0.20 /
# 0.23 / 0.26 after 1K, 0.25 / 0.28 / 0.32 after 4K (0.25: the middle of that range); with 8 sequences of 256, 0.55-0.57
# of their batched step (0.62-0.68 in an earlier run; the dearer figure kept: drafting in a batch of 8 showed no gain
# over the prefix cache alone, docs/runtime.md)
VERIFY_ROW_COST, VERIFY_ROW_COST_BATCH = 0.25, 0.65


@dataclass(frozen=True)
class SessionTuning:
    """How the ONNX Runtime sessions are set up (the reasons are in docs/runtime.md, "Speed")."""

    threads: int = 0  # intra-op threads; 0 = ONNX Runtime's default (one per physical core)
    spinning: bool = True  # intra-op workers spin between ops (ONNX Runtime's and both anchors' default)
    # and on after a run until the next (ONNX Runtime's default); off where two models' runs alternate on the same
    # cores (a draft bundle and its target: runtime.draft_model), each one's spinning would slow the other's run
    spin_between_runs: bool = True
    optimization: str = "all"  # "all" | "extended" | "basic" | "none"
    arena: bool = False  # CPU memory arena: ONNX Runtime keeps its peak of freed blocks (docs/runtime.md)
    graph: str = "auto"  # "cpu" (fused attention op), "portable" (standard ops) or "auto" (cpu where usable)


def cpu_graph_usable(bundle: Path) -> tuple[bool, str]:
    """(True, library path) when `bundle` has model.cpu.onnx and libgsm_ort_ops.so is built, else (False, why)."""
    if not (bundle / FILES.model_cpu).is_file():
        return False, f"{bundle} has no {FILES.model_cpu} (built before it existed: rebuild with `{REBUILD}`)"
    try:
        from gsm_edge_plugins import ort_ops_library
    except ImportError as e:
        return False, f"gsm_edge_plugins is not importable ({e})"
    lib = ort_ops_library()
    if lib is None:
        return False, ("libgsm_ort_ops.so was not built (it needs ONNX Runtime's C API headers: run "
                       "scripts/fetch_ort_headers.sh, then reinstall with `pip install .`)")
    return True, str(lib)


def resolve_graph(bundle: Path, graph: str, providers: list[str]) -> tuple[str, str | None]:
    """The network a session opens: ("cpu", library path) or ("portable", None). `auto` takes the fused graph
    where it is usable and the session runs on the CPU provider alone; `cpu` insists (RuntimeError why not)."""
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
    if graph == "portable":
        return "portable", None
    ok, detail = cpu_graph_usable(bundle)
    if graph == "cpu" and not ok:
        raise RuntimeError(f"graph cpu: {detail}")
    if ok and (graph == "cpu" or providers == ["CPUExecutionProvider"]):
        return "cpu", detail
    return "portable", None


def session_options(t: SessionTuning) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                   "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                   "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                   "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[t.optimization]
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # one chain of layers: nothing to overlap
    so.intra_op_num_threads = t.threads
    so.inter_op_num_threads = 1
    so.enable_cpu_mem_arena = t.arena
    so.enable_mem_pattern = False  # shapes change every step (the context grows): no plan to reuse
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if t.spinning else "0")
    so.add_session_config_entry("session.force_spinning_stop", "0" if t.spin_between_runs else "1")
    so.log_severity_level = 3  # unused-initializer notes are not the user's business
    return so


@dataclass
class OrtCache:
    """One sequence's place in the backend's buffers (its row, and on model.cpu.onnx its slot table of the pools);
    see OrtBackend.new_cache."""

    backend: OrtBackend
    row: int
    slots: SlotTable | None = None
    released: bool = False

    def latents(self, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n positions of this sequence's dequantised latents (tests, debugging)."""
        b = self.backend
        if b.pools is not None:
            return b.pools.latents(self, layer, n)  # type: ignore[arg-type]
        return b.buffers[io.LATENT_K.at(layer)][self.row, :n], b.buffers[io.LATENT_V.at(layer)][self.row, :n]

    def release(self) -> None:
        self.backend.release(self)


class OrtBackend:
    name = "onnxruntime"

    def __init__(self, bundle: Path, cfg: BundleConfig, *, threads: int = 0,
                 providers: list[str] | None = None, tuning: SessionTuning | None = None) -> None:
        import onnxruntime as ort

        self.ort = ort
        bound_heap()  # a prefill's freed working memory goes back to the system (runtime/host_memory.py)
        self.tuning = tuning or SessionTuning(threads=threads)
        so = session_options(self.tuning)
        prov = providers or ["CPUExecutionProvider"]
        self.bundle, self.providers = bundle, prov
        self._cpu_weights: dict[str, Any] | None = None  # cpu_weights(), read on the first cpu session
        self._weight_arrays: dict[str, np.ndarray] = {}
        self.graph, self.ops_library = resolve_graph(bundle, self.tuning.graph, prov)
        self.graph_note = ""  # why `auto` fell back to the portable graph, if it did
        self.session = self._main_session(so)
        # the demotion graph runs once per re-tier pass (a prefill's end, every few decode steps): its workers never
        # spin, since a pool spinning after it would take the cores from the next steps of the main session (SmolLM2,
        # 2 threads: the 5-8 decode steps after each prefill ran 9-17 ms instead of 5).
        # The portable graph's demotion graph (model.cpu.onnx's pools are re-encoded by the plugins' reference)
        self.demote_session = None if self.graph == "cpu" else ort.InferenceSession(
            str(bundle / FILES.demote_portable), session_options(dataclasses.replace(self.tuning, spinning=False)),
            providers=prov)
        self.cfg = cfg
        self.n_max = cfg.n_max
        self.layers = list(cfg.owning_layers)
        self.out_names = [o.name for o in self.session.get_outputs()]
        self.debug = cfg.debug_outputs  # fetch selected.{l} on every call (tests, debugging)
        self.probe_names = {n for l in self.layers for n in (io.SELECTED.at(l), io.LAYER_MASS.at(l))}
        self.demote_out = [] if self.demote_session is None else [o.name for o in self.demote_session.get_outputs()]
        # the portable graph caches every layer's K rows beside the latents (engine_io 5), and its demotion graph
        # takes the rows' positions to remake them
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        # model.cpu.onnx reads and writes the plugins' pools in place (runtime/ort_pools.py); the portable graph
        # reads float32 latents and K rows and returns the call's new rows
        self.pools = OrtPools(cfg, inputs, self._quant_tables(), self.name) if self.graph == "cpu" else None
        self.k_rows = self._k_row_widths(inputs) if self.pools is None else {}
        shapes = self._shapes()
        self.cached = list(shapes)  # the buffers a call writes new rows into (graph outputs `new_<name>`)
        self.lock = threading.RLock()  # re-entrant: a sequence collected (and its row freed) inside a call
        self.binding = self.session.io_binding()
        self._fixed = self._fixed_outputs(shapes)
        self._decodable = set(self._fixed) | {io.ATTN_MASS.name}  # a call that wants no more runs through _run_decode
        self._decode_key: tuple | None = None  # (B, outputs) the decode path's arrays are bound for
        self._want: dict[tuple[bool, bool], list[str]] = {}
        self._decode_arrays: dict[str, np.ndarray] = {}
        self._decode_copies: list[_RowCopy] = []  # where each new row goes
        # a short call on model.cpu.onnx (a verification, a short prompt): its logits land in one buffer kept for
        # every such call (max_batch x VERIFY_ROWS rows, resident as far as used), not in new pages each call
        self._verifiable = {io.LOGITS.name, io.ATTN_MASS.name, io.QUERY_MASS.name}
        self._logit_buf: np.ndarray | None = None
        # the rows of the memory plan: on model.cpu.onnx the plugin backends' rows and slot tables (PluginRows)
        self.plugin_rows = self.pools.rows if self.pools is not None else None
        self.pool = self.plugin_rows.pool if self.plugin_rows is not None else RowPool(cfg.max_batch, self.name)
        self.buffers: dict[str, np.ndarray] = {}
        self._allocate(cfg.max_batch)
        self.capabilities = self._capabilities()

    def _main_session(self, so: Any) -> Any:
        """The session of the chosen network; where `auto` chose model.cpu.onnx and it does not load (an ONNX Runtime
        older than the op's C API 17, a library of another build...), the portable graph's, with the reason kept in
        graph_note."""
        try:
            return self.open_session(so)
        except Exception as e:
            if self.graph != "cpu":
                raise
            detail = " ".join(str(e).split())
            if self.tuning.graph == "cpu":
                raise RuntimeError(f"graph cpu: {self.bundle / FILES.model_cpu} does not load with "
                                   f"{self.ops_library}: {detail}") from None
            self.graph, self.ops_library = "portable", None
            self._cpu_weights, self._weight_arrays = None, {}  # the portable graph maps its own
            self.graph_note = f"{FILES.model_cpu} did not load ({detail})"
            log.warning("%s: running %s instead", self.graph_note, FILES.model_portable)
            return self.open_session(session_options(self.tuning))

    def _fixed_outputs(self, shapes: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """A decode call's (S = 1) outputs of fixed shape (one row's shape, dtype), bound once per batch size and set
        of outputs to arrays kept by the backend: a step then rebinds only what changes shape (attn_mass grows with
        the context)."""
        widths = {f"new_{n}": (shape[1:], dt) for n, (shape, dt) in shapes.items()}
        logits = next(o for o in self.session.get_outputs() if o.name == io.LOGITS.name)
        widths[io.LOGITS.name] = ((int(logits.shape[-1]),), np.float32)
        return widths

    def _capabilities(self) -> Capabilities:
        """forward(commit=False) leaves the buffers as they were: the dense shadow call of a probe is possible;
        demote() measures the noise on the latents it re-encodes."""
        cfg = self.cfg
        per_sequence = (self.pools.bytes().per_sequence if self.pools is not None
                        else self.cache_bytes_per_position() * self.n_max)
        return Capabilities(
            max_resident=cfg.max_batch, max_per_call=cfg.max_batch, positions=self.n_max,
            kv_bytes_per_sequence=per_sequence,
            hit_rate_probes=True, kv_noise=True, graph=self.graph,
            graph_note=self.graph_note, call_positions=CALL_POSITIONS,
            verify_rows=min(VERIFY_ROWS, cfg.max_input),
            verify_row_cost=VERIFY_ROW_COST, verify_row_cost_batch=VERIFY_ROW_COST_BATCH, prefix_reuse=True)

    def open_session(self, so: Any) -> Any:
        """A session of the network this backend runs, with options `so` (the custom-op library registered
        into them for model.cpu.onnx): the backend's own, or a profiling one (bench/decode_speed.py)."""
        if self.ops_library is not None:
            so.register_custom_ops_library(self.ops_library)
        if self.graph == "cpu":
            for name, value in self.cpu_weights().items():
                so.add_initializer(name, value)
        model = FILES.model_cpu if self.graph == "cpu" else FILES.model_portable
        return self.ort.InferenceSession(str(self.bundle / model), so, providers=self.providers)

    def cpu_weights(self) -> dict[str, Any]:
        """model.cpu.onnx's custom-op weights read once into memory of the backend's own (gsm.bundle_format
        CpuWeightTable), which the sessions use in place of ONNX Runtime's 4 KB file mappings: numpy backs a large
        array with transparent huge pages where the kernel offers them, and a decode step streams ~100 MB of these
        weights, one TLB miss a page otherwise (SmolLM2 INT4 at 256 tokens, 1 thread: 7.0-7.7 -> 6.1-7.3 ms a
        step, 3 alternating runs). A bundle without the table keeps the file mappings."""
        if self._cpu_weights is None:
            path = self.bundle / FILES.cpu_weights
            arrays = read_weight_spans(
                self.bundle / FILES.weights, CpuWeightTable.from_json(json.loads(path.read_text()), str(path))
            ) if path.is_file() else {}
            # OrtValues over the arrays (no copy), kept here: a session holds only their addresses
            self._cpu_weights = {name: self.ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()}
            self._weight_arrays = arrays
        return self._cpu_weights

    def _quant_tables(self) -> dict[str, np.ndarray]:
        """The owning layers' quantisation tables as model.cpu.onnx's nodes read them (model.cpu.weights.json), for the
        demotions the backend runs itself: the arrays `cpu_weights` holds, or read from weights.bin where the session
        maps the file instead."""
        held = {name: a for name, a in self._weight_arrays.items() if name.endswith(".quant")}
        if held:
            return held
        path = self.bundle / FILES.cpu_weights
        if not path.is_file():
            raise BundleError(f"{self.bundle} has no {FILES.cpu_weights}: rebuild the bundle with `{REBUILD}`")
        table = CpuWeightTable.from_json(json.loads(path.read_text()), str(path))
        quant = dataclasses.replace(table, spans=tuple(w for w in table.spans if w.name.endswith(".quant")))
        return read_weight_spans(self.bundle / FILES.weights, quant)

    def _k_row_widths(self, inputs: dict[str, list[Any]]) -> dict[int, int]:
        """layer -> kvD of the `k_rows.{i}` buffers, as the graph declares them (`inputs`: name -> shape; bundle.json
        has no kvD)."""
        layer, widths = 0, {}
        while io.K_ROWS.at(layer) in inputs:
            widths[layer] = int(inputs[io.K_ROWS.at(layer)][-1])
            layer += 1
        if not widths:
            raise BundleError(f"{self.bundle}: bundle.json states engine_io revision {self.cfg.graph_revision}, but "
                              f"the graph has no k_rows inputs; rebuild the bundle with `{REBUILD}`")
        return widths

    # -- cache rows --------------------------------------------------------------------------------
    def _shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The portable graph's cache buffers by name: (shape of one row, dtype); none on model.cpu.onnx."""
        dI, shapes = self.cfg.index_dim, {}
        if self.pools is not None:
            return shapes
        for l in self.layers:
            rk, rv = self.cfg.ranks[l]
            shapes[io.LATENT_K.at(l)] = ((self.n_max, rk), np.float32)
            shapes[io.LATENT_V.at(l)] = ((self.n_max, rv), np.float32)
            # FP16 keys, or INT8 codes (kv_quantization.index_key_bits 8)
            shapes[io.INDEX_KEYS.at(l)] = ((self.n_max, dI), np.int8 if self.cfg.index_keys.bits == 8 else np.float16)
        for l, kvd in self.k_rows.items():
            shapes[io.K_ROWS.at(l)] = ((self.n_max, kvd), np.float32)
        return shapes

    def cache_bytes_per_position(self) -> int:
        """Bytes this backend holds per cached position of one sequence (all layers; on model.cpu.onnx the pools and
        keys, beside which each sequence holds a row cache of constant size)."""
        if self.pools is not None:
            return self.pools.bytes().per_position
        return sum(int(np.prod(shape)) // self.n_max * np.dtype(dt).itemsize for shape, dt in self._shapes().values())

    def _allocate(self, rows: int) -> None:
        """Buffers of `rows` sequences, bound once to the session (zeroed pages: resident as they are written)."""
        if self.pools is not None:
            self.buffers = self.pools.buffers
        else:
            self.buffers = {name: cache_zeros((rows, *shape), dtype) for name, (shape, dtype) in self._shapes().items()}
        for name, buf in self.buffers.items():
            # an OrtValue over the numpy memory (CPU: no copy); the graph reads it in place
            self.binding.bind_ortvalue_input(name, self.ort.OrtValue.ortvalue_from_numpy(buf))
        # the portable buffers' pages are faulted in ahead of their writes; a pool row fills a row at a time
        self.pages = PageReserve([] if self.pools is not None else list(self.buffers.values()), rows, self.n_max)

    def new_cache(self) -> OrtCache:
        with self.lock:
            if self.pools is not None:
                c = self.pools.new_cache()
                return OrtCache(self, c.row, c.slots)
            return OrtCache(self, self.pool.take())

    def release(self, cache: OrtCache) -> None:
        with self.lock:
            if not cache.released:
                cache.released = True
                self.pool.give(cache.row)

    def close(self) -> None:
        """Nothing outside Python's memory: the buffers go with the backend."""

    # -- calls -------------------------------------------------------------------------------------
    def forward(self, caches: list[OrtCache], ids: np.ndarray, past: np.ndarray, new: np.ndarray,
                sparse_window: int, top_k: np.ndarray, *, probes: bool = False, commit: bool = True,
                rows: np.ndarray | None = None) -> StepOutput:
        """One call over ids [B, S]: sequence b adds new[b] tokens at positions past[b].. to the row of
        caches[b], selecting with budget top_k[b] (int [B]). Writes the new rows into the buffers unless
        `commit` is False (a shadow step: the buffers are left as they were); returns logits and attention
        mass, and with `probes` each owning layer's selection and attention mass. rows [B, J]: the rows whose logits
        come back and whose queries' own attention mass (query_mass) comes back with them (None: the last new row
        of each sequence, and no query_mass)."""
        B, S = ids.shape
        past, new = past.astype(np.int32), new.astype(np.int32)
        if int(past.max()) + S > self.n_max:
            raise ValueError(f"positions up to {int(past.max()) + S} exceed max-seq {self.n_max}")
        small = step_feeds(ids, past, new, sparse_window, top_k, np.array([c.row for c in caches], np.int32), rows)
        want = self._wanted(probes, rows is not None)
        with self.lock:
            plan = None
            if self.pools is not None:  # rows for the new positions, and the slot tables the nodes read
                plan = self.pools.plan(caches, past, new)  # type: ignore[arg-type]
                small[io.KV_SLOTS.name] = plan.kv_slots
                small[io.SELECTIONS.name] = _SELECTIONS[io.SELECTED.at(self.layers[0]) in want]
            if S == 1 and self._decodable.issuperset(want):
                outs = self._run_decode(B, int(past.max()) + 1, want, small)
                if commit:
                    for b, c in enumerate(caches):
                        if new[b]:
                            self.pages.reserve(c.row, int(past[b]) + 1)
                            self._commit_decode_rows(b, c.row, int(past[b]))
            elif self.pools is not None and S <= VERIFY_ROWS and self._verifiable.issuperset(want):
                J = S if self.cfg.logits == "all" else small[io.LOGIT_ROWS.name].shape[1]  # the rows logits come for
                outs = self._run_verify(B, J, int(past.max()) + S, want, small)
            else:
                # a prefill chunk or a probed call: ORT allocates the outputs (from its arena)
                for name, a in small.items():
                    self.binding.bind_cpu_input(name, a)
                self.binding.clear_binding_outputs()
                self._decode_key = None
                for name in want:
                    self.binding.bind_output(name)
                self.session.run_with_iobinding(self.binding)
                outs = dict(zip(want, self.binding.copy_outputs_to_cpu()))
                self.binding.clear_binding_outputs()  # ONNX Runtime's copies of the outputs go now
                if S > 1:  # a prefill call's working memory (a probed decode step's is small)
                    trim_heap()
                if commit:
                    for b, c in enumerate(caches):
                        self.pages.reserve(c.row, int(past[b]) + int(new[b]))
                    for name in self.cached:
                        buf, rows = self.buffers[name], outs["new_" + name]
                        for b, c in enumerate(caches):
                            p0, n = int(past[b]), int(new[b])
                            buf[c.row, p0:p0 + n] = rows[b, :n]
            if plan is not None and not commit:  # a shadow call: the tables as before, its rows free again
                self.pools.undo(caches, plan)  # type: ignore[union-attr, arg-type]
        sel = {l: outs[io.SELECTED.at(l)] for l in self.layers} if io.SELECTED.at(self.layers[0]) in outs else None
        mass = {l: outs[io.LAYER_MASS.at(l)] for l in self.layers} if probes else None
        return StepOutput(outs[io.LOGITS.name], outs[io.ATTN_MASS.name], sel, mass, outs.get(io.QUERY_MASS.name))

    def _wanted(self, probes: bool, query_mass: bool) -> list[str]:
        """The outputs a call binds: the probes only when asked for (or a debug bundle's selections), the queries'
        own masses only for the rows a caller named."""
        key = (probes, query_mass)
        if key not in self._want:
            self._want[key] = [n for n in self.out_names if (n not in self.probe_names or probes
                                                               or (self.debug and n.startswith(io.SELECTED.prefix)))
                               and (n != io.QUERY_MASS.name or query_mass)]
        return self._want[key]

    def _run_decode(self, B: int, L: int, want: list[str], small: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One S = 1 call without probes: the per-call inputs (`small`) are copied into arrays and the outputs of
        fixed shape (new rows, logits) land in arrays, all bound once for (B, want); attn_mass ([B, L], L = the
        longest past + 1) in a new array bound for this call; nothing else is bound or wrapped per step. Returns
        the outputs, logits as a copy (the caller keeps them)."""
        key = (B, tuple(want))
        if self._decode_key != key:
            self._decode_inputs = {name: a.copy() for name, a in small.items()}
            for name, a in self._decode_inputs.items():
                self.binding.bind_ortvalue_input(name, self.ort.OrtValue.ortvalue_from_numpy(a))
            self.binding.clear_binding_outputs()
            self._decode_arrays = {}
            for name in want:
                if name in self._fixed:
                    shape, dt = self._fixed[name]
                    a = np.empty((B, 1, *shape), dt)
                    self._decode_arrays[name] = a
                    self.binding.bind_ortvalue_output(name, self.ort.OrtValue.ortvalue_from_numpy(a))
            self._decode_copies = [_RowCopy.of(self.buffers[n], self._decode_arrays["new_" + n]) for n in self.cached]
            self._decode_key = key
        else:
            for name, a in small.items():
                self._decode_inputs[name][...] = a
        mass = np.empty((B, L), np.float32)
        self.binding.bind_ortvalue_output(io.ATTN_MASS.name, self.ort.OrtValue.ortvalue_from_numpy(mass))
        self.session.run_with_iobinding(self.binding)
        outs = dict(self._decode_arrays)
        outs[io.LOGITS.name] = self._decode_arrays[io.LOGITS.name].copy()
        outs[io.ATTN_MASS.name] = mass
        return outs

    def _run_verify(self, B: int, J: int, L: int, want: list[str],
                    small: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A call of up to VERIFY_ROWS tokens a sequence on model.cpu.onnx, without probes: inputs bound as they are,
        logits [B, J, V] into the kept buffer (returned as a copy), the masses into arrays of this call. J: the logit
        rows (a bundle built with --logits all returns every row of the call)."""
        for name, a in small.items():
            self.binding.bind_cpu_input(name, a)
        self.binding.clear_binding_outputs()
        self._decode_key = None
        V = self._fixed[io.LOGITS.name][0][0]
        if self._logit_buf is None:
            self._logit_buf = np.empty(self.cfg.max_batch * VERIFY_ROWS * V, np.float32)
        rows = small[io.LOGIT_ROWS.name].shape[1]
        outs = {io.LOGITS.name: self._logit_buf[:B * J * V].reshape(B, J, V),
                io.ATTN_MASS.name: np.empty((B, L), np.float32),
                io.QUERY_MASS.name: np.empty((B, rows, L), np.float32)}
        outs = {name: a for name, a in outs.items() if name in want}
        for name, a in outs.items():
            self.binding.bind_ortvalue_output(name, self.ort.OrtValue.ortvalue_from_numpy(a))
        self.session.run_with_iobinding(self.binding)
        self.binding.clear_binding_outputs()
        outs[io.LOGITS.name] = outs[io.LOGITS.name].copy()
        return outs

    def _commit_decode_rows(self, b: int, row: int, p: int) -> None:
        """A decode call's new rows of sequence b into every cache buffer at (row, p), both checked by the caller
        (a pool row, p < n_max): one memmove each, on addresses fixed when the arrays were bound (numpy's item
        assignment costs 2 µs a buffer, 0.27 of 0.6 ms of Python a SmolLM2 step with 120 buffers)."""
        for cp in self._decode_copies:
            _memmove(cp.dst + row * cp.dst_row + p * cp.dst_pos, cp.src + b * cp.src_seq, cp.nbytes)

    def take_prefix(self, cache: OrtCache, length: int) -> PositionRows | PrefixRows:
        """The first `length` positions of a sequence's cache, copied (runtime.prefix_cache)."""
        with self.lock:
            if self.pools is not None:
                return take_prefix(self.cfg, self.buffers, cache, length)  # type: ignore[arg-type]
            return PositionRows({name: buf[cache.row, :length].copy() for name, buf in self.buffers.items()})

    def put_prefix(self, cache: OrtCache, prefix: PositionRows | PrefixRows) -> None:
        with self.lock:
            if self.pools is not None:
                put_prefix(self.buffers, cache, prefix)  # type: ignore[arg-type]
                return
            n = len(next(iter(prefix.arrays.values())))
            self.pages.reserve(cache.row, n)
            for name, rows in prefix.arrays.items():
                self.buffers[name][cache.row, :n] = rows

    def truncate(self, cache: OrtCache, length: int) -> None:
        """The pools' slot table gives the rows from `length` on back; the portable buffers are by position, and a
        position past the length is read by nothing until a call writes it again."""
        if cache.slots is not None:
            with self.lock:
                cache.slots.truncate(length)

    def demote(self, cache: OrtCache, new_tier: np.ndarray) -> float | None:
        """Re-encode the positions whose new_tier (int32 by position, -1 = unchanged) is >= 0: only
        those rows go through the demotion graph and come back into the buffers. Returns the pass's
        relative KV noise ||new - old||_F / ||old||_F over those rows (all layers, K and V), None if none."""
        if self.pools is not None:
            with self.lock:
                return self.pools.demote(cache, new_tier)  # type: ignore[arg-type]
        where = np.nonzero(np.asarray(new_tier) >= 0)[0]
        if where.size == 0:
            return None
        feeds: dict[str, np.ndarray] = {io.NEW_TIER.name: np.asarray(new_tier, np.int32)[where]}
        feeds[io.POSITIONS.name] = where.astype(np.int32)
        sums = []
        with self.lock:
            for l in self.layers:
                for port in (io.DEMOTE_LATENT_K, io.DEMOTE_LATENT_V):
                    feeds[port.at(l)] = self.buffers[port.at(l)][cache.row, where]
            for name, arr in zip(self.demote_out, self.demote_session.run(None, feeds)):
                buf = name.replace("_out.", ".")
                if buf in feeds:  # a latent: the noise is measured on what the tiers change (spec 4.3)
                    sums.append(kv_noise_sums(feeds[buf], arr))
                self.buffers[buf][cache.row, where] = arr  # latents, and the K rows made from them
        return relative_noise(sums)
