"""torch.cuda bindings of the CUDA kernels (libgsm_plugins_cuda.so), for tests/gpu and scripts/gpu_check.sh.

The kernels take device pointers; these helpers upload a `testing.Scenario` (or torch tensors),
call the kernels on the current stream and return NumPy results shaped like `ref`'s, so GPU and CPU
reference results compare directly. Needs torch with CUDA; imported only on GPU machines.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from gsm_edge_plugins._lib import CUDA_LIB, load
from gsm_edge_plugins.ref import AttentionResult, Dims

_c = ctypes


class CudaKernels:
    def __init__(self) -> None:
        lib = load(CUDA_LIB)
        if lib is None:
            raise ImportError(f"{CUDA_LIB} was not built (no nvcc at build time)")
        p, i32, i64 = _c.c_void_p, _c.c_int32, _c.c_int64
        sig = {
            "gsm_cuda_last_error": (_c.c_char_p, []),
            "gsm_cuda_architectures": (_c.c_char_p, []),
            "gsm_cuda_kv_update": (i32, [p, i32, i32] + [p] * 8 + [p]),
            "gsm_cuda_kv_demote_workspace_bytes": (i64, [p, i64]),
            "gsm_cuda_kv_demote": (i32, [p, i32, i32, p, p, p, p, p]),
            "gsm_cuda_attention_workspace_bytes": (i64, [p, i64]),
            "gsm_cuda_sparse_attention": (i32, [p, i32, i32] + [p] * 19 + [p, i64, p]),
            "gsm_cuda_synchronize": (i32, []),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self.lib.gsm_cuda_last_error().decode())


_K: CudaKernels | None = None


def kernels() -> CudaKernels:
    global _K
    if _K is None:
        _K = CudaKernels()
    return _K


def architectures() -> str:
    """The SMs the library was compiled for, e.g. "87,90"."""
    return kernels().lib.gsm_cuda_architectures().decode()


def _dev(a, dtype=None):
    import torch

    if a is None:
        return None
    t = torch.as_tensor(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a)
    if dtype is not None:
        t = t.to(dtype)
    return t.contiguous().cuda()


def _p(t) -> int | None:
    return None if t is None else t.data_ptr()


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

    def run(self) -> None:
        t = self.tensors
        K = kernels()
        K.check(K.lib.gsm_cuda_sparse_attention(
            _c.byref(self.dims_c), self.B, self.S, _p(t["q"]), _p(t["pool"]), _p(t["slots"]), _p(t["past"]),
            _p(t["new"]), _p(t["quant"]), _p(t["cos"]), _p(t["sin"]), _p(t["w0"]), _p(t["w1"]), _p(t.get("iq")),
            _p(t.get("iw")), _p(t.get("ik")), _p(t.get("window")), _p(t.get("sel_in")), _p(t.get("top_k")),
            _p(t["out"]), _p(t.get("sel_out")), _p(t.get("mass")), _p(self.workspace), self.ws_bytes, None))

    def result(self) -> AttentionResult:
        import torch

        torch.cuda.synchronize()
        t = self.tensors

        def host(name: str) -> np.ndarray | None:
            return None if t.get(name) is None else t[name].cpu().numpy()

        return AttentionResult(host("out"), host("sel_out"), host("mass"), None)


def prepare_attention(sc, selected: np.ndarray | None = None) -> DeviceCall:
    """Upload a gsm_edge_plugins.testing.Scenario for the CUDA attention kernels."""
    import torch

    d, B, S = sc.dims, sc.q.shape[0], sc.q.shape[1]
    owning = d.layer_kind == 0
    t = {"q": _dev(sc.q), "pool": _dev(sc.pool), "slots": _dev(sc.slots), "past": _dev(sc.past),
         "new": _dev(sc.new), "quant": _dev(sc.quant), "cos": _dev(sc.rope_cos), "sin": _dev(sc.rope_sin),
         "w0": _dev(sc.w0), "w1": _dev(sc.w1),
         "out": torch.full((B, S, d.num_heads * d.head_dim), float("nan"), device="cuda")}
    if owning:
        t.update(iq=_dev(sc.index_q), iw=_dev(sc.index_w), ik=_dev(sc.index_keys.view(np.int16)),
                 window=_dev(np.array([sc.window], np.int32)),
                 top_k=None if sc.top_k is None else _dev(np.asarray(sc.top_k, np.int32)),
                 sel_out=torch.full((B, S, d.k_sel), -7, dtype=torch.int32, device="cuda"),
                 mass=torch.full((B, d.n_max), float("nan"), device="cuda"))
    else:
        t["sel_in"] = _dev(selected)
    dims_c = d.c()
    ws = int(kernels().lib.gsm_cuda_attention_workspace_bytes(_c.byref(dims_c), B * S))
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
    return DeviceCall(d, B, S, t, workspace, ws, dims_c)


def sparse_attention(sc, selected: np.ndarray | None = None) -> AttentionResult:
    call = prepare_attention(sc, selected)
    call.run()
    return call.result()


def kv_update(d: Dims, ck, cv, key, pool, index_keys, slots, past, new) -> tuple[np.ndarray, np.ndarray]:
    """CUDA GsmKVCacheUpdate on host arrays (uploaded, updated on the device, returned as NumPy)."""
    B, S = ck.shape[:2]
    dp, dk = _dev(pool), _dev(np.ascontiguousarray(index_keys).view(np.int16))
    K = kernels()
    dc = d.c()
    K.check(K.lib.gsm_cuda_kv_update(_c.byref(dc), B, S, _p(_dev(ck)), _p(_dev(cv)), _p(_dev(key)), _p(dp), _p(dk),
                                     _p(_dev(slots)), _p(_dev(past)), _p(_dev(new)), None))
    K.check(K.lib.gsm_cuda_synchronize())
    return dp.cpu().numpy(), dk.cpu().numpy().view(np.float16)


def kv_demote(d: Dims, entries: np.ndarray, pool: np.ndarray, quant: np.ndarray) -> np.ndarray:
    """CUDA GsmKVDemote on host arrays; returns the new pool."""
    import torch

    entries = np.ascontiguousarray(entries, np.int32).reshape(-1, 3)
    dp = _dev(pool)
    K = kernels()
    dc = d.c()
    ws = torch.empty(max(1, int(K.lib.gsm_cuda_kv_demote_workspace_bytes(_c.byref(dc), entries.shape[0]))),
                     dtype=torch.uint8, device="cuda")
    K.check(K.lib.gsm_cuda_kv_demote(_c.byref(dc), pool.shape[0], entries.shape[0], _p(_dev(entries)), _p(dp),
                                     _p(_dev(quant)), _p(ws), None))
    K.check(K.lib.gsm_cuda_synchronize())
    return dp.cpu().numpy()
