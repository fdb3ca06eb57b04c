"""The weights the golden probe runs with: the bundle's own, as float32 files the golden reads a layer at a time.

A quantised bundle computes with dequantised weights, so its golden must too (decisions "Golden probe
tolerances"): every tensor the build quantises is quantised again here by the same code with the same settings
(`quantize_chunks` with the tensor's WeightQuantConfig, its AWQ scale and its row quantiser, GPTQ for an INT4
head), which is deterministic, so the values are the bundle's; every other tensor is the checkpoint's. TensorRT's
form of a grouped INT8 weight is per output channel (builder/qlinear.py `trt_config`), so where any tensor's two
forms differ the golden has a second set of weights, `tensorrt`.

Memory: each tensor is written into a float32 .npy file once (a block of rows at a time, by file writes, not a
mapping), and the golden reads its matrices a block of rows at a time (`FileMatrix`): the file's pages stay in the
page cache, which is not the build's memory, and the process holds one block, whatever the model. Mapped float32
files of the head and of a layer (what the golden read before) cost the 1b synthetic's build ~500 MiB of resident
pages over the build-memory bound (docs/builder.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builder.network import CheckpointSource
from builder.qlinear import PORTABLE, BundleWeights
from builder.wquant import QuantizedWeight, WeightQuantConfig, dequantize, quantize_chunks
from gsm import names
from gsm.checkpoint import CheckpointTensors
from gsm.config import ModelConfig
from gsm.golden.weights import GoldenWeights, LayerWeights, layer_weights

FLOAT_DIR = "float"  # tensors the bundle holds as the checkpoint does, shared by both forms
OFFSETS = ".offsets"  # an emulated float-zero-point weight's group offsets [N, G], beside its symmetric part
ROWS_PER_BLOCK_BYTES = 16 << 20  # float32 bytes of rows converted at once


def golden_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every checkpoint tensor the golden reads (gsm.golden.weights.GoldenWeights)."""
    out = [names.EMBED, names.FINAL_NORM] + ([] if cfg.tie_word_embeddings else [names.LM_HEAD])
    for i in range(cfg.num_hidden_layers):
        tables = [names.COMMON, names.OWNING if cfg.is_owning(i) else names.SHARING]
        out += [v.format(i=i) for table in tables for v in table.values()]
    return out


def row_blocks(q: QuantizedWeight, rows_per_block: int) -> Iterator[QuantizedWeight]:
    """q a block of rows at a time (rows quantise independently)."""
    for a in range(0, q.n, rows_per_block):
        yield dataclasses.replace(q, codes=q.codes[a:a + rows_per_block], scales=q.scales[a:a + rows_per_block],
                                  zero_points=q.zero_points[a:a + rows_per_block],
                                  mins=None if q.mins is None else q.mins[a:a + rows_per_block])


def symmetric_part(q: QuantizedWeight) -> np.ndarray:
    """float32 [N, K]: scale x (u - 2^(bits-1)), the part of the weight the INT8 activations multiply (its float zero
    point's offset per group, QuantizedWeight.group_offsets, is added on the exact input's group sums)."""
    codes = np.zeros((q.n, q.n_blocks * q.block), np.float32)
    codes[:, : q.k] = q.signed_codes()
    return (codes.reshape(q.n, q.n_blocks, q.block) * q.scales[..., None]).reshape(q.n, -1)[:, : q.k]


