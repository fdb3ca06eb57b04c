"""Seeded random GSM checkpoints (`python -m gsm synth --preset tiny|small|1b --out DIR`).

Tests of the golden model, the builder and the runtime need real checkpoint directories of known
shape without shipping weights: tiny and small run in unit tests, 1b sizes memory planning and
the streaming paths. Weights are random but numerically sane (unit norms, N(0, 0.02)
projections, orthonormal SVD factors with positive singular values), so a forward pass gives
finite logits. Every tensor comes from its own generator seeded by (seed, tensor name): the output
is deterministic, independent of write order, and the 1b preset never holds more than one tensor.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gsm import names
from gsm.checkpoint import CheckpointFiles, write_checkpoint
from gsm.config import GSMParams, KVQuantConfig, ModelConfig
from gsm.safetensors_io import TensorSpec

INIT_STD = 0.02  # LLaMA's initializer_range

_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class Preset:
    """Shape of one synthetic model; ranks (r_k, r_v) cycle over the owning layers."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    ranks: tuple[tuple[int, int], ...]
    indexer_heads: int
    indexer_dim: int
    sparse_top_k: int
    sink_tokens: int
    sparse_window: int
    kv_sharing: dict[int, int] = field(default_factory=dict)
    torch_dtype: str = "float32"
    tie_word_embeddings: bool = False
    max_shard_bytes: int | None = None


PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=172, vocab_size=384, max_positions=512,
                   ranks=((12, 10), (14, 8)), indexer_heads=2, indexer_dim=16, sparse_top_k=8,
                   sink_tokens=1, sparse_window=3, kv_sharing={3: 1}),
    "small": Preset(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32,
                    intermediate_size=688, vocab_size=1024, max_positions=2048,
                    ranks=((40, 32), (36, 40)), indexer_heads=4, indexer_dim=32, sparse_top_k=32,
                    sink_tokens=2, sparse_window=4, kv_sharing={5: 2, 7: 3},
                    tie_word_embeddings=True),
    "1b": Preset(hidden_size=2048, num_layers=20, num_heads=32, num_kv_heads=8, head_dim=64,
                 intermediate_size=5632, vocab_size=32000, max_positions=4096,
                 ranks=((160, 128), (144, 144)), indexer_heads=4, indexer_dim=64, sparse_top_k=64,
                 sink_tokens=4, sparse_window=8, kv_sharing={9: 4, 14: 8, 18: 12, 19: 12},
                 torch_dtype="float16", max_shard_bytes=1 << 30),
}


def preset_config(p: Preset) -> ModelConfig:
    shared = tuple(sorted(set(p.kv_sharing.values())))
    gsm = GSMParams(sparse_window=p.sparse_window, max_sparse_window=max(8, p.sparse_window),
                    sparse_top_k=p.sparse_top_k, sink_tokens=p.sink_tokens,
                    indexer_heads=p.indexer_heads, indexer_dim=p.indexer_dim,
                    kv_compression_ratio=round(2 * p.num_kv_heads * p.head_dim / sum(p.ranks[0]), 3),
                    shared_layers=shared, kv_sharing=dict(p.kv_sharing))
    return ModelConfig(hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                       num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads,
                       num_key_value_heads=p.num_kv_heads, head_dim=p.head_dim,
                       vocab_size=p.vocab_size, max_position_embeddings=p.max_positions,
                       tie_word_embeddings=p.tie_word_embeddings, torch_dtype=p.torch_dtype, gsm=gsm)


def preset_ranks(p: Preset, cfg: ModelConfig) -> dict[int, tuple[int, int]]:
    return {i: p.ranks[j % len(p.ranks)] for j, i in enumerate(cfg.owning_layers)}


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """Generator of one tensor: depends on (seed, name) only, never on write order."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, digest])


def _orthonormal(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] with orthonormal columns (rows >= cols) or rows (rows < cols).

    Householder reflections of Gaussian vectors applied to [I; 0] (Stewart's construction of a
    random orthogonal matrix), in plain ufuncs: LAPACK's QR runs on multithreaded OpenBLAS, which
    on a busy 2-core machine made the 1b preset's factors 100x slower (130 s instead of 1 s).
    """
    m, r = max(rows, cols), min(rows, cols)
    vs = [rng.standard_normal(m - j) for j in range(r)]
    q = np.zeros((m, r))
    q[:r, :r] = np.eye(r)
    for j in reversed(range(r)):  # H_0 H_1 ... H_{r-1} [I; 0]; H_j only touches q[j:, j:]
        v = vs[j]
        v[0] += math.copysign(math.sqrt(float((v * v).sum())), v[0])
        v /= math.sqrt(float((v * v).sum()))
        sub = q[j:, j:]
        sub -= np.multiply.outer(2 * v, (v[:, None] * sub).sum(axis=0))
    return (q if rows >= cols else q.T).astype(np.float32)


