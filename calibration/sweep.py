"""`--sweep`: every grid candidate on calibration *and* held-out text, and what each budget would pick.

The search measures candidates only up to the first cost level that passes, on calibration text;
whether "within budget" survives on held-out text is a property of the data and the noise, not of
the search. The sweep measures it: each candidate's relative perplexity increase (and bound, and
KL) on both texts, then replays the search (tiers.choose_fractions on the cached calibration
scores) for a list of budgets and reports the held-out increase of each choice. It costs one
deployed run per candidate and text, so it is an option for documentation runs, not the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from calibration.measure import Evaluator, Fractions, kv_bytes_per_position, relative_increase
from calibration.tiers import choose_fractions
from gsm.golden.weights import KVCalibration
from gsm.progress import track

BUDGETS = (0.0, 0.0001, 0.0003, 0.001, 0.003, 0.01)


def sweep(search: Evaluator, held: Evaluator, calib: KVCalibration, candidates: list[Fractions], *, z: float,
          budgets: tuple[float, ...] = BUDGETS, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    rows = []
    todo = [(calib, f) for f in candidates]
    with track("sweep", total=search.decode_units(len(todo)) + held.decode_units(len(todo)), unit="decode steps",
               log=progress) as advance:
        on_calib = dict(zip(candidates, search.deployed_many(todo, advance)))
        on_held = dict(zip(candidates, held.deployed_many(todo, advance)))
    for f in candidates:
        c, h = on_calib[f], on_held[f]
        rows.append({"tier_fractions": list(f), "kv_bytes_per_position": kv_bytes_per_position(search.weights, f),
                     "calib_relative_increase": relative_increase(c, search.exact),
                     "calib_upper_bound": relative_increase(c, search.exact, z),
                     "heldout_relative_increase": relative_increase(h, held.exact),
                     "heldout_upper_bound": relative_increase(h, held.exact, z),
                     "heldout_mean_kl": h.mean_kl})
        progress(f"sweep {list(f)}: calibration {rows[-1]['calib_relative_increase']:+.4%}, held-out "
                 f"{rows[-1]['heldout_relative_increase']:+.4%}")
    choices = []
    for b in budgets:
        ch = choose_fractions(lambda f: on_calib[f], search.exact, b, candidates, z=z)
        h = on_held[tuple(ch.fractions)]
        rel = relative_increase(h, held.exact)
        choices.append({"error_budget": b, "tier_fractions": list(ch.fractions), "budget_met_on_calibration":
                        ch.budget_met, "kv_bytes_per_position": kv_bytes_per_position(search.weights, ch.fractions),
                        "heldout_relative_increase": rel, "heldout_within_budget": rel <= b})
    return {"candidates": rows, "choices": choices, "confidence_z": z}


def print_sweep(sw: dict[str, Any]) -> None:
    from rich.table import Table

    from gsm.cli_support import console

    con = console()
    if not con.is_terminal:
        con.width = 160
    t = Table(title="sweep: every candidate on calibration and held-out text")
    for col in ("tier fractions", "KV B/position", "calib vs exact", "calib bound", "held-out vs exact",
                "held-out bound", "held-out KL"):
        t.add_column(col)
    for r in sw["candidates"]:
        t.add_row("/".join(f"{x:g}" for x in r["tier_fractions"]), f"{r['kv_bytes_per_position']:.1f}",
                  f"{r['calib_relative_increase']:+.4%}", f"{r['calib_upper_bound']:+.4%}",
                  f"{r['heldout_relative_increase']:+.4%}", f"{r['heldout_upper_bound']:+.4%}",
                  f"{r['heldout_mean_kl']:.2e}")
    con.print(t)
    t = Table(title=f"what each budget picks (bound: z = {sw['confidence_z']:g}) and its held-out increase")
    for col in ("budget", "chosen", "met on calibration", "KV B/position", "held-out vs exact", "within on held-out"):
        t.add_column(col)
    for c in sw["choices"]:
        t.add_row(f"{c['error_budget']:.2%}", "/".join(f"{x:g}" for x in c["tier_fractions"]),
                  "yes" if c["budget_met_on_calibration"] else "no", f"{c['kv_bytes_per_position']:.1f}",
                  f"{c['heldout_relative_increase']:+.4%}", "yes" if c["heldout_within_budget"] else "NO")
    con.print(t)
