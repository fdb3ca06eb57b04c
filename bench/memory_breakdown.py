"""Where a sequence's process memory goes on a real bundle (or a batch's: --batch N sequences prefilled and decoded
together, a bundle built with --max-batch N), from start to decode after a long prompt: RSS after the imports, the
load and the tokenizer's first use; the cache buffers the backend allocated and how much of them is resident, against
plan.json; RSS after the prefill and the largest transient of one prefill call and of one re-tier pass (its peak
above what it leaves); what the first decode step gives back (a prefill call's scratch); RSS after decoding; the
process's peak. The figures behind docs/runtime.md "Where it stands" (peak RSS at 8K beside llama.cpp's).

    python bench/memory_breakdown.py --bundle B [--context 8000] [--batch 1] [--decode 64] [--threads 2]

One process, greedy. Peaks come from VmHWM, reset before each call (/proc/self/clear_refs) and kept over the run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # its helpers
from proc_status import proc_status_mib  # noqa: E402

MiB = 1 << 20


PEAK = [0.0]  # the process's VmHWM over the whole run (reset_peak restarts the kernel's)


def reset_peak() -> None:
    PEAK[0] = max(PEAK[0], proc_status_mib("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_now() -> str:
    """Resident MiB now, as a table cell."""
    return f"{proc_status_mib('VmRSS'):.0f}"


def peak() -> float:
    return max(PEAK[0], proc_status_mib("VmHWM"))


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def resident_bytes(addr: int, nbytes: int) -> int:
    """Bytes of [addr, addr + nbytes) in resident pages (mincore)."""
    page = mmap.PAGESIZE
    start = addr - addr % page
    pages = (addr + nbytes - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        return -1
    return sum(v & 1 for v in vec) * page


class Peaks:
    """Per wrapped method of one class, the largest transient of a call: its VmHWM above the RSS it leaves."""

    def __init__(self, cls, names: tuple[str, ...]) -> None:
        self.transient: Counter[str] = Counter()
        for name in names:
            orig = getattr(cls, name)

            def wrapped(obj, *a, _orig=orig, _name=name, **k):
                reset_peak()
                out = _orig(obj, *a, **k)
                left = proc_status_mib("VmHWM") - proc_status_mib("VmRSS")
                self.transient[_name] = max(self.transient[_name], left)
                return out

            setattr(cls, name, wrapped)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--batch", type=int, default=1, help="sequences at once (each its own text)")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "data" / "tinystories_eval.txt")
    a = p.parse_args()

    def row(what: str, figure: str) -> None:
        print(f"| {what} | {figure} |", flush=True)

    print("| stage | MiB |\n| --- | --- |")
    row("python", rss_now())
    import numpy as np  # noqa: F401
    import onnxruntime  # noqa: F401

    row("+ numpy, onnxruntime", rss_now())
    from decode_speed import BATCH_TEXT_OFFSET, context_ids

    import runtime
    from runtime.ort_backend import OrtBackend

    row("+ runtime", rss_now())
    t = time.perf_counter()
    rt = runtime.load(a.bundle, threads=a.threads)
    be = rt.backend
    if not isinstance(be, OrtBackend) or be.pools is None:
        p.error(f"{a.bundle}: the breakdown is of the onnxruntime backend over model.cpu.onnx")
    row(f"loaded ({time.perf_counter() - t:.1f} s; load peak {proc_status_mib('VmHWM'):.0f})", rss_now())
    # the texts decode_speed's batch row times
    prompts = [context_ids(rt, a.text, a.context, offset=BATCH_TEXT_OFFSET * i) for i in range(a.batch)]
    row("+ tokenizer, first use", rss_now())
    kinds: Counter[str] = Counter()
    for name, buf in be.buffers.items():
        kinds[name.split(".")[0]] += buf.nbytes
    plan = json.loads((a.bundle / "plan.json").read_text())
    peaks = Peaks(OrtBackend, ("forward", "demote"))
    seqs = [rt.new_sequence() for _ in range(a.batch)]
    reset_peak()
    t = time.perf_counter()
    logits = rt.prefill_batch(seqs, prompts)
    prefill_s = time.perf_counter() - t
    after_prefill = proc_status_mib("VmRSS")
    row(f"prefilled {a.batch} x {a.context} tokens ({prefill_s:.1f} s)", f"{after_prefill:.0f}")
    row("largest transient of one prefill call / one re-tier pass (its peak above what it leaves)",
        f"{peaks.transient['forward']:.1f} / {peaks.transient['demote']:.1f}")
    resident = Counter()
    for name, buf in be.buffers.items():
        resident[name.split(".")[0]] += resident_bytes(buf.__array_interface__["data"][0], buf.nbytes)
    logits = rt.decode_batch(seqs, [int(x.argmax()) for x in logits])
    row("after the first decode step (a prefill call's scratch given back)", rss_now())
    for _ in range(a.decode - 1):
        logits = rt.decode_batch(seqs, [int(x.argmax()) for x in logits])
    row(f"after {a.decode} decode steps", rss_now())
    row("process peak", f"{peak():.0f}")
    print(f"\nweights (plan.json weight_bytes): {plan['weight_bytes'] / MiB:.1f} MiB")
    print("| cache buffer | allocated MiB | resident MiB after the prefill |\n| --- | --- | --- |")
    for k, v in kinds.items():
        print(f"| {k} | {v / MiB:.1f} | {resident[k] / MiB:.1f} |")
    print(f"| all | {sum(kinds.values()) / MiB:.1f} | {sum(resident.values()) / MiB:.1f} |")
    per_pos = plan["kv_bytes_per_position"]
    nb = plan["max_batch"]
    print(f"plan.json: cpu_kv_bytes {plan['cpu_kv_bytes'] / MiB:.1f} MiB for {nb} sequence(s) at max-seq "
          f"{plan['max_seq']} ({plan['cpu_kv_bytes'] / nb / MiB:.1f} each, row caches "
          f"{plan['row_cache_bytes'] / MiB:.1f}), "
          f"kv_bytes_per_position {per_pos:.0f} = {per_pos / plan['dense_fp16_bytes_per_position']:.3f}x dense FP16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