def _tensor(seed: int, spec: TensorSpec, cfg: ModelConfig) -> np.ndarray:
    """The synthetic value of one tensor, chosen by the tensor's role in its name."""
    rng = tensor_rng(seed, spec.name)
    n = spec.name
    if n.endswith("layernorm.weight") or n == names.FINAL_NORM:
        return np.ones(spec.shape, np.float32)
    if n.endswith("kv_projector.bias"):
        return np.zeros(spec.shape, np.float32)
    if n.endswith("kv_projector.weight"):
        # std 1/sqrt(r_in) keeps projected K/V at the latents' scale
        return (rng.standard_normal(spec.shape, np.float32) / np.float32(math.sqrt(spec.shape[1])))
    if "_svd_U." in n or "_svd_Vt." in n:
        return _orthonormal(rng, *spec.shape)
    if "_svd_S." in n:
        # Decaying positive spectrum at the scale of a N(0, 0.02) [kvD, H] matrix's singular values
        r = spec.shape[0]
        top = INIT_STD * (math.sqrt(cfg.hidden_size) + math.sqrt(cfg.kv_dim))
        return (top * np.linspace(1.0, 0.3, r) * rng.uniform(0.95, 1.05, r)).astype(np.float32)
    a = rng.standard_normal(spec.shape, np.float32)
    # An untied head of std 1/sqrt(H) gives logits of std ~1 (as trained models have) instead
    # of ~0.02*sqrt(H): greedy-decoding tests then rarely meet near-ties that fp16 could flip.
    a *= np.float32(1 / math.sqrt(cfg.hidden_size) if n == names.LM_HEAD else INIT_STD)
    return a


def synth_specs(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], dtype: str) -> list[TensorSpec]:
    """Tensor specs in file order: embeddings, then layer by layer, then final norm and head."""
    shapes = names.expected_shapes(cfg, ranks)
    head = [names.EMBED]
    tail = [names.FINAL_NORM] + ([] if cfg.tie_word_embeddings else [names.LM_HEAD])
    middle = [n for n in shapes if n not in head and n not in tail]
    return [TensorSpec(n, shapes[n], dtype) for n in head + middle + tail]


def synth_checkpoint(preset: str, out: str | Path, seed: int = 0, overwrite: bool = False, *,
                     max_shard_bytes: int | None = None, progress: bool = False) -> Path:
    """Write the seeded random checkpoint of `preset` to `out` (atomically); return `out`.

    `max_shard_bytes` overrides the preset's shard limit (tests use it to get a sharded tiny).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    from gsm.tokenizer import demo_tokenizer_json

    p = PRESETS[preset]
    cfg = preset_config(p)
    specs = synth_specs(cfg, preset_ranks(p, cfg), _ST_DTYPE[cfg.torch_dtype])
    return write_checkpoint(out, cfg, KVQuantConfig(), specs, lambda s: _tensor(seed, s, cfg),
                            files=CheckpointFiles(tokenizer_json=demo_tokenizer_json(cfg.vocab_size)),
                            max_shard_bytes=max_shard_bytes or p.max_shard_bytes,
                            overwrite=overwrite, progress=progress)


def synth_command(preset: str, out: str | Path, seed: int = 0, overwrite: bool = False) -> int:
    """CLI body: check --out before any work, write the checkpoint, print a one-line summary.

    Refusals raise ValueError (gsm.cli_support turns them into one error line and exit 2).
    """
    from gsm.outputs import check_output_dir

    check_output_dir(Path(out), flag="--out", overwrite=overwrite)
    path = synth_checkpoint(preset, out, seed=seed, overwrite=overwrite, progress=sys.stderr.isatty())
    p = PRESETS[preset]
    cfg = preset_config(p)
    n_params = sum(math.prod(s) for s in names.expected_shapes(cfg, preset_ranks(p, cfg)).values())
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"wrote {path}: preset {preset}, seed {seed}, {n_params:,} parameters, "
          f"{size / 2**20:,.1f} MiB")
    return 0
