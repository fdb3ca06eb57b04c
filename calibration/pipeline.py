"""`calibration run`, step by step, as one function over plain options.

1. Read the checkpoint (config, quant_config, weights; manifest checked) and the token sequences
   of the calibration data (and of the held-out data, if any).
2. Statistics: exact-mode forward over the calibration sequences with a latent hook (stats.py).
   Every step that can take long shows its progress (gsm.progress.track: units done / total and the
   time left; a bar on a terminal, a line every few seconds in a log).
3. Scales and compensation per layer, latent and channel (scales.py).
4. Tier fractions: cheapest grid point within the error budget, deployed mode, decode steps, on
   the first `search_samples` calibration sequences (tiers.py, measure.py).
5. Held-out report: per-latent errors and the whole-model table (exact, calibrated mixed, naive
   per-tensor at the same bytes, all-INT8 with and without compensation, ...), never fitted on.
6. Write kv_calibration.safetensors + quant_config.json atomically (writer.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration import scales as sc
from calibration.data import (
    CalibrationInputError,
    Sequences,
    checkpoint_bos,
    checkpoint_tokenizer,
    ids_sha256,
    load_sequences,
    resolve_inputs,
)
from calibration.measure import Evaluator, Fractions, Protocol, Score, kv_bytes_per_position
from calibration.report import latent_errors, split_half_ratio
from calibration.stats import LatentObserver, observe
from calibration.tiers import Choice, candidate_fractions, choose_fractions, cost_key
from calibration.writer import check_destination, check_unmodified, write_calibrated
from gsm import checkpoint as ckpt
from gsm.config import KVQuantConfig
from gsm.golden.model import GoldenModel
from gsm.golden.weights import GoldenWeights, KVCalibration
from gsm.progress import track

INDEX_KEYS = ("int8", "fp16")  # --index-keys

ALL_FP16: Fractions = (1.0, 0.0, 0.0)
ALL_INT8: Fractions = (0.0, 0.0, 1.0)
ALL_INT4: Fractions = (0.0, 0.0, 0.0, 1.0)


@dataclass(frozen=True)
class CalibrateOptions:
    checkpoint: Path
    data: Path | None = None  # FILE | DIR; default: the file conversion_report.json names
    eval_data: Path | None = None  # default: the single *eval* file beside the calibration file
    tokenizer: Path | None = None
    samples: int = 64  # calibration sequences for statistics
    seq_len: int = 256
    method: str = "absmax"
    percentile: float = sc.DEFAULT_PERCENTILE
    error_budget: float = 0.01
    search_samples: int = 8  # calibration sequences measured per candidate (decode steps: slow)
    eval_samples: int = 8  # held-out sequences for the report (0: none)
    prefill_len: int | None = None  # default seq_len // 4
    adaptation_rate: int = 16
    fraction_step: float = 0.25
    index_keys: str = "int8"  # INT8 indexer keys (fitted here) or fp16 (decisions "INT8 indexer keys")
    int4: bool = False  # the tier search may choose INT4 rows (opt in: docs/calibration.md "INT4 in the search")
    confidence_z: float = 2.0  # standard errors of margin when comparing with the budget
    sweep: bool = False  # measure every candidate on calibration and held-out text (sweep.py)
    tier_fractions: Fractions | None = None  # fixed: skip the search
    fp16_window: int | None = None  # default: keep the checkpoint's
    hotness_decay: float | None = None
    reservoir: int = 16384
    seed: int = 0
    out: Path | None = None
    overwrite: bool = False

    @property
    def protocol(self) -> Protocol:
        return Protocol(self.prefill_len if self.prefill_len is not None else self.seq_len // 4,
                        self.adaptation_rate)


def default_data(checkpoint: Path) -> Path:
    """The calibration text the converter used (conversion_report.json), when it still exists."""
    rep = checkpoint / "conversion_report.json"
    try:
        f = Path(json.loads(rep.read_text(encoding="utf-8"))["calibration"]["file"])
    except (OSError, ValueError, KeyError, TypeError):
        f = None
    if f is None or not f.is_file():
        raise CalibrationInputError("--data not given and the checkpoint names no calibration text that "
                                    "exists here; pass --data FILE|DIR")
    return f


def check_options(o: CalibrateOptions, max_positions: int) -> None:
    if o.method not in sc.METHODS:
        raise CalibrationInputError(f"--method {o.method!r}: expected one of {', '.join(sc.METHODS)}")
    if o.seq_len > max_positions:
        raise CalibrationInputError(f"--seq-len {o.seq_len} exceeds the model's max_position_embeddings "
                                    f"{max_positions}")
    for flag, v in (("--samples", o.samples), ("--search-samples", o.search_samples), ("--reservoir", o.reservoir)):
        if v < 1:
            raise CalibrationInputError(f"{flag} must be >= 1, got {v}")
    if o.index_keys not in INDEX_KEYS:
        raise CalibrationInputError(f"--index-keys {o.index_keys!r}: expected one of {', '.join(INDEX_KEYS)}")
    if o.eval_samples < 0:
        raise CalibrationInputError(f"--eval-samples must be >= 0, got {o.eval_samples}")
    if o.error_budget < 0:
        raise CalibrationInputError(f"--error-budget must be >= 0, got {o.error_budget}")
    try:
        o.protocol.check(o.seq_len)
        candidate_fractions(o.fraction_step, o.int4)
    except ValueError as e:
        raise CalibrationInputError(str(e)) from e


@dataclass(frozen=True)
class _Data:
    """The token sequences of a run: calibration, held-out (None: none), and the BOS they start with."""

    cal: Sequences
    ev: Sequences | None
    bos: int | None


@dataclass(frozen=True)
class _Fit:
    """What the statistics pass fitted: scales (and the naive per-tensor ones), indexer-key scales."""

    exact: GoldenModel  # exact mode with a one-row output head: it reads latents only
    stats: dict[tuple[int, str], Any]  # (layer, "k"|"v") -> latent statistics on calibration rows
    calib: KVCalibration
    naive: KVCalibration
    quant: KVQuantConfig  # the run's kv_quantization: index_key_bits 8 when key scales were fitted
    key_scales: dict[int, Any] | None


def calibrate_checkpoint(o: CalibrateOptions, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run every step; returns the report (also written into the checkpoint and to --report)."""
    t0 = time.perf_counter()
    cfg = ckpt.load_config(o.checkpoint)
    quant0 = ckpt.load_quant(o.checkpoint)
    check_options(o, cfg.max_position_embeddings)
    check_destination(o.checkpoint, o.out, o.overwrite)
    expected = check_unmodified(o.checkpoint)
    data = read_data(o, cfg.vocab_size, cfg.bos_token_id, progress)
    with track("load checkpoint", log=progress):
        weights = GoldenWeights.from_tensors(cfg, ckpt.load_state_dict(o.checkpoint))
    fit, search = fit_scales(o, weights, run_quant(o, quant0), data.cal, progress)
    choice, search_exact = choose_tiers(o, search, fit.calib, progress)
    del search  # its exact log-probs ([sequences, tokens, vocab]) are not needed again
    held, measured = held_out_pass(o, weights, fit, data, progress)
    layers = layer_errors(fit.stats, held, fit.calib, fit.naive)
    model, swept = model_and_sweep(o, weights, fit, data, measured, choice, tuple(quant0.tier_fractions), progress)
    quant_out = fit.quant.with_fractions(tuple(choice.fractions)).replace(
        method=o.method, samples=int(data.cal.ids.shape[0]), data_hash=ids_sha256(data.cal.ids))
    report = run_report(o, data, fit.stats, choice, search_exact, quant_out, layers, model, swept)
    report["seconds"] = time.perf_counter() - t0
    with track("write checkpoint", log=progress):
        write_calibrated(o.checkpoint, fit.calib, quant_out, report, out=o.out, overwrite=o.overwrite,
                         metadata={"method": o.method, "data_hash": quant_out.data_hash}, expected=expected,
                         say=progress)
    report["seconds"] = time.perf_counter() - t0
    return report


