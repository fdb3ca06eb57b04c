"""The build summary's lines about weights: what they are on the device, and what the bundle is on disk.

The two differ and both matter: on the device (the TensorRT plan) the weights are FP16 or the quantised codes
the flags asked for; on disk `weights.bin` holds what every graph of the bundle reads (float32 where a graph
computes in float32, and each quantised form once). So the summary names each with its own size, and the
disk figures are the files' own sizes, read after the bundle was renamed into place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builder.plan import DEFAULT_WEIGHTS, fmt_bytes
from gsm.bundle_format import FILES

WEIGHTS_ON_DISK = "the graphs' weights: float32 where they compute in float32, each quantised form once"


def weights_words(w: dict[str, Any]) -> str:
    """`projections FP16, embedding / LM head FP16, GSM side FP16 (--weights fp16: the default)` from the report's
    `weights` record."""
    if w["format"] == "fp16":
        proj = "FP16"
    else:
        group = f" g{w['group_size']}" if w.get("group_size") is not None else " per channel"
        proj = w["format"].upper() + group + (f" {w['int4_grid']}" if w["format"] == "int4" else "")
    head, gsm_side = w.get("head_weights", "fp16").upper(), w.get("gsm_weights", "fp16").upper()
    why = w.get("why", f"--weights {w['format']}")
    if w.get("requested") == DEFAULT_WEIGHTS:
        why += ": the default"
    ratio = f", {w['ratio_vs_fp16']:.1%} of FP16" if w["format"] != "fp16" or head != "FP16" or gsm_side != "FP16" \
        else ""
    return f"projections {proj}, embedding / LM head {head}, GSM side {gsm_side} ({why}{ratio})"


def disk_line(bundle: Path, files: list[str]) -> str:
    """`on disk: 571.23 MiB in 18 files: weights.bin 564.85 MiB (...), ...`, largest first, each file's own size."""
    sizes = {name: (Path(bundle) / name).stat().st_size for name in files}
    listed = ", ".join(f"{name} {fmt_bytes(n)}" + (f" ({WEIGHTS_ON_DISK})" if name == FILES.weights else "")
                       for name, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"on disk: {fmt_bytes(sum(sizes.values()))} in {len(sizes)} files: {listed}"
