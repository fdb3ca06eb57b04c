"""The golden probe of a bundle: the golden model, in the bundle's deployed mode and on the bundle's own weights, run
on a fixed probe, its outputs stored in golden_probe.npz (gsm.probe_format; docs/verify.md).

The probe (`plan_cases`): the fixed prose of builder.probe_text as the bundle's tokenizer encodes it (seeded random
ids for a bundle without one), PROBE_TOKENS tokens or fewer where max-seq is shorter, prefilled in at least two
calls (a re-tier pass ends each, so the second call reads demoted rows), then TEXT_NEW_TOKENS greedy tokens; and,
where the bundle has a chat template, one rendered user turn and CHAT_NEW_TOKENS tokens. The golden makes exactly
the runtime's calls (the same chunks, a re-tier pass after each prefill call and every rate-th decode step), so
every stored figure is what a correct engine computes, to its precision.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builder.probe_text import CHAT_MESSAGE, PROBE_TEXT
from builder.probe_weights import ProbeWeights
from builder.qlinear import BundleWeights
from gsm.bundle_format import FILES, BundleConfig
from gsm.checkpoint import CheckpointTensors
from gsm.config import KVQuantConfig, ModelConfig
from gsm.golden.model import GoldenModel
from gsm.golden.selection import boundary_gap
from gsm.golden.weights import KVCalibration, LatentScales
from gsm.probe_format import LOGIT_BYTES, PROBE_KNOBS, SELECTION_BYTES, GoldenProbe, ProbeRecord, write_probe
from gsm.quant_table import TABLE_ROWS

# sized for the plugin reference backend (numpy op by op) to run the whole probe of SmolLM2 in under 30 s on two cores
PROBE_TOKENS = 256  # the text case's prompt, at most
TEXT_NEW_TOKENS = 8
CHAT_NEW_TOKENS = 6
TEXT_CALLS = 2  # prefill calls of the text case, at least
SEL_ROWS_PER_CALL = 4  # query rows of each prefill call whose selections are stored (its last ones)
RANDOM_IDS_SEED = 0  # the prompt of a bundle without a tokenizer


@dataclass(frozen=True)
class CasePlan:
    """One probe sequence: its prompt, the prefill calls that feed it, how many tokens follow, and the query positions
    whose selections are stored."""

    case: str
    ids: tuple[int, ...]
    calls: tuple[int, ...]
    new_tokens: int
    sel_rows: tuple[int, ...]


@dataclass(frozen=True)
class GoldenKV:
    """The cache the bundle holds: its kv_quantization and the quantisation tables its graphs carry."""

    quant: KVQuantConfig
    tables: dict[int, np.ndarray]  # owning layer -> [5, r_k + r_v] (gsm.quant_table TABLE_ROWS)
    ranks: dict[int, tuple[int, int]]
    key_scales: dict[int, np.ndarray] | None = None  # INT8 indexer keys' scales

    def calibration(self) -> KVCalibration:
        """The golden's calibration holding exactly the tables' values."""
        scales = {}
        for l, tab in self.tables.items():
            rk, rv = self.ranks[l]
            for kind, cols in (("k", slice(0, rk)), ("v", slice(rk, rk + rv))):
                row = {w: torch.from_numpy(np.ascontiguousarray(tab[i, cols], np.float32))
                       for i, w in enumerate(TABLE_ROWS)}
                scales[(l, kind)] = LatentScales(row["scale_int8"], row["scale_int12"], row["comp_int8"],
                                                 row["scale_int4"], row["comp_int4"])
        keys = {l: torch.from_numpy(np.asarray(s, np.float32)) for l, s in (self.key_scales or {}).items()}
        return KVCalibration(scales, calibrated=True, index_key_scales=keys)


def split_calls(n: int, max_input: int, least: int) -> tuple[int, ...]:
    """n tokens in at least `least` calls (where n allows) of at most max_input, as even as possible."""
    parts = min(n, max(least, -(-n // max_input)))
    base, extra = divmod(n, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def selection_rows(calls: Sequence[int], new_tokens: int) -> tuple[int, ...]:
    """The last SEL_ROWS_PER_CALL query rows of each prefill call, and the first and last decode call's row."""
    rows, end = set(), 0
    for c in calls:
        rows |= set(range(max(end, end + c - SEL_ROWS_PER_CALL), end + c))
        end += c
    if new_tokens >= 2:
        rows |= {end, end + new_tokens - 2}
    return tuple(sorted(rows))