def read_data(o: CalibrateOptions, vocab_size: int, bos_token_id: int | None,
              progress: Callable[[str], None]) -> _Data:
    """The calibration sequences (--data, or the converter's text) and the held-out ones (--eval-data, or the
    single *eval* file beside the calibration file), tokenised with the checkpoint's tokenizer when they are text."""
    calib_path, eval_path = resolve_inputs(o.data or default_data(o.checkpoint), o.eval_data)
    tok_cache: list[Any] = []

    def tokenizer() -> Any:
        if not tok_cache:
            tok_cache.append(checkpoint_tokenizer(o.checkpoint, o.tokenizer, vocab_size))
        return tok_cache[0]

    bos = checkpoint_bos(o.checkpoint, bos_token_id)

    def seqs(path: Path, flag: str, n: int) -> Sequences:
        return load_sequences(path, flag, tokenizer, seq_len=o.seq_len, max_sequences=n, bos_id=bos,
                              vocab_size=vocab_size)

    cal = seqs(calib_path, "--data", o.samples)
    ev = seqs(eval_path, "--eval-data", o.eval_samples) if eval_path is not None and o.eval_samples else None
    if o.sweep and ev is None:
        raise CalibrationInputError("--sweep needs held-out data (--eval-data, --eval-samples > 0)")
    progress(f"calibration: {cal.ids.shape[0]} x {o.seq_len} tokens of {cal.kind} from {cal.path}"
             + (f"; held-out: {ev.ids.shape[0]} sequences from {ev.path}" if ev else "; no held-out data"))
    return _Data(cal, ev, bos)


