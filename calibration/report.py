"""What the calibration achieved: per-latent errors on held-out rows, the model table, the screen.

Per owning layer and latent, on latent rows of the held-out text (float32, as exact mode makes
them; the INT tiers quantise their FP16 rounding, as the cache does):
- scale ranges (min/max over channels of scale_int8, scale_int12),
- per tier: worst |error|, mean |error|, relative RMS error ||x - x^||/||x||, and bias (mean over
  channels of |mean error of the channel|: what the compensation targets),
- INT8 with and without the compensation, and with the naive per-tensor scale,
- saturation: share of values beyond the INT8 range (clipped).
"""

from __future__ import annotations

from typing import Any

import torch

from calibration.scales import quant_error
from gsm.golden.quant import INT4, INT8, INT12, round_fp16
from gsm.golden.weights import LatentScales


def error_stats(err: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """err, x: [N, r]. Worst and mean |err|, relative RMS, and mean per-channel |bias|."""
    e = err.double()
    return {"max_abs": float(e.abs().max()), "mean_abs": float(e.abs().mean()),
            "rel_rms": float(e.norm() / x.double().norm().clamp_min(1e-30)),
            "bias": float(e.mean(dim=0).abs().mean())}


def split_half_ratio(rows: torch.Tensor) -> float | None:
    """Largest per-channel ratio abs-max(second half) / abs-max(first half) of calibration rows.

    How far text not yet seen exceeded the maximum seen so far: the evidence for INT12's headroom
    (scales.INT12_HEADROOM), measured on calibration text alone. None for fewer than 2 rows.
    """
    n = rows.shape[0] // 2
    if n < 1:
        return None
    a, b = rows[:n].abs().amax(0), rows[n:].abs().amax(0)
    ok = a > 0
    return float((b[ok] / a[ok]).max()) if bool(ok.any()) else None


def latent_errors(x: torch.Tensor, cal: LatentScales, naive: LatentScales) -> dict[str, Any]:
    """Errors of every tier of one latent on rows x [N, r] (float32 latents)."""
    x16 = round_fp16(x)
    comp = cal.comp_int8
    sat = (x16.abs() > 127 * cal.scale_int8).float().mean()
    return {
        "rows": int(x.shape[0]), "rank": int(x.shape[1]),
        "scale_int8": [float(cal.scale_int8.min()), float(cal.scale_int8.max())],
        "scale_int12": [float(cal.scale_int12.min()), float(cal.scale_int12.max())],
        "scale_int8_per_tensor": float(naive.scale_int8[0]),
        "comp_int8_max_abs_steps": float((comp.abs() / cal.scale_int8).max()),
        "int8_saturation": float(sat),
        "fp16": error_stats(x - x16, x),
        "int12": error_stats(x - x16 + quant_error(x16, cal.scale_int12, INT12), x),
        "int8_no_comp": error_stats(x - x16 + quant_error(x16, cal.scale_int8, INT8), x),
        "int8": error_stats(x - x16 + quant_error(x16, cal.scale_int8, INT8, comp), x),
        "int8_per_tensor": error_stats(x - x16 + quant_error(x16, naive.scale_int8, INT8), x),
        "int4": error_stats(x - x16 + quant_error(x16, cal.scale_int4, INT4, cal.comp_int4), x),
    }


def print_report(report: dict[str, Any]) -> None:
    """Rich tables on stderr: per latent, then the whole model."""
    from rich.table import Table

    from gsm.cli_support import console

    con = console()
    if not con.is_terminal:
        con.width = 160  # logs and pipes: keep each table row on one line
    layers = report.get("layers")
    if layers:
        t = Table(title=f"latent quantisation error on held-out rows ({report['method']} scales)")
        for col in ("layer", "r", "scale_int8 range", "INT12 rel", "INT8 rel no comp→comp",
                    "INT8 bias no comp→comp", "INT8 worst", "per-tensor INT8 rel", "clipped", "INT4 rel"):
            t.add_column(col)
        for row in layers:
            e = row
            t.add_row(f"{e['layer']}.{e['latent']}", str(e["rank"]),
                      f"{e['scale_int8'][0]:.2e}…{e['scale_int8'][1]:.2e}",
                      f"{e['int12']['rel_rms']:.1e}",
                      f"{e['int8_no_comp']['rel_rms']:.2e}→{e['int8']['rel_rms']:.2e}",
                      f"{e['int8_no_comp']['bias']:.1e}→{e['int8']['bias']:.1e}",
                      f"{e['int8']['max_abs']:.2e}",
                      f"{e['int8_per_tensor']['rel_rms']:.2e}", f"{e['int8_saturation']:.1e}",
                      f"{e['int4']['rel_rms']:.2e}" if "int4" in e else "")
        con.print(t)
    ch = report["choice"]
    if ch["fixed"]:
        con.print(f"tier fractions fixed by --tier-fractions: {ch['tier_fractions']}")
    else:
        con.print(f"tier fractions chosen on calibration text: {ch['tier_fractions']} "
                  f"(budget {ch['error_budget']:.2%}, {'met' if ch['budget_met'] else 'NOT met'}; "
                  f"{len(ch['trials'])} candidates measured)")
    m = report.get("model")
    if not m:
        con.print("no held-out data: no whole-model quality table (pass --eval-data and --eval-samples > 0)")
    else:
        t = Table(title=f"whole model on {m['where']} ({m['sequences']} sequences, {m['tokens']} decoded "
                  f"tokens; prefill {m['protocol']['prefill_len']}, re-tier every "
                  f"{m['protocol']['adaptation_rate']} steps)")
        for col in ("configuration", "tier fractions", "KV B/position", "perplexity", "vs exact", "upper bound",
                    "KL(exact‖·)"):
            t.add_column(col)
        for r in m["rows"]:
            fr = "" if r["tier_fractions"] is None else "/".join(f"{f:g}" for f in r["tier_fractions"])
            rel = "" if r["relative_increase"] is None else f"{r['relative_increase']:+.4%}"
            ub = "" if r["upper_bound"] is None else f"{r['upper_bound']:+.4%}"
            kl = "" if r["mean_kl"] is None else f"{r['mean_kl']:.2e}"
            t.add_row(r["name"], fr, f"{r['kv_bytes_per_position']:.1f}", f"{r['perplexity']:.4f}", rel, ub, kl)
        con.print(t)
        held = m.get("chosen_within_budget")
        if held is not None:
            con.print(f"chosen fractions on held-out text: {'within' if held else 'OUTSIDE'} the budget")
    con.print(f"wrote {report['output']} in {report['seconds']:.1f} s")
