"""Choosing tier_fractions: the cheapest split whose deployed-mode perplexity stays within budget.

Candidates are the fractions (f0, f1, f2, f3) of FP16, INT12, INT8 and INT4 on a grid of `step`
(default 1/4) summing to 1 (three fractions, f3 = 0, when INT4 is left out). Cost is spec 6's average
bytes per latent value, 2 f0 + 1.5 f1 + f2 + 0.5 f3, which orders every model's bytes per position the
same way. Candidates are measured in order of increasing cost; all candidates of one
cost are measured, and the search stops at the first cost level where some candidate's relative
perplexity increase over exact mode is <= budget, with margin: estimate + z standard errors over
the measured sequences (z = 2 by default), so noise of a few sequences does not pick it. Among
those, the lowest perplexity wins (then more FP16: the safer row set). If no candidate meets the
budget, all-FP16 (the most expensive) is returned and marked as not meeting it.

The search is exhaustive over the grid up to the chosen cost, so "cheapest within budget" holds on
the calibration sequences it measured; whether it still holds on held-out text is reported, not
assumed (docs/calibration.md has the measured gap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from itertools import groupby
from typing import Any

from calibration.measure import Fractions, Score, relative_increase
from gsm.tiers import avg_bytes


def candidate_fractions(step: float, int4: bool = True) -> list[Fractions]:
    """Every (f0, f1, f2, f3) with components multiples of `step` (1/step an integer) summing to 1;
    without int4 every (f0, f1, f2) (a v1 triple: no INT4 rows)."""
    n = round(1.0 / step) if step > 0 else 0
    if n < 1 or abs(n * step - 1.0) > 1e-9:
        raise ValueError(f"--fraction-step must divide 1 (e.g. 0.25, 0.125), got {step}")
    out: list[Fractions] = []
    for a in range(n + 1):
        for b in range(n + 1 - a):
            for c in range(n + 1 - a - b) if int4 else (n - a - b,):
                f = (Fraction(a, n), Fraction(b, n), Fraction(c, n))
                out.append(tuple(float(x) for x in f) + ((float(1 - sum(f)),) if int4 else ()))
    return sorted(out, key=lambda f: (cost_key(f), -f[0]))


def cost_key(f: Fractions) -> float:
    """Average bytes per value, rounded so float noise of non-dyadic steps cannot split a cost level."""
    return round(avg_bytes(f), 9)


@dataclass
class Trial:
    fractions: Fractions
    avg_bytes_per_value: float
    perplexity: float
    relative_increase: float
    upper_bound: float  # relative increase + z standard errors: what is compared with the budget
    mean_kl: float
    within_budget: bool

    def to_json(self) -> dict[str, Any]:
        return {"tier_fractions": list(self.fractions), "avg_bytes_per_value": self.avg_bytes_per_value,
                "perplexity": self.perplexity, "relative_increase": self.relative_increase,
                "upper_bound": self.upper_bound, "mean_kl": self.mean_kl, "within_budget": self.within_budget}


@dataclass
class Choice:
    fractions: Fractions
    budget: float
    budget_met: bool
    trials: list[Trial]


def choose_fractions(measure: Callable[[Fractions], Score], exact: Score, budget: float,
                     candidates: list[Fractions], *, z: float = 2.0,
                     progress: Callable[[str], None] = lambda _: None) -> Choice:
    """Cheapest candidate whose relative perplexity increase over exact mode is within `budget`.

    With z > 0 the increase must hold with margin: its upper bound, estimate + z standard errors
    over sequences (measure.relative_increase), must be <= budget, so a candidate does not pass
    on the luck of the few sequences measured.
    """
    if budget < 0:
        raise ValueError(f"--error-budget must be >= 0, got {budget}")
    trials: list[Trial] = []
    for cost, group in groupby(candidates, key=cost_key):
        level = []
        for f in group:
            s = measure(f)
            rel, ub = relative_increase(s, exact), relative_increase(s, exact, z)
            t = Trial(f, cost, s.perplexity, rel, ub, s.mean_kl, ub <= budget)
            progress(f"fractions {list(f)}: {cost:.3f} B/value, perplexity {s.perplexity:.4f} ({rel:+.4%}, "
                     f"bound {ub:+.4%})")
            level.append(t)
        trials += level
        ok = [t for t in level if t.within_budget]
        if ok:
            best = min(ok, key=lambda t: (t.perplexity, -t.fractions[0]))
            return Choice(best.fractions, budget, True, trials)
    fp16 = max(candidates, key=lambda f: f[0])
    return Choice(fp16, budget, False, trials)