def run_quant(o: CalibrateOptions, quant0: KVQuantConfig) -> KVQuantConfig:
    """The checkpoint's kv_quantization with --fp16-window / --hotness-decay, and FP16 indexer keys until this run
    fits key scales (a recalibrated checkpoint's old ones are replaced, not reused)."""
    quant = quant0.replace(**{k: v for k, v in (("fp16_window", o.fp16_window),
                                                 ("hotness_decay", o.hotness_decay)) if v is not None})
    return quant.replace(index_key_bits=16)


def fit_scales(o: CalibrateOptions, weights: GoldenWeights, quant: KVQuantConfig, cal: Sequences,
               progress: Callable[[str], None]) -> tuple[_Fit, Evaluator | None]:
    """The statistics pass over the calibration sequences and the scales fitted on it; with the tier search
    (no --tier-fractions) also the search's Evaluator, whose exact pass over the first `search_samples`
    sequences feeds the statistics as well (same rows, same order as a separate pass): the statistics pass
    covers only the rest."""
    # statistics read latents only: a one-row output head spares the [T, vocab] logits (latents unchanged)
    exact = GoldenModel(dataclasses.replace(weights, lm_head=weights.lm_head[:1]), mode="exact", quant=quant)
    search_seqs = cal.ids[: o.search_samples]
    observer = LatentObserver(exact, capacity=o.reservoir, seed=o.seed)
    with track("statistics", total=int(cal.ids.shape[0]), unit="sequences", log=progress) as advance:
        search = None if o.tier_fractions is not None else Evaluator(weights, quant, search_seqs, o.protocol,
                                                                       observer=observer, advance=advance)
        observe(exact, cal.ids[0 if search is None else search_seqs.shape[0]:], observer, advance)
    stats = observer.stats
    with track("scales", total=len(stats), unit="latents", log=progress) as advance:
        calib = dataclasses.replace(sc.calibrate(stats, o.method, percentile=o.percentile, advance=advance),
                                    head_input_moment=observer.head_input_moment())
        naive = sc.naive_calibration(stats)
    progress(f"statistics of {next(iter(stats.values())).count} latent rows per layer; {o.method} scales")
    key_scales = sc.key_scales(observer.key_absmax) if o.index_keys == "int8" else None
    if key_scales is not None:  # every deployed measurement below holds the keys as the engines will
        calib, naive = sc.with_key_scales(calib, key_scales), sc.with_key_scales(naive, key_scales)
        quant = quant.replace(index_key_bits=8)
        if search is not None:
            search.use_int8_keys(key_scales)
        progress("indexer keys INT8, per-channel abs-max scales")
    return _Fit(exact, stats, calib, naive, quant, key_scales), search


def choose_tiers(o: CalibrateOptions, search: Evaluator | None, calib: KVCalibration,
                 progress: Callable[[str], None]) -> tuple[Choice, float | None]:
    """The tier fractions (fixed by --tier-fractions, or the search's choice within the error budget) and the
    search's exact perplexity (None without a search)."""
    if search is None:
        choice = Choice(tuple(o.tier_fractions), o.error_budget, True, [])
        progress(f"tier fractions fixed by --tier-fractions: {list(choice.fractions)}")
        return choice, None
    search_exact = search.exact.perplexity
    candidates = candidate_fractions(o.fraction_step, o.int4)
    choice = choose_fractions(level_measure(search, calib, candidates, progress), search.exact, o.error_budget,
                              candidates, z=o.confidence_z, progress=progress)
    return choice, search_exact


def held_out_pass(o: CalibrateOptions, weights: GoldenWeights, fit: _Fit, data: _Data,
                  progress: Callable[[str], None]) -> tuple[dict[tuple[int, str], Any], Evaluator | None]:
    """Latent statistics for the per-latent errors, and the held-out Evaluator of the whole-model table (None without
    held-out text).

    Per-latent errors on held-out rows (calibration rows, labelled so, when there are none): every row up
    to the reservoir size (all of the default 8 x 256), a uniform sample beyond; on held-out text they
    come from the report's own exact pass. The whole-model table only on held-out text: quality
    measured on fitted text is no evidence."""
    ev, cal = data.ev, data.cal
    held_obs = LatentObserver(fit.exact, capacity=o.reservoir, seed=o.seed, fp16=False)
    rows_of = ev if ev is not None else cal
    with track("held-out exact pass" if ev is not None else "latent errors on calibration rows",
               total=int(rows_of.ids.shape[0]), unit="sequences", log=progress) as advance:
        measured = (Evaluator(weights, fit.quant, ev.ids, o.protocol, observer=held_obs, advance=advance)
                    if ev is not None else None)
        if ev is None:
            observe(fit.exact, cal.ids, held_obs, advance)
    if measured is not None and fit.key_scales is not None:
        measured.use_int8_keys(fit.key_scales)
    return held_obs.stats, measured


