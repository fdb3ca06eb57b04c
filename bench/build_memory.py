"""Peak RSS of `python -m builder build` on the 1b synthetic checkpoint vs its bytes and largest tensor.

Why: the issue's bound is peak RSS <= largest tensor + 512 MB whatever the model size (TensorRT-Edge-LLM
needs 3-4x the parameter bytes). The build runs in a child of a fresh helper process, so
RUSAGE_CHILDREN of that helper is the build's own peak, not the synthesiser's.

    python bench/build_memory.py                       # synthesises the 1b preset (~2 GB) in a temp dir
    python bench/build_memory.py --checkpoint DIR      # any GSM checkpoint
    python bench/build_memory.py --keep out/bench      # keep checkpoint and bundle there
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLACK = 512 * 2**20
_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "r = subprocess.run(sys.argv[1:]); dt = time.perf_counter() - t; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, dt, r.returncode)")
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def checkpoint_figures(d: Path) -> tuple[int, int, str]:
    """(bytes of the weight files, bytes of the largest tensor as stored, its name)."""
    from gsm.checkpoint import CheckpointTensors

    t = CheckpointTensors(d)
    sizes = {n: _ITEMSIZE[t.dtype(n)] * int(__import__("math").prod(t.shape(n))) for n in t.names}
    big = max(sizes, key=sizes.__getitem__)
    files = sum(p.stat().st_size for p in d.iterdir() if p.suffix == ".safetensors")
    return files, sizes[big], big


def measure(checkpoint: Path, out: Path, device: str) -> dict[str, float | int | str]:
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "builder", "build", "--device", device,
           "--checkpoint", str(checkpoint), "--output", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    last = r.stdout.strip().splitlines()[-1].split()
    rss, seconds, rc = int(last[0]), float(last[1]), int(last[2])
    if rc != 0:
        raise SystemExit(f"build failed (exit {rc}):\n{r.stderr[-4000:]}")
    files, largest, name = checkpoint_figures(checkpoint)
    report = json.loads((out / "report.json").read_text())
    return {"peak_rss_bytes": rss, "build_seconds": round(seconds, 1), "checkpoint_bytes": files,
            "largest_tensor_bytes": largest, "largest_tensor": name, "rss_over_checkpoint": rss / files,
            "bound_bytes": largest + SLACK, "within_bound": rss <= largest + SLACK,
            "weights_bin_bytes": report["portable_weight_file_bytes"],
            "largest_array_held_bytes": report["largest_array_held_bytes"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="checkpoint to build (default: synthesise --preset)")
    p.add_argument("--preset", default="1b")
    p.add_argument("--device", default="orin")
    p.add_argument("--keep", type=Path, help="directory to keep the checkpoint and bundle in")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gsm-bench-") as tmp:
        work = args.keep or Path(tmp)
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = work / f"synth-{args.preset}"
            if not ckpt.exists():
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "gsm", "synth", "--preset", args.preset, "--out", str(ckpt)],
                               check=True, env=_env(), cwd=ROOT)
                print(f"synthesised {ckpt} in {time.perf_counter() - t:.0f} s")
        out = work / f"bundle-{args.preset}-{args.device}"
        if out.exists():
            raise SystemExit(f"{out} exists; remove it first")
        m = measure(ckpt, out, args.device)
    mib = 2**20
    print(f"checkpoint      {m['checkpoint_bytes'] / mib:10,.1f} MiB  ({ckpt})")
    print(f"largest tensor  {m['largest_tensor_bytes'] / mib:10,.1f} MiB  ({m['largest_tensor']})")
    print(f"peak RSS        {m['peak_rss_bytes'] / mib:10,.1f} MiB  = {m['rss_over_checkpoint']:.3f} x checkpoint")
    print(f"bound           {m['bound_bytes'] / mib:10,.1f} MiB  (largest tensor + 512 MiB): "
          f"{'within' if m['within_bound'] else 'EXCEEDED'}")
    print(f"weights.bin     {m['weights_bin_bytes'] / mib:10,.1f} MiB  (fp32); largest array held "
          f"{m['largest_array_held_bytes'] / mib:.1f} MiB")
    print(f"build time      {m['build_seconds']:10,.1f} s")
    print(json.dumps(m))
    return 0 if m["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
