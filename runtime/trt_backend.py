"""TensorRT backend: engine.plan (+ demote.plan) with the GSM plugins, cache buffers bound in place.

Written against the TensorRT 10 Python API (IRuntime.deserialize_cuda_engine, one
IExecutionContext per optimisation profile, set_input_shape / set_tensor_address /
execute_async_v3) and cuda-python's runtime API for device memory. It is only importable usefully
on a machine with TensorRT, a GPU and the GSM plugin library; tests skip it elsewhere.

Buffers (docs/engine_io.md section 2), allocated once and bound at the same address for `X` and `X_out`:
the pools kv_pool.{l} int32 words [R, P32] and index_keys.{l} [R, N_max, ...] (f16, or INT8 codes in int32
words), R = the plan's max_batch rows, always bound whole; the per-call tensors (input_ids, lengths,
kv_slots [B, N_max], cache_rows [B], outputs) sized for max_batch sequences. Each sequence keeps one row of
the pools (runtime.plugin_cache, shared with the reference backend, which runs the same host logic over the
same memory model in CI); a call carries any of the resident sequences. Per call the runtime writes the
per-call inputs (host -> device), runs the prefill context (profile 0, S > 1: a prompt chunk or a speculative
verification) or the decode context (profile 1, S = 1), and reads logits and attn_mass back (and a verification's
query_mass). Demotion runs demote.plan over the whole pools with a
demotion list whose entries name their rows; a re-tier pass reads the sequence's pool rows back before and after
it for the KV noise.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gsm import graph_io as io
from gsm.bundle_format import FILES, VERIFY_ROWS, BundleConfig
from runtime.backend import Capabilities, StepOutput, check_max_top_k, step_feeds
from runtime.ort_backend import VERIFY_ROW_COST, VERIFY_ROW_COST_BATCH
from runtime.plugin_cache import PluginCache, PluginRows, PrefixRows, quant_tables, read_latents

log = logging.getLogger("runtime.trt_backend")

PREFILL_PROFILE, DECODE_PROFILE = 0, 1


@dataclass(frozen=True)
class EnginePlans:
    """The serialized engines a TrtBackend runs and the plugin library they need: the bundle's own by default, or a
    candidate `builder engine` has just built and checks before installing it."""

    engine: Path
    demote: Path
    plugin_library: str

    @classmethod
    def of_bundle(cls, bundle: Path) -> EnginePlans:
        """engine.plan and demote.plan of the bundle, and GSM_PLUGIN_LIB or the library the engine was built with."""
        manifest = json.loads((bundle / FILES.manifest).read_text())
        lib = os.environ.get("GSM_PLUGIN_LIB") or manifest.get("engine", {}).get("plugin_library",
                                                                                "libgsm_trt_plugins.so")
        return cls(bundle / FILES.engine, bundle / FILES.demote_engine, lib)


def trt_usable(bundle: Path, plans: EnginePlans | None = None) -> tuple[bool, str]:
    """(True, "") when the bundle has engine.plan (or `plans` exist) and TensorRT + cuda-python import; else (False,
    why)."""
    if not (plans.engine if plans is not None else bundle / FILES.engine).is_file():
        return False, "the bundle has no engine.plan (build it on the target: python -m builder engine BUNDLE)"
    try:
        import tensorrt  # noqa: F401
    except ImportError as e:
        return False, f"TensorRT is not installed ({e})"
    try:
        _cudart()
    except ImportError as e:
        return False, f"cuda-python is not installed ({e})"
    return True, ""


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart  # older cuda-python
    return cudart


def _check(res: Any) -> Any:
    """cuda-python calls return (err, *values); raise on error, return the values."""
    err, *vals = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return vals[0] if len(vals) == 1 else vals


class DeviceBuffer:
    def __init__(self, cudart: Any, nbytes: int) -> None:
        self.cudart, self.nbytes = cudart, max(1, nbytes)
        self.ptr = int(_check(cudart.cudaMalloc(self.nbytes)))
        _check(cudart.cudaMemset(self.ptr, 0, self.nbytes))

    def upload(self, a: np.ndarray, stream: Any) -> None:
        a = np.ascontiguousarray(a)
        _check(self.cudart.cudaMemcpyAsync(self.ptr, a.ctypes.data, a.nbytes,
                                           self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))

    def download(self, a: np.ndarray, stream: Any, offset: int = 0) -> np.ndarray:
        """a.nbytes bytes from `offset` into `a` (asynchronous: synchronize the stream before reading a)."""
        _check(self.cudart.cudaMemcpyAsync(a.ctypes.data, self.ptr + offset, a.nbytes,
                                           self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))
        return a

    def free(self) -> None:
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


def gpu_name() -> str:
    """CUDA device 0's name and compute capability, for the golden check's table."""
    props = _check(_cudart().cudaGetDeviceProperties(0))
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return f"{name} (sm_{props.major}{props.minor})"


class TrtBackend:
    """runtime.backend.Backend: new_cache / release / forward / demote / close; a cache
    (runtime.plugin_cache.PluginCache) is the host state of one sequence (its row, its slot table), the
    pools stay on the device."""

    name = "tensorrt"

    def __init__(self, bundle: Path, cfg: BundleConfig, plans: EnginePlans | None = None) -> None:
        ok, why = trt_usable(bundle, plans)
        if not ok:
            raise RuntimeError(f"backend 'tensorrt' unavailable: {why}")
        import tensorrt as trt

        plans = plans or EnginePlans.of_bundle(bundle)
        self.trt, self.cudart, self.cfg = trt, _cudart(), cfg
        # the plugin library first: its IPluginV3 creators register before the engine is deserialized
        ctypes.CDLL(plans.plugin_library, mode=ctypes.RTLD_GLOBAL)
        self.logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(self.logger, "")
        rt = trt.Runtime(self.logger)
        self.engine = rt.deserialize_cuda_engine(plans.engine.read_bytes())
        self.demote_engine = rt.deserialize_cuda_engine(plans.demote.read_bytes())
        if self.engine is None or self.demote_engine is None:
            raise RuntimeError("TensorRT could not deserialize the engines (plugin library or version mismatch?)")
        self.stream = _check(self.cudart.cudaStreamCreate())
        self.contexts = {}
        for prof in (PREFILL_PROFILE, DECODE_PROFILE):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(prof, int(self.stream))
            self.contexts[prof] = ctx
        self.demote_ctx = self.demote_engine.create_execution_context()
        self.layers = list(cfg.owning_layers)
        self.n_max, self.B = cfg.n_max, cfg.max_batch
        self.plugin_rows = PluginRows(cfg, self.name)
        self.R = self.plugin_rows.rows
        self.inputs = {n for n in self._io_names(self.engine)
                       if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        self.bufs: dict[str, DeviceBuffer] = {}
        for name in self._io_names(self.engine):
            if "_out." in name:
                continue  # kv_pool_out.{l} / index_keys_out.{l} are bound to their input's buffer
            self.bufs[name] = DeviceBuffer(self.cudart, self._max_bytes(name))
        self.bufs[io.DEMOTE_LIST.name] = DeviceBuffer(self.cudart, self.R * self.n_max * 3 * 4)
        # the attention plugins read sparse_top_k [B], each budget up to max_top_k, which the selection width
        # K_sel = sinks + max_sparse_window + max_top_k of selected.{l} gives
        l0 = self.layers[0]
        k_sel = int(self.engine.get_tensor_shape(io.SELECTED.at(l0))[-1])
        # a layer's node window is the wider of the model's and its own (layer_selection)
        self.max_top_k = k_sel - cfg.sink_tokens - max(cfg.max_sparse_window, cfg.selection_of(l0)[0])
        # KV noise: the pools are read back and dequantised on the host with the demotion graph's tables, which
        # needs the onnx package (the builder extra the engine was built with); without it no noise is measured
        try:
            import onnx

            self.quant: dict[int, np.ndarray] | None = quant_tables(onnx.load(str(bundle / FILES.demote_trt)))
        except ImportError as e:
            self.quant = None
            log.warning("backend tensorrt: no KV-noise measure (the refresh fallback is off): the onnx package "
                        "is not installed (%s); pip install 'gsm-edge[builder]'", e)
        self.row_bytes = {n: self._max_bytes(n) // self.R for n in self.bufs
                          if n.startswith((io.KV_POOL.prefix, io.INDEX_KEYS.prefix))}  # one cache row of each pool
        # a shadow call writes only beyond each sequence's length (runtime.plugin_cache): probes possible. The
        # attention plugin computes each query row alone (tests/gpu: a row of a call is a one-token call's, bit for
        # bit); that the projections' GEMMs of the prefill profile give a row the decode profile's bits is
        # TensorRT's choice of tactics, which tests/test_backend_contract.py's drafting test checks on a GPU. A
        # verified row's cost is not measured (no GPU has run this backend): a decode step on a GPU reads the weights
        # and leaves the compute units mostly idle, so a row should cost less than on the CPU graph, whose measured
        # figures are taken until scripts/gpu_check.sh measures these, erring towards fewer drafts
        self.capabilities = Capabilities(
            max_resident=self.R, max_per_call=self.R, positions=self.n_max,
            kv_bytes_per_sequence=sum(self.row_bytes.values()) + 4 * self.n_max,
            hit_rate_probes=True, kv_noise=self.quant is not None, max_top_k=self.max_top_k,
            verify_rows=min(VERIFY_ROWS, cfg.max_input),
            verify_row_cost=VERIFY_ROW_COST, verify_row_cost_batch=VERIFY_ROW_COST_BATCH)

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _io_names(engine: Any) -> list[str]:
        return [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]

    def _max_shape(self, name: str) -> tuple[int, ...]:
        T, V = self.cfg.max_input, self.cfg.vocab_size
        fixed = {io.INPUT_IDS.name: (self.B, T), io.PAST_LENGTHS.name: (self.B,), io.NEW_LENGTHS.name: (self.B,),
                 io.SPARSE_WINDOW.name: (1,),
                 io.LOGITS.name: (self.B, T if self.cfg.logits == "all" else VERIFY_ROWS, V),
                 io.LOGIT_ROWS.name: (self.B, VERIFY_ROWS), io.ATTN_MASS.name: (self.B, self.n_max),
                 io.QUERY_MASS.name: (self.B, VERIFY_ROWS, self.n_max)}
        if name in fixed:
            return fixed[name]
        if name.startswith(io.SELECTED.prefix):  # [B, S, K_sel] (the per-layer probe output)
            return (self.B, T, int(self.engine.get_tensor_shape(name)[-1]))
        if name.startswith(io.LAYER_MASS.prefix):
            return (self.B, self.n_max)
        shape = list(self.engine.get_tensor_shape(name))
        shape[0] = self.R if name.startswith(("kv_pool", "index_keys")) else self.B  # the pools: every row
        return tuple(int(d) for d in shape)

    def _max_bytes(self, name: str) -> int:
        dt = np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))
        return int(np.prod(self._max_shape(name))) * dt.itemsize

    def _alias(self, name: str) -> str:
        return name.replace("_out.", ".") if "_out." in name else name

    # -- backend interface -------------------------------------------------------------------------
    def new_cache(self) -> PluginCache:
        return self.plugin_rows.new_cache()

    def release(self, cache: PluginCache) -> None:
        self.plugin_rows.release(cache)

    def forward(self, caches: list[PluginCache], ids: np.ndarray, past: np.ndarray, new: np.ndarray,
                sparse_window: int, top_k: np.ndarray, *, probes: bool = False, commit: bool = True,
                rows: np.ndarray | None = None) -> StepOutput:
        """One execution over the call's sequences, each in its own row of the pools. top_k: each sequence's
        budget, bound as `sparse_top_k` [B] (at most max_top_k: RequestError otherwise, before anything
        changes). The per-layer outputs are bound to device buffers on every call (TensorRT needs every I/O
        address) but read back only with `probes`. rows [B, J]: the rows whose logits come back, and whose queries'
        own attention mass (query_mass) comes back with them (None: each sequence's last new row, no query_mass).
        commit False (a shadow call): the slot tables are put back after it, so the rows it wrote are free again
        (runtime.plugin_cache)."""
        check_max_top_k(top_k, self.max_top_k, self.name)
        B, S = ids.shape
        plan = self.plugin_rows.plan_call(caches, past, new)
        if plan.compaction.size:
            self._run_demote(plan.compaction)
        host = step_feeds(ids, past, new, sparse_window, top_k, plan.cache_rows, rows, plan.kv_slots)
        ctx = self.contexts[DECODE_PROFILE if S == 1 else PREFILL_PROFILE]
        for name in self._io_names(self.engine):
            buf = self.bufs[self._alias(name)]
            if self.engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT:
                shape = host[name].shape if name in host else self._max_shape(name)  # the pools: all R rows
                ctx.set_input_shape(name, shape)
                if name in host:
                    buf.upload(host[name], self.stream)
            ctx.set_tensor_address(name, buf.ptr)
        if not ctx.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        V = self.cfg.vocab_size
        J = S if self.cfg.logits == "all" else host[io.LOGIT_ROWS.name].shape[1]
        logits = self.bufs[io.LOGITS.name].download(np.empty((B, J, V), np.float32), self.stream)
        mass = self.bufs[io.ATTN_MASS.name].download(np.empty((B, self.n_max), np.float32), self.stream)
        query_mass = None
        if rows is not None:
            shape = (B, host[io.LOGIT_ROWS.name].shape[1], self.n_max)
            query_mass = self.bufs[io.QUERY_MASS.name].download(np.empty(shape, np.float32), self.stream)
        sel = layer_mass = None
        if probes:
            sel = {l: self.bufs[io.SELECTED.at(l)].download(
                np.empty((B, S, self._max_shape(io.SELECTED.at(l))[-1]), np.int32), self.stream) for l in self.layers}
            layer_mass = {l: self.bufs[io.LAYER_MASS.at(l)].download(np.empty((B, self.n_max), np.float32), self.stream)
                          for l in self.layers}
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        if not commit:
            self.plugin_rows.undo(caches, plan)
        return StepOutput(logits, mass, sel, layer_mass, query_mass)

    def take_prefix(self, cache: PluginCache, length: int) -> PrefixRows:
        raise RuntimeError("backend tensorrt: copying a prefix of the device pools is not implemented "
                           "(capabilities.prefix_reuse is False)")

    def put_prefix(self, cache: PluginCache, prefix: PrefixRows) -> None:
        raise RuntimeError("backend tensorrt: copying a prefix of the device pools is not implemented "
                           "(capabilities.prefix_reuse is False)")

    def truncate(self, cache: PluginCache, length: int) -> None:
        cache.slots.truncate(length)

    def demote(self, cache: PluginCache, new_tier: np.ndarray) -> float | None:
        """new_tier: int32 by position (-1 = unchanged). Returns the pass's relative KV noise over the
        re-encoded rows (read back from the device before and after), None when none changed or the quant
        tables could not be read (capabilities.kv_noise)."""
        return self.plugin_rows.demote(cache, new_tier, self._run_demote,
                                       self._latents if self.quant is not None else None)

    def _latents(self, cache: PluginCache) -> list[np.ndarray]:
        """Every owning layer's dequantised K and V latents by position of one sequence: its pool rows copied
        to the host (one row per layer, not the whole pools) and read by the CPU reference."""
        rows = {}
        for l in self.layers:
            n = self.row_bytes[io.KV_POOL.at(l)]
            rows[l] = self.bufs[io.KV_POOL.at(l)].download(np.empty(n // 4, np.int32), self.stream, cache.row * n)
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        assert self.quant is not None
        return [a for l in self.layers
                for a in read_latents(self.cfg, l, rows[l], cache.slots.entries, self.quant[l])]

    def _run_demote(self, lst: np.ndarray) -> None:
        """demote_list [M, 3] (row, old entry, new entry) over the whole pools."""
        ctx = self.demote_ctx
        for name in self._io_names(self.demote_engine):
            if name == io.DEMOTE_LIST.name:
                ctx.set_input_shape(name, lst.shape)
                self.bufs[name].upload(lst, self.stream)
                ctx.set_tensor_address(name, self.bufs[name].ptr)
                continue
            buf = self.bufs[self._alias(name)]
            if self.demote_engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT:
                ctx.set_input_shape(name, self._max_shape(self._alias(name)))  # [R, P32]: every row
            ctx.set_tensor_address(name, buf.ptr)
        if not ctx.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT demotion execute_async_v3 failed")
        # the next forward's kv_slots upload is ordered after this on the same stream

    def close(self) -> None:
        for b in self.bufs.values():
            b.free()
        self.bufs.clear()