def layer_errors(stats: dict[tuple[int, str], Any], held: dict[tuple[int, str], Any], calib: KVCalibration,
                 naive: KVCalibration) -> list[dict[str, Any]]:
    """The report's per-latent rows: errors of the calibrated and naive scales on the `held` rows, and the split-half
    abs-max ratio of the calibration rows."""
    return [{"layer": i, "latent": kv, **latent_errors(held[(i, kv)].rows, calib.scales[(i, kv)],
                                                       naive.scales[(i, kv)]),
             # rows are in sequence order only while the reservoir holds them all
             "calib_split_half_absmax_ratio": split_half_ratio(stats[(i, kv)].rows) if stats[(i, kv)].exact
             else None}
            for (i, kv) in sorted(stats)]


def model_and_sweep(o: CalibrateOptions, weights: GoldenWeights, fit: _Fit, data: _Data, measured: Evaluator | None,
                    choice: Choice, reference: Fractions, progress: Callable[[str], None]
                    ) -> tuple[dict[str, Any] | None, Any]:
    """The whole-model table on held-out text (model_table; `reference`: the checkpoint's fractions before), and
    with --sweep every candidate measured on calibration and held-out text; (None, None) without held-out text."""
    if measured is None:
        return None, None
    model = model_table(measured, weights, choice, fit.calib, fit.naive, f"held-out {data.ev.path.name}", progress,
                        z=o.confidence_z, reference=reference)
    if not o.sweep:
        return model, None
    from calibration.sweep import sweep

    sweep_search = Evaluator(weights, fit.quant, data.cal.ids[: o.search_samples], o.protocol)
    if fit.key_scales is not None:
        sweep_search.use_int8_keys(fit.key_scales)
    return model, sweep(sweep_search, measured, fit.calib, candidate_fractions(o.fraction_step, o.int4),
                        z=o.confidence_z, progress=progress)


def run_report(o: CalibrateOptions, data: _Data, stats: dict[tuple[int, str], Any], choice: Choice,
               search_exact: float | None, quant_out: KVQuantConfig, layers: list[dict[str, Any]],
               model: dict[str, Any] | None, swept: Any) -> dict[str, Any]:
    """The report (calibration_report.json) of a run, but for its seconds."""
    cal, ev, protocol = data.cal, data.ev, o.protocol
    return {
        "checkpoint": str(o.checkpoint), "output": str(o.out if o.out is not None else o.checkpoint),
        "method": o.method, "percentile": o.percentile if o.method == "percentile" else None,
        "data": {"file": str(cal.path), "kind": cal.kind, "sequences": int(cal.ids.shape[0]),
                 "seq_len": o.seq_len, "data_hash": quant_out.data_hash,
                 "bos_token_id": data.bos,  # None: windows without BOS (tokenizer_config.json add_bos_token false)
                 "latent_rows_per_layer": next(iter(stats.values())).count,
                 "reservoir_exact": all(s.exact for s in stats.values())},
        "held_out": None if ev is None else {"file": str(ev.path), "kind": ev.kind,
                                             "sequences": int(ev.ids.shape[0])},
        "protocol": {"prefill_len": protocol.prefill_len, "adaptation_rate": protocol.adaptation_rate,
                     "search_sequences": int(cal.ids[: o.search_samples].shape[0]), "fraction_step": o.fraction_step,
                     "confidence_z": o.confidence_z},
        "layer_errors_on": "held-out rows" if ev else "calibration rows (no held-out data)",
        "choice": {"tier_fractions": list(choice.fractions), "error_budget": o.error_budget,
                   "budget_met": choice.budget_met, "fixed": o.tier_fractions is not None,
                   "search_exact_perplexity": search_exact,
                   "trials": [t.to_json() for t in choice.trials]},
        "quant_config": quant_out.to_json()["kv_quantization"],
        "layers": layers,
        "model": model,
        "sweep": swept,
    }