def plan_case(case: str, ids: Sequence[int], cfg: BundleConfig, new_tokens: int, least_calls: int) -> CasePlan | None:
    """The case within the bundle's max-seq (prompt cut to fit; None where not even one token and one new one fit)."""
    new = max(1, min(new_tokens, cfg.n_max - 1))
    ids = tuple(int(t) for t in ids[: cfg.n_max - new + 1])
    if not ids:
        return None
    calls = split_calls(len(ids), cfg.max_input, least_calls)
    return CasePlan(case, ids, calls, new, selection_rows(calls, new))


def plan_cases(bundle: Path, cfg: BundleConfig) -> list[CasePlan]:
    """The text case, and the chat case where the bundle has a chat template whose turn fits whole."""
    from runtime.text import TextCodec

    codec = TextCodec.load(bundle, cfg.bos_token_id, cfg.eos_token_id)
    if codec is None:
        text = np.random.default_rng(RANDOM_IDS_SEED).integers(0, cfg.vocab_size, PROBE_TOKENS).tolist()
    else:
        text = codec.encode(PROBE_TEXT)
    plans = [plan_case("text", text[:PROBE_TOKENS], cfg, TEXT_NEW_TOKENS, TEXT_CALLS)]
    if codec is not None and codec.has_chat_template:
        chat = codec.encode_chat([{"role": "user", "content": CHAT_MESSAGE}])
        plan = plan_case("chat", chat, cfg, CHAT_NEW_TOKENS, 1)
        if plan is not None and len(plan.ids) == len(chat):
            plans.append(plan)
    return [p for p in plans if p is not None]


@dataclass
class GoldenRun:
    """What the golden computed on one case: its tokens, each call's last-row logits and selection gap, the stored
    selections."""

    tokens: list[int]
    outputs: list[np.ndarray]  # [V] float32 per call
    gaps: list[float]  # per call: the smallest boundary_gap of its last row over owning layers
    selected: np.ndarray  # bool [Ls, Q, N]
    tiers: np.ndarray  # [4] rows per tier after the last call


class LastRowGap:
    """A golden score hook: the smallest top-k boundary gap of each call's last query row over owning layers."""

    def __init__(self) -> None:
        self.gap = float("inf")

    def __call__(self, layer: int, q_pos: torch.Tensor, scores: torch.Tensor, params: Any) -> None:
        self.gap = min(self.gap, float(boundary_gap(scores[-1:], q_pos[-1:], params)[0]))

    def take(self) -> float:
        gap, self.gap = self.gap, float("inf")
        return gap


@torch.no_grad()
def run_case(golden: GoldenModel, plan: CasePlan, layers: Sequence[int]) -> GoldenRun:
    """The case's calls on the golden, as the runtime makes them (runtime.verify replays them)."""
    n = len(plan.ids) + plan.new_tokens - 1
    rows = {r: q for q, r in enumerate(plan.sel_rows)}
    sel = np.zeros((len(layers), len(rows), n), bool)
    cache, outputs, gaps, pos = golden.new_cache(), [], [], 0
    hook = LastRowGap()
    golden.score_hooks.append(hook)

    def call(ids: list[int], decode: bool) -> None:
        nonlocal pos
        wanted = [r for r in range(pos, pos + len(ids)) if r in rows]
        step = golden.decode if decode else golden.prefill
        out = step(cache, ids[0], trace=bool(wanted)) if decode else step(cache, ids, trace=bool(wanted))
        for r in wanted:
            for j, l in enumerate(layers):
                m = out.trace.selected[l][r - pos].numpy()
                sel[j, rows[r], :m.size] = m
        outputs.append(out.logits[-1].numpy().astype(np.float32))
        gaps.append(hook.take())
        pos += len(ids)

    for c in plan.calls:
        call(list(plan.ids[pos:pos + c]), decode=False)
    tokens = [int(np.argmax(outputs[-1]))]
    while len(tokens) < plan.new_tokens:
        call([tokens[-1]], decode=True)
        tokens.append(int(np.argmax(outputs[-1])))
    tiers = np.bincount(cache.tier.numpy().astype(np.int64), minlength=4)[:4]
    golden.score_hooks.remove(hook)
    return GoldenRun(tokens, outputs, gaps, sel, tiers.astype(np.int32))


def stored_outputs(k: int, p: int) -> np.ndarray:
    """p of k outputs, spread evenly from the first to the last (all where p >= k, none where p is 0)."""
    if p >= k:
        return np.arange(k, dtype=np.int32)
    return np.unique(np.round(np.linspace(0, k - 1, p)).astype(np.int32)) if p > 0 else np.zeros(0, np.int32)