class Projection:
    """A weight the golden multiplies by without holding it as a tensor: `x @ W.T` and `F.linear(x, W)` (no bias) both
    reach `__call__(x)`."""

    @property
    def T(self) -> _Transposed:
        return _Transposed(self)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        bias = (kwargs or {}).get("bias", args[2] if len(args) > 2 else None)
        if func is torch.nn.functional.linear and isinstance(args[1], Projection) and bias is None:
            return args[1](args[0])
        return NotImplemented

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8ActivationLinear(Projection):
    """A quantised projection as ONNX Runtime's accuracy-level-4 kernels compute it (plugins/ortCpu/GsmQuantMatMul,
    MatMulNBits): per row and block of the weight's group, dx = max|x| / 127 and xq = round-half-even(x * (1 / dx)),
    all float32; y = (xq dx) @ W_sym^T, plus, for a float-zero-point weight, the exact block sums of x times each
    group's offset."""

    def __init__(self, w_sym: torch.Tensor, offsets: torch.Tensor | None, block: int,
                 inv_scale: torch.Tensor | None) -> None:
        self.w, self.offsets, self.block, self.inv = w_sym, offsets, block, inv_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() if self.inv is None else x.float() * self.inv  # AWQ: the graph feeds x / s
        k, lead = x.shape[-1], x.shape[:-1]
        g = -(-k // self.block)
        xb = torch.nn.functional.pad(x.reshape(-1, k), (0, g * self.block - k)).view(-1, g, self.block)
        dx = xb.abs().amax(dim=-1, keepdim=True) / 127.0
        inv = torch.where(dx != 0, 1.0 / torch.where(dx != 0, dx, 1.0), 0.0)
        xq = (torch.round(xb * inv) * dx).view(-1, g * self.block)[:, :k]
        y = xq @ self.w.T
        if self.offsets is not None:
            y = y + xb.sum(dim=-1) @ self.offsets.T
        return y.view(*lead, -1)


class EmbeddingRows:
    """`W[ids]` of an emulated table: its rows dequantised as the graphs' quantised gather gives them, scale x (u - z)
    plus the group's offset (one rounded product, one rounded sum)."""

    def __init__(self, w: Int8ActivationLinear) -> None:
        self.w = w

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.w.w[ids]
        if self.w.offsets is None:
            return rows
        return rows + self.w.offsets[ids].repeat_interleave(self.w.block, dim=-1)[..., : rows.shape[-1]]


class _Transposed:
    """`W.T` of an Int8ActivationLinear or a FileMatrix: `x @ W.T` calls it."""

    def __init__(self, w: Projection) -> None:
        self.w = w

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


class FileMatrix(Projection):
    """A float32 [N, K] .npy file the golden multiplies by (`x @ W.T`, `F.linear(x, W)`) or gathers rows of (`W[ids]`)
    without holding it: each product reads ROWS_PER_BLOCK_BYTES of rows at a time into memory freed after, so the
    values are the file's and a matrix that fits one block is multiplied exactly as a mapped tensor would be."""

    def __init__(self, path: Path) -> None:
        header = np.load(path, mmap_mode="r")  # numpy's reader; no page of the data is read
        if header.dtype != np.float32 or not header.flags.c_contiguous:
            raise ValueError(f"{path}: expected a C-order float32 array, found {header.dtype}")
        self.path, self.shape, self.offset = path, header.shape, header.offset

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) a block at a time, read into one buffer: a block is overwritten by the next."""
        n, k = self.shape
        rows = min(n, max(1, ROWS_PER_BLOCK_BYTES // (4 * k)))
        buf = np.empty(rows * k, np.float32)
        with self.path.open("rb") as f:
            f.seek(self.offset)
            for a in range(0, n, rows):
                block = buf[: (min(n, a + rows) - a) * k]
                if f.readinto(memoryview(block).cast("B")) != block.nbytes:
                    raise ValueError(f"{self.path}: shorter than its shape {self.shape}")
                yield a, torch.from_numpy(block).view(-1, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.shape[0], dtype=torch.float32)
        for a, w in self.blocks():
            out[..., a:a + w.shape[0]] = x @ w.T
        return out

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        mapped = np.load(self.path, mmap_mode="r")  # unmapped when it goes: only the gathered rows stay
        return torch.from_numpy(np.array(mapped[np.asarray(ids)], np.float32))


def _scaled_columns(chunks: Iterator[np.ndarray], s: np.ndarray, k: int) -> Iterator[np.ndarray]:
    """Flat C-order chunks of W [N, K] -> those of W diag(s), as qlinear.ProjectionStore feeds its quantiser."""
    pos = 0
    for c in chunks:
        c = np.asarray(c, np.float32).reshape(-1)
        yield c * s[(pos + np.arange(c.size)) % k]
        pos += c.size


class ProbeWeights:
    """The golden's weights of each form as float32 .npy files under `root` (a scratch directory)."""

    def __init__(self, root: Path, cfg: ModelConfig, tensors: CheckpointTensors, weights: BundleWeights) -> None:
        self.root, self.cfg, self.tensors, self.weights = Path(root), cfg, tensors, weights
        self.source = CheckpointSource(tensors)
        # emulated projections: name -> (activation block, AWQ 1/s or None)
        self.emulation: dict[str, tuple[int, torch.Tensor | None]] = {}

    def write(self) -> None:
        """Every tensor the golden reads, once per form where its forms differ."""
        for name in golden_tensor_names(self.cfg):
            if name not in self.weights.configs:
                self._store(FLOAT_DIR, name, self.source.chunks(name))
                continue
            done: set[tuple[WeightQuantConfig, bool]] = set()
            for form in self.weights.forms:
                key = (self.weights.config(name, form), self.weights.emulated(form))
                if key not in done:
                    self._store_quantised(form, name, *key)
                    done.add(key)

    def _store_quantised(self, form: str, name: str, qcfg: WeightQuantConfig, emulated: bool) -> None:
        """The weight the bundle computes with (AWQ: the graph feeds x / s to W diag(s)): dequantised codes over the
        AWQ scale, or, emulated, the symmetric part and the group offsets that Int8ActivationLinear takes."""
        shape = tuple(self.source.shape(name))
        chunks = self.source.chunks(name)
        s = self.weights.input_scales.get(name)
        if s is not None:
            chunks = _scaled_columns(chunks, np.asarray(s, np.float32), shape[1])
        q = quantize_chunks(shape, chunks, qcfg, name=name, quantize_rows=self.weights.row_quantizers.get(name))
        blocks = list(row_blocks(q, max(1, ROWS_PER_BLOCK_BYTES // (4 * shape[1]))))
        if not emulated:
            inv = None if s is None else (1.0 / np.asarray(s, np.float64)).astype(np.float32)
            self._store(form, name, (dequantize(b) if inv is None else dequantize(b) * inv for b in blocks), shape)
            return
        self._store(form, name, (symmetric_part(b) for b in blocks), shape)
        if not qcfg.symmetric:
            self._store(form, name + OFFSETS, (b.group_offsets() for b in blocks), (q.n, q.n_blocks))
        self.emulation[name] = (qcfg.block(shape[1]), None if s is None else
                                torch.from_numpy((1.0 / np.asarray(s, np.float64)).astype(np.float32)))

    def _store(self, sub: str, name: str, chunks: Iterator[np.ndarray], shape: tuple[int, ...] | None = None) -> None:
        path = self.root / sub / f"{name}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = shape or tuple(self.tensors.shape(name))
        with path.open("wb") as f:
            np.lib.format.write_array_header_2_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                                                     "fortran_order": False, "shape": shape})
            written = 0
            for c in chunks:
                c = np.ascontiguousarray(c, np.float32).reshape(-1)
                f.write(c.data)
                written += c.size
        if written != int(np.prod(shape)):
            raise ValueError(f"probe weights: {name} wrote {written} values for shape {shape}")

    def tensor(self, form: str, name: str) -> Any:
        """One tensor of `form` from its file (`_mapped`); an emulated projection as an Int8ActivationLinear over its
        parts."""
        if self.weights.emulated(form) and name in self.emulation:
            block, inv = self.emulation[name]
            offsets = self.root / form / f"{name}{OFFSETS}.npy"
            return Int8ActivationLinear(self._mapped(form, name), self._mapped(form, name + OFFSETS)
                                        if offsets.is_file() else None, block, inv)
        for sub in (form, PORTABLE, FLOAT_DIR):
            if (self.root / sub / f"{name}.npy").is_file():
                return self._mapped(sub, name)
        raise KeyError(f"probe weights: no {name}")

    def _mapped(self, sub: str, name: str) -> torch.Tensor | FileMatrix:
        """A matrix as a FileMatrix; a vector (norms, singular values, biases: a few KB) mapped."""
        path = self.root / sub / f"{name}.npy"
        m = FileMatrix(path)
        return m if len(m.shape) == 2 else torch.from_numpy(np.load(path, mmap_mode="c"))

    def golden_weights(self, form: str) -> GoldenWeights:
        """GoldenWeights of `form` whose layers are mapped when read and dropped after (LazyLayers)."""
        def t(name: str) -> torch.Tensor:
            return self.tensor(form, name)

        embed = t(names.EMBED)
        head = embed if self.cfg.tie_word_embeddings else t(names.LM_HEAD)
        if isinstance(embed, Int8ActivationLinear):  # a lookup, no activations: the dequantised rows
            embed = EmbeddingRows(embed)
        return GoldenWeights(cfg=self.cfg, embed=embed, final_norm=t(names.FINAL_NORM), lm_head=head,
                             layers=LazyLayers(self.cfg, t))


class LazyLayers(Sequence[LayerWeights]):
    """The golden's layers, each built from its mapped files when read: the golden holds one at a time."""

    def __init__(self, cfg: ModelConfig, t: Callable[[str], torch.Tensor]) -> None:
        self.cfg, self.t = cfg, t

    def __len__(self) -> int:
        return self.cfg.num_hidden_layers

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return layer_weights(self.cfg, i % len(self), self.t)
