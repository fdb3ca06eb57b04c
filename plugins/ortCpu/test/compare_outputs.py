"""Compare cachedAttentionCheck output files (plugins/ortCpu/test/cachedAttentionCheck.cpp) of different kernel builds.

usage: compare_outputs.py REFERENCE OTHER [OTHER ...]

`selected` must be identical; every float tensor must agree within --rtol (default 1e-5) of the reference tensor's
max |value| (the kernels' blocked FMA sums differ from the baseline's order only at float32 rounding). Prints the
worst deviation per case and tensor. Exit 0 all agree, 1 a mismatch, 2 a file that cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

MAGIC = b"GSMCHK1\n"
DTYPES = {"f4": np.dtype("<f4"), "i4": np.dtype("<i4")}


def read_outputs(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """(kernel name, {case/tensor: array}) of one output file; ValueError naming the file when malformed."""
    tensors: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        if f.readline() != MAGIC:
            raise ValueError(f"{path}: not a cachedAttentionCheck output (no {MAGIC!r} header)")
        head = f.readline().split()
        if len(head) != 2 or head[0] != b"kernels":
            raise ValueError(f"{path}: second line should be 'kernels <name>'")
        kernels = head[1].decode()
        while line := f.readline():
            parts = line.decode().split()
            if len(parts) < 3 or parts[1] not in DTYPES or len(parts) != 3 + int(parts[2]):
                raise ValueError(f"{path}: bad tensor header {line!r}")
            shape = tuple(int(x) for x in parts[3:])
            dt = DTYPES[parts[1]]
            n = int(np.prod(shape, dtype=np.int64))
            data = f.read(n * dt.itemsize)
            if len(data) != n * dt.itemsize:
                raise ValueError(f"{path}: {parts[0]} is truncated")
            tensors[parts[0]] = np.frombuffer(data, dt).reshape(shape)
    return kernels, tensors


def compare(ref: dict[str, np.ndarray], other: dict[str, np.ndarray], rtol: float) -> tuple[list[str], list[str]]:
    """(report lines, failure lines) of `other` against `ref`."""
    lines, failures = [], []
    for name in sorted(set(ref) | set(other)):
        if name not in ref or name not in other:
            failures.append(f"{name}: only in {'the reference' if name in ref else 'the other file'}")
            continue
        a, b = ref[name], other[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"{name}: shape/dtype {b.shape} {b.dtype}, reference {a.shape} {a.dtype}")
            continue
        if a.dtype.kind == "i":
            bad = np.argwhere(a != b)
            lines.append(f"  {name:40s} {'identical' if bad.size == 0 else f'{len(bad)} differ'}")
            if bad.size:
                i = tuple(int(x) for x in bad[0])
                failures.append(f"{name}: {len(bad)} entries differ, first at {list(i)}: {b[i]} vs reference {a[i]}")
            continue
        scale = float(np.max(np.abs(a))) if a.size else 0.0
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        finite = np.isfinite(a) == np.isfinite(b)
        worst = float(diff.max()) if a.size else 0.0
        rel = worst / scale if scale > 0 else (0.0 if worst == 0 else np.inf)
        at = [int(x) for x in np.unravel_index(int(np.argmax(diff)), a.shape)] if a.size else []
        lines.append(f"  {name:40s} max|ref| {scale:10.4g}  worst |diff| {worst:10.3g}  rel {rel:9.3g}  at {at}")
        if not finite.all() or not np.isfinite(worst) or rel > rtol:
            failures.append(f"{name}: worst deviation {worst:.3g} = {rel:.3g} of max|ref| {scale:.4g} at {at} "
                            f"(tolerance {rtol:g})")
    return lines, failures


def worst_per_tensor(ref: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict[str, float]:
    """Largest relative deviation over the cases, per tensor kind (attn_out, ...)."""
    out: dict[str, float] = {}
    for name, a in ref.items():
        if a.dtype.kind != "f" or name not in other or other[name].shape != a.shape or not a.size:
            continue
        scale = float(np.max(np.abs(a)))
        rel = float(np.max(np.abs(a.astype(np.float64) - other[name]))) / scale if scale else 0.0
        kind = name.split("/")[-1]
        out[kind] = max(out.get(kind, 0.0), rel)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("others", type=Path, nargs="+")
    ap.add_argument("--rtol", type=float, default=1e-5, help="tolerance relative to each tensor's max |value|")
    args = ap.parse_args(argv)
    try:
        ref_name, ref = read_outputs(args.reference)
        others = [(p, *read_outputs(p)) for p in args.others]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = False
    for path, name, other in others:
        print(f"== {name} ({path.name}) vs {ref_name} ({args.reference.name})")
        lines, failures = compare(ref, other, args.rtol)
        print("\n".join(lines))
        summary = ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst_per_tensor(ref, other).items()))
        print(f"  worst relative deviation per tensor: {summary}")
        for f in failures:
            print(f"MISMATCH {name}: {f}")
        failed |= bool(failures)
    print("FAILED: the kernel builds disagree" if failed else "ok: all kernel builds agree")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