def level_measure(ev: Evaluator, calib: KVCalibration, candidates: list[Fractions],
                  progress: Callable[[str], None] = lambda _: None) -> Callable[[Fractions], Score]:
    """`measure` for choose_fractions that decodes all candidates of one cost level together.

    The search measures a whole cost level before deciding, so nothing is measured that the
    one-candidate-at-a-time search would not have measured; batching them only shares the steps.
    How many levels it measures depends on what it finds, so each level shows its own progress.
    """
    done: dict[Fractions, Score] = {}

    def measure(f: Fractions) -> Score:
        if f not in done:
            level = [g for g in candidates if cost_key(g) == cost_key(f) and g not in done]
            with track(f"tier search at {cost_key(f):g} B/value ({len(level)} candidates)",
                       total=ev.decode_units(len(level)), unit="decode steps", log=progress) as advance:
                done.update(zip(level, ev.deployed_many([(calib, g) for g in level], advance)))
        return done[f]

    return measure


def model_table(ev: Evaluator, weights: GoldenWeights, choice: Choice, calib: KVCalibration,
                naive: KVCalibration, where: str, progress: Callable[[str], None], z: float = 2.0,
                reference: Fractions | None = None) -> dict[str, Any]:
    """Perplexity and KL of each configuration on the same decoded tokens, with spec 6 bytes.

    `relative_increase` is the point estimate; `upper_bound` adds z standard errors over sequences.
    `reference`: the checkpoint's fractions before calibration; when they are mixed and differ from
    the chosen ones, calibrated and naive scales are also compared there (a mixed-tier comparison
    even when the search picked all-INT8).
    """
    no_comp = sc.without_compensation(calib)
    data_free = sc.with_key_scales(KVCalibration.data_free(weights), calib.index_key_scales)
    chosen = tuple(choice.fractions)
    configs: list[tuple[str, KVCalibration | None, Fractions | None]] = [
        ("exact (no quantisation)", None, None),
        ("deployed, all FP16", calib, ALL_FP16),
        ("calibrated, chosen fractions", calib, chosen),
        ("naive per-tensor INT8, chosen fractions", naive, chosen),
        ("data-free scales, chosen fractions", data_free, chosen),
    ]
    if reference is not None and reference not in (chosen, ALL_INT8, ALL_FP16):
        configs += [("calibrated, previous fractions", calib, reference),
                    ("naive per-tensor INT8, previous fractions", naive, reference)]
    configs += [
        ("calibrated all-INT8", calib, ALL_INT8),
        ("calibrated all-INT8, no compensation", no_comp, ALL_INT8),
        ("naive per-tensor all-INT8", naive, ALL_INT8),
        ("calibrated all-INT4", calib, ALL_INT4),
    ]
    todo: dict[tuple[int, Fractions], tuple[KVCalibration, Fractions]] = {}
    for _, cal, fr in configs:
        if cal is not None and fr is not None:
            todo.setdefault((id(cal), fr), (cal, fr))
    progress(f"held-out report: {len(todo)} configurations x {ev.seqs.shape[0]} sequences, decoded together")
    with track("held-out report", total=ev.decode_units(len(todo)), unit="decode steps", log=progress) as advance:
        done: dict[tuple[int, Fractions], Score] = dict(zip(todo, ev.deployed_many(list(todo.values()), advance)))
    rows = []
    for name, cal, fr in configs:
        if cal is None or fr is None:
            s, b = ev.exact, kv_bytes_per_position(weights, ALL_FP16)  # exact holds float32; FP16 for bytes
        else:
            s, b = done[(id(cal), fr)], kv_bytes_per_position(weights, fr, 1 if ev.quant.int8_keys else 2)
            progress(f"{name}: perplexity {s.perplexity:.4f}")
        rows.append({"name": name, "tier_fractions": None if fr is None else list(fr), "kv_bytes_per_position": b,
                     "perplexity": s.perplexity, "mean_nll": s.mean_nll,
                     "relative_increase": None if cal is None else ev.relative_increase(s),
                     "upper_bound": None if cal is None else ev.relative_increase(s, z),
                     "mean_kl": None if cal is None else s.mean_kl})
    by_name = {r["name"]: r for r in rows}
    return {"where": where, "sequences": int(ev.seqs.shape[0]), "tokens": ev.exact.n_tokens,
            "protocol": {"prefill_len": ev.protocol.prefill_len, "adaptation_rate": ev.protocol.adaptation_rate},
            "dense_fp16_bytes_per_position": float(weights.cfg.num_hidden_layers * 2 * weights.cfg.kv_dim * 2),
            "rows": rows,
            "chosen_within_budget": by_name["calibrated, chosen fractions"]["relative_increase"] <= choice.budget}