def to_record(plan: CasePlan, form: str, run: GoldenRun, logit_rows: int, layers: Sequence[int]) -> ProbeRecord:
    out = np.stack(run.outputs)  # [K, V]
    top = np.sort(out, axis=1)[:, -2:] if out.shape[1] > 1 else np.concatenate([out, out], axis=1)
    keep = stored_outputs(len(run.outputs), logit_rows)
    return ProbeRecord(
        case=plan.case, form=form, ids=np.array(plan.ids, np.int32), calls=np.array(plan.calls, np.int32),
        tokens=np.array(run.tokens, np.int32), top1=out.argmax(axis=1).astype(np.int32),
        margin=(top[:, 1] - top[:, 0]).astype(np.float32), scale=np.abs(out).max(axis=1).astype(np.float32),
        sel_gap=np.array(run.gaps, np.float32),
        logit_outputs=keep, logits=out[keep].astype(np.float16), sel_layers=np.array(layers, np.int32),
        sel_rows=np.array(plan.sel_rows, np.int32), sel_bits=np.packbits(run.selected, axis=-1), tiers=run.tiers)


def logit_budget(outputs: Sequence[int], vocab: int) -> list[int]:
    """Logit rows each record may store within LOGIT_BYTES (float16), shared in proportion to its outputs, what the
    rounding leaves to the records in order (the text case first); a vocabulary too large for one row a record
    leaves the later records none (their top-1 and margins are stored all the same)."""
    total = LOGIT_BYTES // (2 * vocab)
    rows = [min(k, total * k // max(1, sum(outputs))) for k in outputs]
    for i, k in enumerate(outputs):
        extra = min(k - rows[i], total - sum(rows))
        rows[i] += max(0, extra)
    return rows


def selection_layers(owning: Sequence[int], plans: Sequence[CasePlan], forms: int) -> list[int]:
    """The owning layers whose selections are stored: all of them where SELECTION_BYTES allows, else the first."""
    per_layer = forms * sum(len(p.sel_rows) * -(-(len(p.ids) + p.new_tokens - 1) // 8) for p in plans)
    return list(owning[: max(1, SELECTION_BYTES // max(1, per_layer))])


def density(plan: CasePlan, run: GoldenRun) -> float:
    """The fraction of the positions before it that the last stored prefill row selects, averaged over layers."""
    q = max(i for i, r in enumerate(plan.sel_rows) if r < len(plan.ids))
    return float(run.selected[:, q, : plan.sel_rows[q] + 1].mean())


def golden_probe(bundle: Path, cfg: ModelConfig, weights: ProbeWeights, kv: GoldenKV) -> GoldenProbe:
    """Every case on every weight form of the bundle."""
    bcfg = BundleConfig.load(bundle)
    plans = plan_cases(bundle, bcfg)
    forms = weights.weights.forms
    layers = selection_layers(cfg.owning_layers, plans, len(forms))
    calibration = kv.calibration()
    runs = [(plan, form, run_case(GoldenModel(weights.golden_weights(form), mode="deployed", quant=kv.quant,
                                              calibration=calibration), plan, layers))
            for form in forms for plan in plans]
    budget = logit_budget([len(r.outputs) for _, _, r in runs], bcfg.vocab_size)
    records = tuple(to_record(plan, form, run, p, layers) for (plan, form, run), p in zip(runs, budget))
    text_plan, _, text_run = runs[0]
    golden: dict[str, Any] = {
        "mode": "deployed", "forms": list(forms), "selection_density": round(density(text_plan, text_run), 4),
        "demoted_rows": int(text_run.tiers[1:].sum()), "selection_layers": len(layers),
        PROBE_KNOBS: bcfg.knobs.document()}
    return GoldenProbe(bcfg.vocab_size, records, golden)


def write_golden_probe(bundle: Path, cfg: ModelConfig, tensors: CheckpointTensors, weights: BundleWeights,
                       kv: GoldenKV) -> dict[str, Any]:
    """golden_probe.npz into the bundle directory being written (bundle.json and the tokenizer already there); the
    golden's float32 weights go to a scratch directory beside it, deleted after. Returns the report's summary."""
    threads = torch.get_num_threads()
    # one sequence's small matmuls: a second thread gains little, and where another process shares the cores torch's
    # spinning threads doubled the probe's time (SmolLM2 INT4 on 2 busy cores: 37 s on one thread, 73 s on two)
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{bundle.name}.golden-", dir=bundle.parent) as scratch:
            pw = ProbeWeights(Path(scratch), cfg, tensors, weights)
            pw.write()
            probe = golden_probe(bundle, cfg, pw, kv)
    finally:
        torch.set_num_threads(threads)
    size = write_probe(bundle / FILES.probe, probe)
    cases = {r.case: {"prompt_tokens": len(r.ids), "calls": r.calls.tolist(), "new_tokens": len(r.tokens)}
             for r in probe.records}
    return {"file": FILES.probe, "bytes": size, "cases": cases, **probe.golden}
