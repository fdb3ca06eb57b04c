"""Bindings of the CUDA kernels for tests/gpu and scripts/gpu_check.sh, on a GPU or emulated on the CPU.

`GSM_CUDA` chooses the library (both have the same C API, plugins/common/gsmCudaCapi.cu):
- `device` (default): libgsm_plugins_cuda.so, the nvcc build; buffers are torch.cuda tensors (needs a GPU);
- `emulated`: libgsm_plugins_cuda_emulated.so, the same kernel sources built on the HIP CPU Runtime; buffers
  are NumPy arrays (a "device pointer" is a host pointer there), no torch and no GPU needed.

These helpers upload a `testing.Scenario` (or arrays), call the kernels on the default stream and return NumPy
results shaped like `ref`'s, so kernel and CPU reference results compare directly.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from gsm_edge_plugins._lib import CUDA_EMULATED_LIB, CUDA_LIB, find_library, load
from gsm_edge_plugins.ref import AttentionResult, Dims, _quant

_c = ctypes

MODES = {"device": CUDA_LIB, "emulated": CUDA_EMULATED_LIB}


def mode() -> str:
    """`GSM_CUDA` (device | emulated); a ValueError names the variable for anything else."""
    m = os.environ.get("GSM_CUDA", "device").strip().lower() or "device"
    if m not in MODES:
        raise ValueError(f"GSM_CUDA={m!r}: expected one of {', '.join(MODES)}")
    return m


def library_available(m: str | None = None) -> bool:
    """Whether the kernel library of mode `m` (default: `mode()`) was built."""
    return find_library(MODES[m or mode()]) is not None


class CudaKernels:
    def __init__(self, m: str) -> None:
        name = MODES[m]
        lib = load(name)
        if lib is None:
            why = "no nvcc at build time" if m == "device" else "no HIP CPU Runtime or TBB at build time"
            raise ImportError(f"{name} was not built ({why})")
        p, i32, i64 = _c.c_void_p, _c.c_int32, _c.c_int64
        sig = {
            "gsm_cuda_last_error": (_c.c_char_p, []),
            "gsm_cuda_architectures": (_c.c_char_p, []),
            "gsm_cuda_kv_update": (i32, [p, i32, i32, i32] + [p] * 8 + [p, i32, p]),
            "gsm_cuda_kv_demote_workspace_bytes": (i64, [p, i64]),
            "gsm_cuda_kv_demote": (i32, [p, i32, i32, p, p, p, p, p]),
            "gsm_cuda_attention_workspace_bytes": (i64, [p, i64]),
            # dims, B, S, fp16, 16 inputs, cache_rows + R, logit_rows + J, 4 outputs, workspace + bytes, stream
            "gsm_cuda_sparse_attention": (i32, [p, i32, i32, i32] + [p] * 16 + [p, i32] * 2 + [p] * 4 + [p, i64, p]),
            "gsm_cuda_synchronize": (i32, []),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib
        self.mode = m
        self.mem = _HostMemory() if m == "emulated" else _TorchCudaMemory()

    def check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self.lib.gsm_cuda_last_error().decode())


_K: dict[str, CudaKernels] = {}


def kernels() -> CudaKernels:
    m = mode()
    if m not in _K:
        _K[m] = CudaKernels(m)
    return _K[m]


def architectures() -> str:
    """The SMs the library was compiled for, e.g. "87,90"."""
    return kernels().lib.gsm_cuda_architectures().decode()


class _TorchCudaMemory:
    """Buffers on the GPU (torch.cuda tensors)."""

    def upload(self, a: np.ndarray):
        import torch

        return torch.as_tensor(np.ascontiguousarray(a)).contiguous().cuda()

    def full(self, shape, value, dtype):
        import torch

        return torch.full(shape, value, dtype=getattr(torch, np.dtype(dtype).name), device="cuda")

    def ptr(self, t) -> int | None:
        return None if t is None else t.data_ptr()

    def host(self, t) -> np.ndarray:
        return t.cpu().numpy()


class _HostMemory:
    """Buffers of the emulated kernels: private NumPy copies (so a kernel writes only what it was given)."""

    def upload(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True, order="C")

    def full(self, shape, value, dtype) -> np.ndarray:
        return np.full(shape, value, dtype)

    def ptr(self, a) -> int | None:
        return None if a is None else a.ctypes.data

    def host(self, a) -> np.ndarray:
        return a.copy()


def _dev(a):
    return None if a is None else kernels().mem.upload(np.asarray(a))


def _p(t) -> int | None:
    return kernels().mem.ptr(t)


@dataclass
class DeviceCall:
    """A GsmSparseAttention call held on the device, reusable for timing."""

    dims: Dims
    B: int
    S: int
    tensors: dict
    workspace: object
    ws_bytes: int
    dims_c: object
    fp16: bool = False  # q, index_q, index_w and out are float16 (the kernels' __half instantiation)
    pool_rows: int = 0  # R of the pools when the call has cache_rows
    logit_rows: int = 0  # J of the call's logit_rows [B, J] (0: none, no query_mass)

    def run(self) -> None:
        t = self.tensors
        K = kernels()
        first = ("q", "pool", "slots", "past", "new", "quant", "cos", "sin", "w0", "w1", "iq", "iw", "ik", "window",
                 "sel_in", "top_k")  # the C signature's order
        K.check(K.lib.gsm_cuda_sparse_attention(_c.byref(self.dims_c), self.B, self.S, int(self.fp16),
                                                *(_p(t.get(n)) for n in first), _p(t.get("rows")), self.pool_rows,
                                                _p(t.get("logit_rows")), self.logit_rows,
                                                *(_p(t.get(n)) for n in ("out", "sel_out", "mass", "query_mass")),
                                                _p(self.workspace), self.ws_bytes, None))

    def result(self) -> AttentionResult:
        K = kernels()
        K.check(K.lib.gsm_cuda_synchronize())
        t = self.tensors

        def host(name: str) -> np.ndarray | None:
            return None if t.get(name) is None else K.mem.host(t[name])

        out = host("out")
        return AttentionResult(out.astype(np.float32) if self.fp16 else out, host("sel_out"), host("mass"), None,
                               host("query_mass"))


def prepare_attention(sc, selected: np.ndarray | None = None, *, fp16: bool = False,
                      logit_rows: np.ndarray | None = None) -> DeviceCall:
    """Upload a gsm_edge_plugins.testing.Scenario for the CUDA attention kernels; fp16: activations (q, index_q,
    index_w, out) as float16, the scenario's rounded to nearest; logit_rows [B, J] (owning): the rows whose queries'
    own mass comes back as `query_mass` [B, J, N_max]."""
    mem = kernels().mem
    d, B, S = sc.dims, sc.q.shape[0], sc.q.shape[1]
    owning = d.layer_kind == 0
    act = np.float16 if fp16 else np.float32
    t = {"q": _dev(sc.q.astype(act)), "pool": _dev(sc.pool), "slots": _dev(sc.slots), "past": _dev(sc.past),
         "new": _dev(sc.new), "quant": _dev(_quant(sc.quant, d)), "cos": _dev(sc.rope_cos), "sin": _dev(sc.rope_sin),
         "w0": _dev(sc.w0), "w1": _dev(sc.w1),
         "rows": None if sc.cache_rows is None else _dev(np.asarray(sc.cache_rows, np.int32)),
         "out": mem.full((B, S, d.num_heads * d.head_dim), np.nan, act)}
    if owning:
        t.update(iq=_dev(sc.index_q.astype(act)), iw=_dev(sc.index_w.astype(act)),
                 ik=_dev(sc.index_keys.view(np.int16)),
                 window=_dev(np.array([sc.window], np.int32)),
                 top_k=None if sc.top_k is None else _dev(np.asarray(sc.top_k, np.int32)),
                 sel_out=mem.full((B, S, d.k_sel), -7, np.int32),
                 mass=mem.full((B, d.n_max), np.nan, np.float32))
    else:
        t["sel_in"] = _dev(selected)
    J = 0
    if logit_rows is not None:
        J = int(np.shape(logit_rows)[1])
        t.update(logit_rows=_dev(np.asarray(logit_rows, np.int32).reshape(B, J)),
                 query_mass=mem.full((B, J, d.n_max), np.nan, np.float32))
    dims_c = d.c()
    ws = int(kernels().lib.gsm_cuda_attention_workspace_bytes(_c.byref(dims_c), B * S))
    workspace = mem.full((max(ws, 1),), 0, np.uint8)
    return DeviceCall(d, B, S, t, workspace, ws, dims_c, fp16, int(sc.pool.shape[0]), J)


def sparse_attention(sc, selected: np.ndarray | None = None, *, fp16: bool = False,
                     logit_rows: np.ndarray | None = None) -> AttentionResult:
    call = prepare_attention(sc, selected, fp16=fp16, logit_rows=logit_rows)
    call.run()
    return call.result()


def kv_update(d: Dims, ck, cv, key, pool, index_keys, slots, past, new, *, cache_rows=None, fp16: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """CUDA GsmKVCacheUpdate on host arrays (uploaded, updated on the device, returned as NumPy); fp16: ck, cv and
    key passed as float16 (rounded to nearest); cache_rows: int [B] rows of pool / index_keys (None: row b)."""
    B, S = ck.shape[:2]
    dp, dk = _dev(pool), _dev(np.ascontiguousarray(index_keys).view(np.int16))
    act = np.float16 if fp16 else np.float32
    ins = [_dev(np.asarray(a, act)) for a in (ck, cv, key)] + [_dev(a) for a in (slots, past, new)]  # held until done
    rows = None if cache_rows is None else _dev(np.asarray(cache_rows, np.int32))
    K = kernels()
    dc = d.c()
    K.check(K.lib.gsm_cuda_kv_update(_c.byref(dc), B, S, int(fp16), *map(_p, ins[:3]), _p(dp), _p(dk),
                                     *map(_p, ins[3:]), _p(rows), int(np.shape(pool)[0]), None))
    K.check(K.lib.gsm_cuda_synchronize())
    return K.mem.host(dp), K.mem.host(dk).view(np.asarray(index_keys).dtype)


def kv_demote(d: Dims, entries: np.ndarray, pool: np.ndarray, quant: np.ndarray) -> np.ndarray:
    """CUDA GsmKVDemote on host arrays; returns the new pool."""
    entries = np.ascontiguousarray(entries, np.int32).reshape(-1, 3)
    dp = _dev(pool)
    K = kernels()
    dc = d.c()
    ws = K.mem.full((max(1, int(K.lib.gsm_cuda_kv_demote_workspace_bytes(_c.byref(dc), entries.shape[0]))),), 0,
                    np.uint8)
    d_entries, d_quant = _dev(entries), _dev(_quant(quant, d))
    K.check(K.lib.gsm_cuda_kv_demote(_c.byref(dc), pool.shape[0], entries.shape[0], _p(d_entries), _p(dp),
                                     _p(d_quant), _p(ws), None))
    K.check(K.lib.gsm_cuda_synchronize())
    return K.mem.host(dp)
