"""`python -m builder build`: checkpoint -> bundle, with every refusal before the first byte is written.

Order: resolve the device, find (or synthesise) the checkpoint, verify it with the same checker as
`python -m gsm verify`, plan the memory and refuse what does not fit, and only then open the atomic
bundle directory: graphs + streamed weights, plan, report, tokenizer, the TensorRT engine when
TensorRT and a GPU are here (otherwise the manifest says to build it on the target).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gsm
from builder.build_config import INDEX_KEYS, MATMUL_ACCURACY, BuildConfig, BuildError
from builder.bundle import atomic_bundle_dir, checkpoint_hash, write_json
from builder.calib import (
    CalibrationError,
    QuantTables,
    has_int4_tables,
    has_key_scales,
    head_input_moment,
    quant_tables,
    tier_noise,
)
from builder.golden_probe import GoldenKV, write_golden_probe
from builder.graph_cpu import CPU_DOMAIN, CPU_OPS
from builder.graphs import GraphsInfo, write_graphs
from builder.network import CheckpointSource, NetSpec
from builder.plan import (
    DEFAULT_GROUP_SIZE,
    GSM_SIDE_FAST_CONFIG,
    PER_CHANNEL,
    QUANTISED_KEYS,
    WEIGHT_CHOICES,
    MemoryPlan,
    PlanRequest,
    choose_weights,
    fmt_bytes,
    head_config,
    head_names,
    pool_rows,
    quantised_names,
    require_fit,
    weight_bytes,
    weight_configs,
)
from builder.qlinear import BundleWeights
from builder.read_progress import CountedSource
from builder.summary_lines import disk_line, weights_words
from gsm import checkpoint, names
from gsm.bundle_format import FILES, GRAPH_REVISION, BundleConfig, PoolRows, selection_entry
from gsm.checker import verify
from gsm.config import ConfigError, KVQuantConfig, ModelConfig
from jetson import resolve_device

DEMO_PRESET, DEMO_SEED = "tiny", 0
ENGINE_COMMAND = "python -m builder engine {bundle}"


@dataclass
class BuildResult:
    bundle: Path
    plan: MemoryPlan
    report: dict[str, Any]
    demo: bool
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Source:
    """The verified checkpoint and what the build reads of it."""

    path: Path
    demo: bool
    cfg: ModelConfig
    quant: KVQuantConfig  # the bundle's kv_quantization (kv_tier_policy)
    kv_tiers: dict[str, str]  # report.json's kv_tiers: mode and note
    tensors: checkpoint.CheckpointTensors
    ranks: dict[int, tuple[int, int]]


@dataclass(frozen=True)
class _Design:
    """What the bundle will hold, all decided before its directory is opened."""

    plan: MemoryPlan
    wreport: dict[str, Any]  # report.json's weights
    weights: BundleWeights
    qt: QuantTables
    rows: PoolRows
    spec: NetSpec


@contextlib.contextmanager
def _checkpoint_source(checkpoint_dir: Path | None, say: Callable[[str], None]) -> Iterator[tuple[Path, bool]]:
    if checkpoint_dir is not None:
        yield Path(checkpoint_dir), False
        return
    from gsm.synth import synth_checkpoint

    with tempfile.TemporaryDirectory(prefix="gsm-demo-") as tmp:
        say(f"no --checkpoint: building the DEMO model (synthetic '{DEMO_PRESET}' preset, seed {DEMO_SEED}, "
            "random weights: it produces gibberish text)")
        yield synth_checkpoint(DEMO_PRESET, Path(tmp) / f"demo-{DEMO_PRESET}", seed=DEMO_SEED), True


def default_output(checkpoint_dir: Path | None, device: str) -> Path:
    name = f"demo-{DEMO_PRESET}" if checkpoint_dir is None else Path(checkpoint_dir).resolve().name
    return Path("out") / f"{name}-{device}"


def build(config: BuildConfig, *, say: Callable[[str], None] = lambda s: None,
          step: Callable[[str], None] = lambda s: None,
          read: Callable[[int, int], None] = lambda done, total: None) -> BuildResult:
    """Build a bundle; BuildError (or a subclass's message) for every refusal, with nothing written.

    Steps: the device and the output place (_target), the checkpoint verified and its KV tiers (_read_checkpoint),
    the memory plan, weight formats and quantisation tables (_design), then the bundle (_write_bundle). say: a
    warning for the user; step: the step that starts; read(done, total): checkpoint bytes streamed so far."""
    t0 = time.perf_counter()
    profile, out = _target(config)
    with _checkpoint_source(config.checkpoint, say) as (ckpt, demo):
        src = _read_checkpoint(config, ckpt, demo, say, step)
        design = _design(config, src, profile, say, step)
        report, files = _write_bundle(config, src, design, profile, out, step, read, t0)
    return BuildResult(out, design.plan, report, demo, files)


def _target(config: BuildConfig) -> tuple[Any, Path]:
    """The device profile, and the output directory, checked writable (gsm/outputs.py) before anything is read."""
    from gsm.outputs import OutputPathError, check_output_dir
    from jetson import DetectionError, UnknownDeviceError

    try:
        profile = resolve_device(config.device)
    except (UnknownDeviceError, DetectionError) as e:
        raise BuildError(str(e)) from None
    out = config.output if config.output is not None else default_output(config.checkpoint, profile.name)
    try:
        check_output_dir(out, flag="--output", overwrite=config.overwrite,
                         inputs=[("--checkpoint", config.checkpoint), ("--calibration", config.calibration),
                                 ("--awq-scales", config.awq_scales)])
    except OutputPathError as e:
        raise BuildError(str(e)) from None
    return profile, out


def _read_checkpoint(config: BuildConfig, ckpt: Path, demo: bool, say: Callable[[str], None],
                     step: Callable[[str], None]) -> _Source:
    """The checkpoint verified (the `python -m gsm verify` checker), its config, and the KV tiers the bundle ships."""
    step("verifying checkpoint")
    rep = verify(ckpt)
    if not rep.ok:
        lines = [f"  {e.code}: {e.message}" for e in rep.errors[:20]]
        more = f"\n  ... and {len(rep.errors) - 20} more" if len(rep.errors) > 20 else ""
        raise BuildError(f"{ckpt} is not a valid GSM checkpoint (python -m gsm verify {ckpt}):\n"
                         + "\n".join(lines) + more)
    cfg = checkpoint.load_config(ckpt)
    quant, kv_tiers = kv_tier_policy(_asked_quant(checkpoint.load_quant(ckpt), config.tier_fractions,
                                                  config.index_keys),
                                     ckpt, config.calibration, demo, config.uncalibrated)
    if config.index_keys == "int8" and not quant.int8_keys:
        raise BuildError(f"--index-keys int8: {kv_tiers['note']}")
    if kv_tiers["mode"] != "calibrated":
        say(kv_tiers["note"])
    tensors = checkpoint.CheckpointTensors(ckpt)
    return _Source(ckpt, demo, cfg, quant, kv_tiers, tensors, tensors.ranks(cfg))


def _design(config: BuildConfig, src: _Source, profile: Any, say: Callable[[str], None],
            step: Callable[[str], None]) -> _Design:
    """The memory plan (refused when it does not fit), the weight formats and their quantisers, the quantisation
    tables and the network's spec: everything the bundle holds, decided before a byte of it is written."""
    cfg, ranks, quant = src.cfg, src.ranks, src.quant
    grid, grid_note, group = resolve_int4_grid(src.tensors, cfg, config.weights, config.int4_grid, config.group_size)
    table, moment = _head_moment(config, src)
    plan = _fitting_plan(src, profile, config.plan_request(group_size=group, int4_grid=grid,
                                                           head_moment=moment is not None))
    # quantised weights decode faster with INT8 activations (docs/weights.md)
    accuracy = config.matmul_accuracy if config.matmul_accuracy is not None else default_matmul_accuracy(plan)
    wreport = _weights_report(plan, cfg, ranks, config.weights, grid_note, accuracy)
    row_quantizers = _head_quantizers(plan, cfg, moment, table, wreport, say)
    awq = None
    if config.awq_scales is not None:
        awq, wreport["awq"] = load_awq_scales(config.awq_scales, plan, src.tensors, cfg)
    if config.weights == "auto":
        say(f"--weights auto: {wreport['why']}")
    step("quantisation tables")
    qt = _quant_tables(config, src)
    rows = pool_rows(plan.max_seq, plan.max_input, cfg, quant, max_rate=plan.max_adaptation_rate)
    wcfgs = weight_configs(cfg, plan.weights, plan.group_size, plan.int4_grid, plan.head_weights,
                           plan.gsm_weights, fast_matmuls=accuracy == "fast")
    spec = NetSpec(cfg, ranks, plan.max_seq, logits=config.logits, debug=config.debug_outputs,
                   quantised=frozenset(wcfgs), nbits_accuracy=MATMUL_ACCURACY[accuracy],
                   key_scales=qt.key_scales if quant.int8_keys else None)
    weights = BundleWeights(wcfgs, awq or {}, row_quantizers, int8_activations=accuracy == "fast")
    return _Design(plan, wreport, weights, qt, rows, spec)


def _head_moment(config: BuildConfig, src: _Source) -> tuple[Path, Any]:
    """The calibration table the build reads, and the head's input moment in it (None: the table has none)."""
    table = config.calibration if config.calibration is not None else src.path / checkpoint.CALIB_FILE
    try:
        return table, head_input_moment(table, src.cfg.hidden_size) if table.is_file() else None
    except CalibrationError as e:
        raise BuildError(str(e)) from None


def _fitting_plan(src: _Source, profile: Any, request: PlanRequest) -> MemoryPlan:
    """The memory plan (for --weights auto the highest precision that fits); BuildError when it does not fit."""
    from builder.plan import PlanError

    try:
        plan = choose_weights(src.cfg, src.ranks, src.quant, profile, request)
        require_fit(plan, src.cfg, src.ranks, src.quant)
    except PlanError as e:
        raise BuildError(str(e)) from None
    return plan


def default_matmul_accuracy(plan: MemoryPlan) -> str:
    """--matmul-accuracy with no flag: fast when anything is quantised, else exact."""
    return "fast" if {plan.weights, plan.head_weights, plan.gsm_weights} & {"int8", "int4"} else "exact"


def _quant_tables(config: BuildConfig, src: _Source) -> QuantTables:
    """The KV quantisation tables (--calibration, the checkpoint's, or data-free), refused when they lack what the
    bundle's kv_quantization needs."""
    try:
        qt = quant_tables(src.cfg, src.ranks, src.tensors, src.path, config.calibration)
    except CalibrationError as e:
        raise BuildError(str(e)) from None
    quant = src.quant
    if quant.int8_keys and qt.key_scales is None:
        raise BuildError(f"{qt.source}: kv_quantization.index_key_bits is 8 but the calibration has no "
                         "index_key.scale_int8 tables; rerun `python -m calibration run`")
    if quant.uses_int4 and not qt.int4_fitted:
        raise BuildError(f"{qt.source}: INT4 tier fractions {list(quant.tier_fractions)} but some owning layer's "
                         "latent has no scale_int4/comp_int4 table; rerun `python -m calibration run`")
    return qt


def _write_bundle(config: BuildConfig, src: _Source, design: _Design, profile: Any, out: Path,
                  step: Callable[[str], None], read: Callable[[int, int], None], t0: float
                  ) -> tuple[dict[str, Any], list[str]]:
    """The bundle directory, atomically (builder/bundle.py): graphs + streamed weights, the checkpoint's small
    files, bundle.json, plan.json, the golden probe, the engine where TensorRT is here, report.json and the
    manifest. Returns the report and the file names."""
    ckpt, cfg, plan, spec, qt = src.path, src.cfg, design.plan, design.spec, design.qt
    ck_hash = checkpoint_hash(ckpt)
    meta: dict[str, Any] = {}
    with atomic_bundle_dir(out, meta, overwrite=config.overwrite) as tmp:
        source = CountedSource(CheckpointSource(src.tensors), src.tensors, read)  # read(done, total): checkpoint bytes
        info = write_graphs(tmp, spec, source, qt.tables, design.rows, trt_precision=config.trt_precision,
                            weights=design.weights, max_top_k=plan.max_top_k,
                            row_cache_factor=plan.row_cache_factor, progress=step)
        for name in (checkpoint.CONFIG_FILE, checkpoint.QUANT_FILE, checkpoint.TOKENIZER_FILE,
                     checkpoint.TOKENIZER_CONFIG_FILE):
            if (ckpt / name).is_file():
                shutil.copyfile(ckpt / name, tmp / name)
        noise = _tier_noise(ckpt, config.calibration, src.kv_tiers)
        write_json(tmp / FILES.config, _bundle_config(spec, plan, design.rows, src.quant, config.logits,
                                                     config.debug_outputs, _weights_record(design.wreport),
                                                     noise).to_json())
        write_json(tmp / FILES.plan, plan.to_json())
        step("golden probe")
        probe = write_golden_probe(tmp, cfg, src.tensors, design.weights,
                                   GoldenKV(src.quant, qt.tables, src.ranks, spec.key_scales))
        engine = _maybe_engine(tmp, plan, profile, step)
        report = _report(cfg, plan, info, qt.source, src.demo, ck_hash, engine, time.perf_counter() - t0, out)
        report["kv_tiers"] = src.kv_tiers
        report["weights"] = design.wreport
        report["golden_probe"] = probe
        write_json(tmp / FILES.report, report)
        meta.update(_manifest(config, src, design, profile, info, engine, ck_hash))
        files = sorted(p.name for p in tmp.iterdir()) + ["manifest.json"]
    return report, files


def _manifest(config: BuildConfig, src: _Source, design: _Design, profile: Any, info: GraphsInfo,
              engine: dict[str, Any], ck_hash: str) -> dict[str, Any]:
    """The bundle's fields of manifest.json (gsm.atomic adds every file's sha256)."""
    return {
        "gsm_edge_version": gsm.__version__, "checkpoint": {"hash": ck_hash, "demo": src.demo,
                                                           "path": None if src.demo else str(src.path)},
        "device": profile.to_json(), "opset": info.opset,
        "plugins": {"domain": info.plugin_domain, "namespace": info.plugin_namespace, "versions": info.plugins},
        "graphs": FILES.graphs(),
        "cpu_ops": {"domain": CPU_DOMAIN, "versions": dict(CPU_OPS)},
        "engine": engine, "calibration": design.qt.source, "trt_precision": config.trt_precision,
        "portable_opset": info.portable_opset, "weights": _weights_record(design.wreport),
    }


def _tier_noise(ckpt: Path, calibration: Path | None, kv_tiers: dict[str, str]) -> dict[str, float]:
    """The calibration's per-tier error (builder.calib.tier_noise) when the tables are the checkpoint's own and
    calibrated; {} otherwise (a --calibration file has no report beside the checkpoint's, data-free scales none)."""
    if calibration is not None or kv_tiers["mode"] != "calibrated":
        return {}
    try:
        return tier_noise(ckpt / checkpoint.CALIB_REPORT_FILE)
    except CalibrationError as e:
        raise BuildError(str(e)) from None


def _bundle_config(spec: NetSpec, plan: MemoryPlan, rows: PoolRows, quant: KVQuantConfig, logits: str, debug: bool,
                   weights: dict[str, Any], kv_tier_noise: dict[str, float]) -> BundleConfig:
    cfg, g = spec.cfg, spec.cfg.gsm
    return BundleConfig(
        n_max=spec.n_max, max_batch=plan.max_batch, max_input=plan.max_input, logits=logits, debug_outputs=debug,
        vocab_size=cfg.vocab_size, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        owning_layers=tuple(cfg.owning_layers),
        ranks={int(l): (int(rk), int(rv)) for l, (rk, rv) in spec.ranks.items()}, index_dim=g.indexer_dim,
        pool_rows=rows, sink_tokens=g.sink_tokens, sparse_window=g.sparse_window,
        max_sparse_window=g.max_sparse_window, sparse_top_k=g.sparse_top_k, sparse_top_k_divisor=g.sparse_top_k_divisor,
        quantization_adaptation_rate=g.quantization_adaptation_rate, kv_quantization=quant,
        graph_revision=GRAPH_REVISION, max_top_k=plan.max_top_k, weights=weights,
        layer_selection={l: selection_entry(ls.sparse_window, ls.sparse_top_k, ls.sparse_top_k_divisor)
                         for l, ls in g.layer_selection.items()}, kv_tier_noise=kv_tier_noise)


TRT_INT8_BLOCKED_NOTE = (
    "model.onnx (TensorRT) holds these INT8 weights per output channel, not in groups: TensorRT documents "
    "blocked DequantizeLinear for INT4 only (docs/weights.md \"INT8 groups\"); the portable graph keeps the groups")
GRID_GROUP = 32  # the block of llama.cpp's Q4_0/Q4_1 grids, what `--int4-grid auto` looks for by default


def resolve_int4_grid(tensors: Any, cfg: Any, weights: str, int4_grid: str, group_size: int | None
                      ) -> tuple[str, str, int | None]:
    """(grid, why, group) for INT4. `auto`: if the projections already lie on an asymmetric 4-bit block
    grid (a llama.cpp Q4_1 source: min at code 0, max at code 15, checked on the first rows of the first
    and last layers' q_proj and down_proj), `asym-f` at that group reproduces them; otherwise `sym`.
    group None: the plan's default for the format (INT4 and INT8 differ)."""
    group = group_size
    if weights not in ("int4", "auto"):
        return "sym", "", group
    if int4_grid != "auto":
        return int4_grid, f"--int4-grid {int4_grid}", group
    from builder.wquant import on_block_grid
    from gsm import names

    probe = group_size if group_size is not None else GRID_GROUP
    last = cfg.num_hidden_layers - 1
    checked = [names.layer_name(k, i) for k, i in (("q_proj", 0), ("down_proj", 0), ("q_proj", last),
                                                   ("down_proj", last))]
    for name in checked:
        k = tensors.shape(name)[1]
        first = next(iter(tensors.reader(name).iter_chunks(name, 4 << 20)))
        rows = first[: (first.size // k) * k].reshape(-1, k)
        if rows.shape[0] == 0 or not on_block_grid(rows, 4, probe):
            return "sym", (f"--int4-grid auto: the projections are not on a 4-bit group-{probe} grid ({name}), "
                           f"so symmetric INT4 at group {group or DEFAULT_GROUP_SIZE}"), group
    return "asym-f", (f"--int4-grid auto: the projections already lie on an asymmetric 4-bit group-{probe} grid "
                      "(a Q4_1-style source), so asym-f at that group reproduces them"), probe


def _weights_report(plan: MemoryPlan, cfg: Any, ranks: Any, requested: str, grid_note: str,
                    matmul_accuracy: str) -> dict[str, Any]:
    fp16 = weight_bytes(cfg, ranks)
    rep: dict[str, Any] = {
        "requested": requested, "format": plan.weights, "bytes": plan.weight_bytes, "fp16_bytes": fp16,
        "ratio_vs_fp16": plan.weight_bytes / fp16,
        "quantised": sorted(QUANTISED_KEYS) if plan.weights != "fp16" else [],
        "head_weights": plan.head_weights,  # the embedding and LM head (one tensor when tied)
        "head_group_size": None if plan.head_weights == "fp16" else head_config(plan.head_weights).group_size,
        "tied_head": bool(cfg.tie_word_embeddings),
        # the GSM-side projections of owning layers (latent Vt, indexer key / query / weight): fp16 or INT8 per channel
        # in the TensorRT graph; in the ONNX Runtime graphs per group of gsm_group_size inputs in a fast build
        "gsm_weights": plan.gsm_weights,
    }
    if plan.gsm_weights == "int8":
        rep["gsm_group_size"] = GSM_SIDE_FAST_CONFIG.group_size if matmul_accuracy == "fast" else None
    if plan.weights == "int4":
        rep.update({"group_size": plan.group_size, "int4_grid": plan.int4_grid, "grid_note": grid_note})
    if plan.weights == "int8":
        rep["group_size"] = None if plan.group_size == PER_CHANNEL else plan.group_size  # None: per output channel
        if rep["group_size"] is not None:
            rep["tensorrt_note"] = TRT_INT8_BLOCKED_NOTE
    if plan.weights != "fp16" or plan.head_weights != "fp16" or plan.gsm_weights != "fp16":
        rep["matmul_accuracy"] = matmul_accuracy
    if requested == "auto":
        tried = WEIGHT_CHOICES[: WEIGHT_CHOICES.index(plan.weights)]
        rep["why"] = (f"{plan.weights} is the highest precision whose plan fits {plan.device} at --max-seq "
                      f"{plan.max_seq} x --max-batch {plan.max_batch} ({fmt_bytes(plan.total_bytes)} of "
                      f"{fmt_bytes(plan.usable_bytes)})" + (f"; {', '.join(tried)} did not fit" if tried else ""))
    else:
        rep["why"] = f"--weights {requested}"
    return rep


def _head_quantizers(plan: MemoryPlan, cfg: Any, moment: Any, table: Path, wreport: dict[str, Any],
                     say: Callable[[str], None]) -> dict[str, Any]:
    """GPTQ for an INT4 head when the calibration has the head's input moment (the report says which quantiser
    made the head); round-to-nearest, with a warning, when it has none."""
    if plan.head_weights != "int4":
        return {}
    if moment is None:
        wreport["head_quantiser"] = "round-to-nearest"
        say(f"--head-weights int4 without the head's input moment ({table} has no {names.HEAD_INPUT_MOMENT}): the "
            "head is rounded to nearest, about +6 % perplexity on SmolLM2 against +0.2-0.4 % by GPTQ; run "
            "`python -m calibration run` to fit it (docs/weights.md)")
        return {}
    import functools

    from builder.gptq import gptq_factor, gptq_quantize
    from builder.wquant import WeightQuantError

    try:
        factor = gptq_factor(moment, name=f"{table}: {names.HEAD_INPUT_MOMENT}")
    except WeightQuantError as e:
        raise BuildError(str(e)) from None
    wreport["head_quantiser"] = "gptq"
    quantize_rows = functools.partial(gptq_quantize, factor=factor)
    return dict.fromkeys(head_names(cfg), quantize_rows)


def _weights_record(rep: dict[str, Any]) -> dict[str, Any]:
    """The weight format as the bundle's manifest and bundle.json record it."""
    return {k: rep[k] for k in ("format", "group_size", "int4_grid", "head_weights", "head_group_size",
                                "head_quantiser", "gsm_weights", "quantised", "matmul_accuracy", "awq") if k in rep}


def load_awq_scales(path: Path, plan: MemoryPlan, tensors: Any, cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The AWQ scales of `python -m calibration.awq` for this build, checked: symmetric INT4 at the group
    they were searched for, one positive finite [K] per quantised projection of this checkpoint."""
    import numpy as np

    if plan.weights != "int4" or plan.int4_grid != "sym":
        raise BuildError(f"--awq-scales applies to --weights int4 --int4-grid sym; this build is {plan.weights}"
                         + (f" {plan.int4_grid}" if plan.weights == "int4" else "")
                         + (" (the asym-f grid of a Q4_1-style source is exact already)"
                            if plan.int4_grid == "asym-f" else ""))
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            scales = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as e:  # safetensors raises its own error types for a bad file
        raise BuildError(f"--awq-scales {path}: not a readable safetensors file ({e})") from None
    if meta.get("format") != checkpoint.AWQ_SCALES_FORMAT:
        raise BuildError(f"--awq-scales {path}: not a scales file of `python -m calibration.awq` (metadata format "
                         f"{meta.get('format')!r})")
    if meta.get("group_size") != str(plan.group_size):
        raise BuildError(f"--awq-scales {path}: searched for group {meta.get('group_size')}, this build quantises "
                         f"at --group-size {plan.group_size}")
    want = quantised_names(cfg)  # the embedding / LM head have no AWQ scale (a gather reads the codes): plain RTN
    missing = sorted(want - set(scales))
    if missing:
        raise BuildError(f"--awq-scales {path}: no scale for {missing[0]} (and {len(missing) - 1} more); "
                         "search them on this checkpoint")
    for name in sorted(want):
        s, k = scales[name], tensors.shape(name)[1]
        if s.shape != (k,) or not np.isfinite(s).all() or (s <= 0).any():
            raise BuildError(f"--awq-scales {path}: {name} must be {k} positive finite values, got shape "
                             f"{list(s.shape)}")
    alphas = json.loads(meta.get("alphas", "{}"))
    return ({n: scales[n] for n in want},
            {"scales": str(path), "projections": len(want),
             "alpha_mean": float(np.mean(list(alphas.values()))) if alphas else None})


def kv_tier_policy(quant: KVQuantConfig, ckpt: Path, calibration: Path | None, demo: bool,
                   uncalibrated: str) -> tuple[KVQuantConfig, dict[str, str]]:
    """The KV tiers a bundle may ship, and the note the build report carries about them.

    INT12/INT8 rows need scales fitted on real text: on SmolLM2 the data-free scales cost +16.5 %
    held-out perplexity against -0.09 % calibrated (issue 12). So a real checkpoint without
    calibration tables gets an FP16-only cache (tier fractions 1/0/0) unless the user asks for the
    data-free scales by name; the synthetic demo (random weights, quality meaningless) keeps its tiers.
    uncalibrated: one of build_config.UNCALIBRATED (BuildConfig checks it).
    """
    table = calibration if calibration is not None else ckpt / checkpoint.CALIB_FILE
    if quant.int8_keys and not ((calibration is not None or table.is_file()) and has_key_scales(table)):
        return _fp16_keys_policy(quant, ckpt, calibration, demo, uncalibrated, table)
    if calibration is not None or table.is_file():
        if quant.uses_int4 and not has_int4_tables(table):
            return _without_int4(quant), {
                "mode": "calibrated", "note": f"{table} has no fitted INT4 scales (scale_int4/comp_int4), so the "
                "INT4 share of the tier fractions is kept INT8; rerun `python -m calibration run` to fit them"}
        return quant, {"mode": "calibrated", "note": "INT12/INT8" + ("/INT4" if quant.uses_int4 else "") +
                       " tiers with calibrated scales" + (", INT8 indexer keys" if quant.int8_keys else "")}
    quant = _without_int4(quant)  # INT4 rows need scales fitted on text, whatever --uncalibrated says
    fractions = "/".join(f"{f:g}" for f in quant.tier_fractions)
    if demo:
        return quant, {"mode": "data-free", "note": f"DEMO model: tiers {fractions} with data-free scales"}
    if uncalibrated == "data-free":
        return quant, {"mode": "data-free", "note": f"no calibration tables: tiers {fractions} with DATA-FREE scales "
                       "(--uncalibrated data-free); expect a worse model than a calibrated one"}
    return (dataclasses.replace(quant, tier_fractions=(1.0, 0.0, 0.0)),
            {"mode": "fp16-only", "note": f"{ckpt} has no calibration tables, so the KV cache stays FP16 "
             f"(no INT12/INT8 tiers). Run `python -m calibration run --checkpoint {ckpt}` to enable them, "
             "or pass --uncalibrated data-free to use uncalibrated scales"})


def _asked_quant(quant: KVQuantConfig, tier_fractions: tuple[float, ...] | None, index_keys: str | None
                 ) -> KVQuantConfig:
    """The checkpoint's kv_quantization with the build's --tier-fractions / --index-keys."""
    if index_keys is not None:
        quant = dataclasses.replace(quant, index_key_bits=INDEX_KEYS[index_keys])
    if tier_fractions is not None:
        try:
            quant = quant.with_fractions(tuple(float(f) for f in tier_fractions))
        except ConfigError as e:
            raise BuildError(f"--tier-fractions: {e}") from None
    return quant


def _fp16_keys_policy(quant: KVQuantConfig, ckpt: Path, calibration: Path | None, demo: bool, uncalibrated: str,
                      table: Path) -> tuple[KVQuantConfig, dict[str, str]]:
    """index_key_bits 8 without key scales (a --calibration file from before them): FP16 keys, said so."""
    quant, info = kv_tier_policy(dataclasses.replace(quant, index_key_bits=16), ckpt, calibration, demo, uncalibrated)
    return quant, {**info, "note": info["note"] + f"; {table} has no INT8 indexer-key scales "
                   "(index_key.scale_int8), so the indexer keys stay FP16"}


def _without_int4(quant: KVQuantConfig) -> KVQuantConfig:
    """The tier fractions with the INT4 share moved to INT8 (a v1 triple)."""
    f16, f12, f8, f4 = quant.fractions4
    return quant if not quant.uses_int4 else dataclasses.replace(quant, tier_fractions=(f16, f12, f8 + f4))


def _maybe_engine(tmp: Path, plan: MemoryPlan, profile: Any, step: Callable[[str], None]) -> dict[str, Any]:
    from builder.trt_engine import EngineUnavailable, build_engine, tensorrt_status

    ok, reason = tensorrt_status()
    if not ok:
        return {"status": "to build on the target", "reason": reason, "command": ENGINE_COMMAND.format(bundle="BUNDLE")}
    step("TensorRT engine")
    try:
        return build_engine(tmp, plan, profile, tmp / FILES.engine)
    except EngineUnavailable as e:
        return {"status": "to build on the target", "reason": str(e), "command": ENGINE_COMMAND.format(bundle="BUNDLE")}


def _report(cfg: Any, plan: MemoryPlan, info: Any, calib: str, demo: bool, ck_hash: str, engine: dict,
            seconds: float, out: Path) -> dict[str, Any]:
    return {
        "demo_model": demo, "checkpoint_hash": ck_hash, "device": plan.device, "params": plan.params,
        "engine_weight_bytes": plan.weight_bytes, "portable_weight_file_bytes": info.weight_file_bytes,
        "largest_array_held_bytes": info.largest_tensor_bytes,
        "kv_bytes_per_position": plan.kv_bytes_per_position,
        "dense_fp16_kv_bytes_per_position": plan.dense_fp16_bytes_per_position,
        "kv_ratio_vs_dense_fp16": plan.kv_bytes_per_position / plan.dense_fp16_bytes_per_position,
        "max_seq": plan.max_seq, "max_batch": plan.max_batch, "max_input": plan.max_input,
        "largest_context_that_fits": plan.largest_fitting_seq, "plan_total_bytes": plan.total_bytes,
        "usable_bytes": plan.usable_bytes,
        "decode_tokens_per_s_estimate": plan.decode_tokens_per_s_estimate,
        "decode_tokens_per_s_estimate_note": plan.to_json()["decode_tokens_per_s_estimate_note"],
        "calibration": calib, "engine": engine, "build_seconds": round(seconds, 3), "bundle": str(out),
    }


def summary(r: BuildResult) -> str:
    """The short human summary printed at the end of a build."""
    p, rep = r.plan, r.report
    lines = [
        f"bundle {r.bundle}" + ("  (DEMO model: synthetic random weights)" if r.demo else ""),
        f"  device {p.device}: plan {fmt_bytes(p.total_bytes)} of {fmt_bytes(p.usable_bytes)} usable "
        f"(max-seq {p.max_seq} x max-batch {p.max_batch}); largest context that fits: {p.largest_fitting_seq}",
        f"  parameters {p.params:,}; on the device: weights {fmt_bytes(p.weight_bytes)}, "
        f"{weights_words(rep['weights'])}",
        f"  KV cache {p.kv_bytes_per_position:,.1f} B/position vs dense FP16 {p.dense_fp16_bytes_per_position:,} B "
        f"({rep['kv_ratio_vs_dense_fp16']:.1%})",
        f"  decode estimate {p.decode_tokens_per_s_estimate:,.0f} tokens/s (bandwidth roofline, batch 1, an estimate)",
        f"  {p.cpu_fit_line()}",
    ]
    if "kv_tiers" in rep:
        lines.insert(4, f"  KV tiers: {rep['kv_tiers']['mode']} ({rep['kv_tiers']['note']})")
    if "golden_probe" in rep:
        size = fmt_bytes(rep["golden_probe"]["bytes"])
        lines.append(f"  golden probe {FILES.probe} ({size}): check a backend against it with "
                     f"`python -m runtime verify {r.bundle} --backend onnxruntime|reference|tensorrt`")
    eng = rep["engine"]
    if eng.get("status") == "built":
        lines.append(f"  TensorRT engine: {FILES.engine} ({eng.get('tensorrt')})")
    else:
        lines.append(f"  TensorRT engine not built here ({eng['reason']}); on the target run: "
                     f"{ENGINE_COMMAND.format(bundle=r.bundle)}")
    lines.append(f"  {disk_line(r.bundle, r.files)}")
    return "\n".join(lines)
