"""Memory plan of a bundle on a device: does max-seq x max-batch fit, and what is the largest that does.

Why plan before building: a Jetson shares its DRAM with the OS, and an engine that does not fit
fails at the first long prompt on the target, hours after the build. So the builder computes every
buffer the engine and the runtime will allocate, refuses a request that does not fit *before it
writes anything*, and says by how much and what would fit.

What is counted (all on the target, TensorRT FP16 engine):
- weights: every tensor of spec 3 the engine uses, FP16 (dense K/V projections are ignored); with
  `weights="int8"|"int4"` the projections q, o, gate, up, down (and the LM head when asked) are
  counted at their quantised bytes (packed codes + FP16 group scales, builder/wquant.py), the rest
  FP16 (docs/weights.md);
- KV pools (spec 5, docs/engine_io.md section 3): per owning layer and sequence one byte buffer of
  FP16 / INT12 / INT8 regions sized by `pool_rows`, FP16 indexer keys for every position, and
  one int32 slot table per sequence;
- activations: an estimate of the largest live tensors of one forward call over `max_input`
  tokens (hidden states, MLP intermediates, index scores over the context and attention logits over
  the selected positions, K/V reconstructed for one layer, logits);
- workspace: TensorRT tactic workspace, a fixed estimate.

The decode speed is an *estimate* at the memory-bandwidth roofline: bytes read per decode step
(every weight once, the indexer keys of the whole context, the selected latent rows) divided by
the device's data-sheet bandwidth. Real kernels reach 60-80 % of it on Orin.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from builder.wquant import WeightQuantConfig, quantized_bytes
from gsm import names
from gsm.bundle_format import ROW_CACHE_TAGS, VERIFY_ROWS, IndexKeyLayout, PoolRows
from gsm.config import KVQuantConfig, ModelConfig
from gsm.tiers import avg_bytes, region_rows, row_bytes
from jetson.profiles import PROFILES, DeviceProfile

GIB = 2**30
WORKSPACE_BYTES = 256 * 2**20  # TensorRT tactic workspace we cap the builder at (estimate)
ENGINE_WEIGHT_BYTES = 2  # FP16 weights in the TensorRT engine
SLOT_ENTRY_BYTES = 4  # kv_slots entry: int32 (tier << 24) | row (docs/engine_io.md section 3)
# --weights choices, highest precision first (the order `--weights auto` tries them in)
WEIGHT_CHOICES = ("fp16", "int8", "int4")
# --weights with no flag: every weight stays FP16 on the device (the projections, and through DEFAULT_HEAD /
# DEFAULT_GSM the embedding / LM head and the GSM side); quantising costs quality, so a build does it when asked
DEFAULT_WEIGHTS = "fp16"
DEFAULT_GROUP_SIZE = 128  # INT4's default group
# INT8's default group along K (docs/weights.md "INT8 groups"): per channel missed the 0.5 % goal through
# the SmolLM2 bundle (+0.70 % exact, +1.40 % fast); g32 met it at ONNX Runtime's fast kernel speed (+0.06 %),
# which quantises activations in blocks of the weight group, so a small group helps both sides
DEFAULT_INT8_GROUP_SIZE = 32
PER_CHANNEL = 0  # group_size value meaning one group per output row (INT8 only)
# INT4 grids: symmetric codes (TensorRT's native form), or asymmetric with a float zero point (min -> 0,
# max -> 15: llama.cpp's Q4_1 grid, exact for Q4_1 sources at group 32; docs/weights.md)
INT4_GRIDS = ("sym", "asym-f")
# weight-only quantised projections; GSM latent / indexer / projector weights and norms stay FP16 (small,
# and the latents' error budget is the KV tiers')
QUANTISED_KEYS = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# --head-weights: the embedding and the LM head (one tensor when tied), per group of HEAD_GROUP_SIZES[bits] whatever
# the projections' group and grid. INT8 symmetric at group 64: on SmolLM2 (whose Q8_0 source has blocks of 32) it
# holds the held-out perplexity of group 32 (docs/weights.md) with half the scales a decode step reads. INT4 on the
# float-zero-point grid at group 32 (Q4_1's), quantised by GPTQ on the head's input moment when the calibration
# file has one (builder/gptq.py), else round-to-nearest
HEAD_CHOICES = WEIGHT_CHOICES
HEAD_GROUP_SIZES = {8: 64, 4: 32}
# the --head-weights a --weights choice implies. Without calibration an INT4 build keeps an INT8 head: on SmolLM2
# (tied, 28 M of its 135 M parameters) a round-to-nearest INT4 head cost +6 % held-out perplexity (+12 % symmetric),
# all of it the logits'; GPTQ on the calibration text's head inputs brings that to +0.2-0.4 % (docs/weights.md), so a
# calibrated INT4 build's head is INT4 (DEFAULT_HEAD_CALIBRATED)
DEFAULT_HEAD = {"fp16": "fp16", "int8": "int8", "int4": "int8"}
DEFAULT_HEAD_CALIBRATED = {**DEFAULT_HEAD, "int4": "int4"}
# the GSM-side projections of owning layers (latent down-projections Vt and the indexer's key, query and weight
# projections, one stored tensor in_proj per layer): FP16, or INT8 symmetric per output channel (GSM_SIDE_CONFIG:
# the TensorRT form always, and the ONNX Runtime forms of an exact build), or, in the ONNX Runtime forms of a fast
# build (INT8 activations), per group of 32 inputs (GSM_SIDE_FAST_CONFIG): MatMulNBits quantises the activations in
# blocks of the weight group, and per channel that block is the whole row (+0.50 % perplexity on SmolLM2, against
# -0.01 % at group 32; docs/weights.md)
GSM_CHOICES = ("fp16", "int8")
DEFAULT_GSM = {"fp16": "fp16", "int8": "int8", "int4": "int8"}
GSM_SIDE_KEYS = ("k_Vt", "v_Vt", "idx_k", "idx_q", "idx_w")  # builder.network's in_proj blocks, in order
GSM_SIDE_CONFIG = WeightQuantConfig(8, None)
GSM_SIDE_FAST_CONFIG = WeightQuantConfig(8, 32)  # its TensorRT form is per channel (qlinear.trt_config): the same


class PlanError(ValueError):
    """The request cannot be planned (max-seq beyond the model) or does not fit the device."""


def pool_rows(max_seq: int, max_input: int, cfg: ModelConfig, quant: KVQuantConfig, *,
              hot_rows: int = 0, max_rate: int = 0) -> PoolRows:
    """Region sizes of docs/engine_io.md section 3 (gsm.tiers.region_rows) for the model's tier policy, with room
    for re-tier passes as far apart as `max_rate` decode steps where that is more than the model's own
    quantization_adaptation_rate (so a bundle patch may lengthen it: gsm.bundle_knobs)."""
    rate = max(cfg.gsm.quantization_adaptation_rate, max_rate)
    return PoolRows(*region_rows(max_seq, max_input, cfg.gsm.sink_tokens, quant.fp16_window, quant.tier_fractions,
                                 rate, hot_rows))


# the row cache keeps this many times a query's top-k picks by default (--row-cache-factor; decisions "CPU cache")
ROW_CACHE_TOP_K_FACTOR = 3


def row_cache_capacity(cfg: ModelConfig, layer: int, max_seq: int, factor: int = ROW_CACHE_TOP_K_FACTOR) -> int:
    """C of layer `layer`'s row cache of K rows on the CPU graph (a sharing layer: its source's selection): the sinks
    and window one query selects with the default budgets at max_seq, and `factor` times its top-k. The
    indexer's picks change from step to step (SmolLM2 at 8K: ~150 of ~500 per layer), and a pick that drops out
    often comes back a few steps later: with room for three times the picks, least-recently-read eviction keeps those
    (bench/row_cache_churn.py; a streaming layer, top-k 0, keeps exactly its window). A larger run-time budget or a
    prefill chunk's union makes its surplus rows per call."""
    g = cfg.gsm
    owner = g.kv_sharing.get(layer, layer)
    top_k = g.selection_of(owner).top_k_at(max_seq - 1)
    return min(max_seq, g.sink_tokens + g.layer_max_window(owner) + factor * top_k)


def pool_words(r_k: int, r_v: int, rows: PoolRows) -> int:
    """P32 of `kv_pool.{l}`: ceil((C16 W16 + C12 W12 + C8 W8 + C4 W4) / 4) int32 words (engine_io section 2)."""
    return math.ceil(sum(c * w for c, w in zip(rows.by_tier, row_bytes(r_k, r_v))) / 4)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    max_seq: int
    max_batch: int
    max_input: int
    params: int
    weight_bytes: int
    pool_rows: PoolRows
    kv_pool_bytes: int  # latent pools + indexer keys + slot tables, all sequences
    activation_bytes: int
    workspace_bytes: int
    usable_bytes: int
    kv_bytes_per_position: float  # spec 6 steady state under tier_fractions
    dense_fp16_bytes_per_position: int  # spec 6 baseline
    largest_fitting_seq: int  # at this max_batch (0 when even one position does not fit)
    decode_bytes_per_token: int  # estimate, batch 1 at max_seq
    decode_tokens_per_s_estimate: float
    weights: str = "fp16"  # WEIGHT_CHOICES: what weight_bytes counts
    group_size: int = DEFAULT_GROUP_SIZE  # group along K of the quantised projections (PER_CHANNEL: one per row)
    head_weights: str = "fp16"  # HEAD_CHOICES: the embedding and LM head
    int4_grid: str = "sym"  # INT4_GRIDS
    gsm_weights: str = "fp16"  # GSM_CHOICES: the GSM-side projections (in_proj)
    max_top_k: int = 0  # largest per-sequence selection budget the TensorRT graph takes (0: not given)
    cpu_kv_bytes: int = 0  # the onnxruntime backend's cache, all rows: pools, keys, row caches (cpu_cache_bytes)
    row_cache_bytes: int = 0  # of that, one sequence's row caches of K rows (constant in the context)
    # the longest re-tier period the FP16 region has room for (--max-adaptation-rate; at least the model's): a
    # bundle patch may lengthen quantization_adaptation_rate up to it (gsm.bundle_knobs)
    max_adaptation_rate: int = 0
    row_cache_factor: int = ROW_CACHE_TOP_K_FACTOR  # the CPU graph's row caches: this many times a query's top-k

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_pool_bytes + self.activation_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def cpu_total_bytes(self) -> int:
        """The same plan on the onnxruntime backend: its cache (`cpu_kv_bytes`) in place of the TensorRT pools."""
        return self.weight_bytes + self.cpu_kv_bytes + self.activation_bytes + self.workspace_bytes

    @property
    def cpu_fits(self) -> bool:
        return self.cpu_total_bytes <= self.usable_bytes

    def cpu_fit_line(self) -> str:
        """What the build summary says of the CPU backend's memory on this device."""
        head = (f"CPU backend (model.cpu.onnx) holds {fmt_bytes(self.cpu_kv_bytes // self.max_batch)} per sequence "
                f"at max-seq (a row cache of {fmt_bytes(self.row_cache_bytes)} of it, whatever the context); plan "
                f"{fmt_bytes(self.cpu_total_bytes)} of {fmt_bytes(self.usable_bytes)} usable")
        if self.cpu_fits:
            return head
        return (f"{head}: does not fit {self.device}, short by {fmt_bytes(self.cpu_total_bytes - self.usable_bytes)} "
                "(lower --max-seq or --max-batch)")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        d["fits"] = self.fits
        d["cpu_total_bytes"] = self.cpu_total_bytes
        d["cpu_fits"] = self.cpu_fits
        d["decode_tokens_per_s_estimate_note"] = (
            "estimate: memory-bandwidth roofline (bytes read per decode step / data-sheet bandwidth), "
            "batch 1 at max_seq; real kernels reach a fraction of it")
        return d


def param_count(cfg: ModelConfig, ranks: dict[int, tuple[int, int]]) -> int:
    """Parameters the engine holds (spec 3 required tensors; tied heads counted once)."""
    return sum(math.prod(s) for s in names.expected_shapes(cfg, ranks).values())


def default_group_size(weights: str) -> int:
    """The group a --weights choice uses when --group-size is not given."""
    return DEFAULT_INT8_GROUP_SIZE if weights == "int8" else DEFAULT_GROUP_SIZE


def weight_config(weights: str, group_size: int | None = None, int4_grid: str = "sym"
                  ) -> WeightQuantConfig | None:
    """The quantisation a --weights choice means: None for fp16, symmetric INT8 per group (or per channel:
    group_size PER_CHANNEL), INT4 per group on `int4_grid`. group_size None: the format's default."""
    if weights not in WEIGHT_CHOICES:
        raise PlanError(f"--weights must be one of {', '.join(WEIGHT_CHOICES)} or auto, got {weights!r}")
    if int4_grid not in INT4_GRIDS:
        raise PlanError(f"--int4-grid must be one of {', '.join(INT4_GRIDS)} or auto, got {int4_grid!r}")
    if weights == "fp16":
        return None
    group = default_group_size(weights) if group_size is None else group_size
    if group == PER_CHANNEL and weights != "int8":
        raise PlanError(f"--group-size channel is for --weights int8 only, not {weights}")
    try:
        if weights == "int8":
            return WeightQuantConfig(8, None if group == PER_CHANNEL else group)
        if int4_grid == "asym-f":
            return WeightQuantConfig(4, group, symmetric=False, float_zero_point=True)
        return WeightQuantConfig(4, group)
    except ValueError as e:
        raise PlanError(f"--group-size: {e}") from None


def head_names(cfg: ModelConfig) -> set[str]:
    """The embedding and the LM head (one tensor when tied)."""
    return {names.EMBED} | (set() if cfg.tie_word_embeddings else {names.LM_HEAD})


def head_choice(weights: str, head_weights: str | None, head_moment: bool = False) -> str:
    """The --head-weights a build uses: the one asked for, else the default of the --weights choice
    (DEFAULT_HEAD_CALIBRATED when the calibration has the head's input moment, DEFAULT_HEAD otherwise)."""
    if head_weights is not None:
        return head_weights
    return (DEFAULT_HEAD_CALIBRATED if head_moment else DEFAULT_HEAD)[weights]


def head_config(head_weights: str) -> WeightQuantConfig | None:
    """The quantisation --head-weights means: None for fp16, INT8 symmetric, or INT4 on the float-zero-point grid,
    at HEAD_GROUP_SIZES of its bits."""
    if head_weights not in HEAD_CHOICES:
        raise PlanError(f"--head-weights must be one of {', '.join(HEAD_CHOICES)}, got {head_weights!r}")
    if head_weights == "fp16":
        return None
    if head_weights == "int8":
        return WeightQuantConfig(8, HEAD_GROUP_SIZES[8])
    return WeightQuantConfig(4, HEAD_GROUP_SIZES[4], symmetric=False, float_zero_point=True)


def gsm_choice(weights: str, gsm_weights: str | None) -> str:
    """The --gsm-weights a build uses: the one asked for, else DEFAULT_GSM of the --weights choice."""
    choice = DEFAULT_GSM[weights] if gsm_weights is None else gsm_weights
    if choice not in GSM_CHOICES:
        raise PlanError(f"--gsm-weights must be one of {', '.join(GSM_CHOICES)}, got {choice!r}")
    return choice


def gsm_side_names(cfg: ModelConfig) -> set[str]:
    """The GSM-side projections of every owning layer (what --gsm-weights int8 quantises)."""
    return {names.layer_name(k, i) for k in GSM_SIDE_KEYS for i in cfg.owning_layers}


def weight_configs(cfg: ModelConfig, weights: str = "fp16", group_size: int | None = None, int4_grid: str = "sym",
                   head_weights: str | None = None, gsm_weights: str | None = None, *,
                   fast_matmuls: bool = False) -> dict[str, WeightQuantConfig]:
    """The quantisation of every tensor a --weights / --head-weights / --gsm-weights choice replaces, by checkpoint
    name (head_weights / gsm_weights None: DEFAULT_HEAD / DEFAULT_GSM of the --weights choice). Empty: all FP16.
    fast_matmuls (--matmul-accuracy fast): the GSM side at GSM_SIDE_FAST_CONFIG, else GSM_SIDE_CONFIG."""
    wq = weight_config(weights, group_size, int4_grid)
    hq = head_config(head_choice(weights, head_weights))
    out: dict[str, WeightQuantConfig] = {}
    if wq is not None:
        out.update(dict.fromkeys(quantised_names(cfg), wq))
    if hq is not None:
        out.update(dict.fromkeys(head_names(cfg), hq))
    if gsm_choice(weights, gsm_weights) == "int8":
        out.update(dict.fromkeys(gsm_side_names(cfg), GSM_SIDE_FAST_CONFIG if fast_matmuls else GSM_SIDE_CONFIG))
    return out


def quantised_names(cfg: ModelConfig) -> set[str]:
    """The projections a quantised --weights choice replaces (q, o, gate, up, down of every layer)."""
    return {names.layer_name(k, i) for k in QUANTISED_KEYS for i in range(cfg.num_hidden_layers)}


def tensor_bytes(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], *, weights: str = "fp16",
                 group_size: int | None = None, head_weights: str | None = None,
                 int4_grid: str = "sym", gsm_weights: str | None = None) -> dict[str, int]:
    """Device bytes of every spec-3 tensor the engine holds (tied head once) under a --weights choice."""
    configs = weight_configs(cfg, weights, group_size, int4_grid, head_weights, gsm_weights)
    out = {}
    for name, shape in names.expected_shapes(cfg, ranks).items():
        if name in configs:
            out[name] = quantized_bytes(shape[0], shape[1], configs[name])
        else:
            out[name] = math.prod(shape) * ENGINE_WEIGHT_BYTES
    return out


def weight_bytes(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], *, weights: str = "fp16",
                 group_size: int | None = None, head_weights: str | None = None, int4_grid: str = "sym",
                 gsm_weights: str | None = None) -> int:
    """Engine weight bytes under a --weights choice (fp16 = 2 bytes per parameter)."""
    return sum(tensor_bytes(cfg, ranks, weights=weights, group_size=group_size,
                            head_weights=head_weights, int4_grid=int4_grid, gsm_weights=gsm_weights).values())


def key_bytes(cfg: ModelConfig, quant: KVQuantConfig) -> int:
    """Device bytes of one position's indexer key in one owning layer: dI * 2 FP16, dI INT8 (in int32 words)."""
    return IndexKeyLayout(cfg.gsm.indexer_dim, quant.index_key_bits).bytes


def kv_bytes_per_position(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], quant: KVQuantConfig) -> float:
    """Spec 6: sum over owning layers of (r_k + r_v) * average tier bytes + the indexer key's bytes."""
    avg = avg_bytes(quant.tier_fractions)
    return sum((rk + rv) * avg + key_bytes(cfg, quant) for rk, rv in ranks.values())


def dense_fp16_bytes_per_position(cfg: ModelConfig) -> int:
    """Spec 6 baseline: L * 2 * kvD * 2."""
    return cfg.num_hidden_layers * 2 * cfg.kv_dim * 2


def kv_pool_bytes(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], rows: PoolRows, max_seq: int,
                  max_batch: int, quant: KVQuantConfig) -> int:
    """Bytes of kv_pool.{l} + index_keys.{l} of every owning layer and of kv_slots, all sequences."""
    per_seq = max_seq * SLOT_ENTRY_BYTES
    for rk, rv in ranks.values():
        per_seq += 4 * pool_words(rk, rv, rows) + max_seq * key_bytes(cfg, quant)
    return per_seq * max_batch


def row_cache_bytes(cfg: ModelConfig, max_seq: int, factor: int = ROW_CACHE_TOP_K_FACTOR) -> int:
    """One sequence's row caches on the CPU graph (every layer: row_cache_capacity K rows of kvD float32 and their three
    int32 tags each): a constant of the plan, independent of the context."""
    return sum(row_cache_capacity(cfg, i, max_seq, factor) * (4 * cfg.kv_dim + 4 * ROW_CACHE_TAGS)
               for i in range(cfg.num_hidden_layers))


def cpu_cache_bytes(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], rows: PoolRows, max_seq: int,
                    max_batch: int, quant: KVQuantConfig, row_cache_factor: int = ROW_CACHE_TOP_K_FACTOR) -> int:
    """What the onnxruntime backend holds for the plan's rows running model.cpu.onnx: the TensorRT graph's pools and
    indexer keys (kv_pool_bytes without the slot tables, which the runtime keeps as host tables per sequence) and
    each row's row cache of K rows (row_cache_bytes)."""
    slots = max_seq * SLOT_ENTRY_BYTES * max_batch
    pools = kv_pool_bytes(cfg, ranks, rows, max_seq, max_batch, quant)
    return pools - slots + row_cache_bytes(cfg, max_seq, row_cache_factor) * max_batch


def activation_bytes(cfg: ModelConfig, max_seq: int, max_batch: int, max_input: int,
                     max_top_k: int | None = None) -> int:
    """Largest live tensors of one forward call over B x T tokens at context S (estimate, FP16/FP32),
    plus the per-layer outputs the TensorRT engine holds all at once (`selected.{l}`
    [B, T, K_sel] int32 with K_sel = sinks + max_sparse_window + max_top_k, `attn_mass.{l}` [B, S] float32
    for every owning layer; max_top_k None: the model's sparse_top_k, the default) and the owning layers' query
    masses, [B, J, S] float32 each (J: a verification's rows, at most VERIFY_ROWS), which the graph's one Sum
    reads all at once."""
    B, T, S = max_batch, max_input, max_seq
    g = cfg.gsm
    hidden = B * T * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 2
    own = cfg.owning_layers
    sel = min(S, max(g.sink_tokens + g.layer_max_window(l) + g.selection_of(l).top_k_at(S - 1) for l in own))
    scores = B * T * (S * g.indexer_heads + sel * cfg.num_attention_heads) * 4  # index + attention
    kv = B * S * 2 * cfg.kv_dim * 2  # one layer's reconstructed K/V
    logits = B * T * cfg.vocab_size * 4
    mtk = g.max_top_k_to(S) if max_top_k is None else max_top_k
    k_sel = sum(g.k_sel(l, mtk) for l in own)  # each layer's own window
    per_layer = B * (T * k_sel + len(own) * S) * 4
    query_mass = B * min(T, VERIFY_ROWS) * S * len(own) * 4
    return hidden + scores + kv + logits + per_layer + query_mass


def decode_bytes_per_token(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], quant: KVQuantConfig,
                           tensors: dict[str, int], context: int) -> int:
    """Bytes one decode step reads at batch 1: all weights (`tensors`: bytes by name; the embedding
    only one row, unless it is the tied head), every indexer key of the context, the selected latent
    rows of every layer."""
    g = cfg.gsm
    embed = 0 if cfg.tie_word_embeddings else tensors[names.EMBED]
    weights = sum(tensors.values()) - embed + cfg.hidden_size * ENGINE_WEIGHT_BYTES
    avg = avg_bytes(quant.tier_fractions)
    kv = 0.0
    for i in range(cfg.num_hidden_layers):
        src = i if cfg.is_owning(i) else g.kv_sharing[i]
        rk, rv = ranks[src]
        selected = min(context, g.sink_tokens + g.selection_of(src).rows_at(context - 1))
        kv += selected * (rk + rv) * avg
        if cfg.is_owning(i):
            kv += context * key_bytes(cfg, quant)
    return int(weights + kv)


@dataclass(frozen=True)
class PlanRequest:
    """What one plan is asked for: the build's sizes and weight formats (None: the model's or the format's default)."""

    max_seq: int | None = None  # None: the model's max_position_embeddings
    max_batch: int = 1
    max_input: int | None = None  # None: min(max_seq, 512)
    weights: str = "fp16"  # one of WEIGHT_CHOICES ("auto" only through choose_weights)
    group_size: int | None = None  # None: default_group_size(weights)
    head_weights: str | None = None  # None: head_choice's default
    int4_grid: str = "sym"
    max_top_k: int | None = None  # the TensorRT graph's largest per-sequence budget (None: the model's sparse_top_k)
    gsm_weights: str | None = None  # None: gsm_choice's default
    head_moment: bool = False  # the calibration has the head's input moment (head_choice)
    max_rate: int = 0  # --max-adaptation-rate (0: the model's quantization_adaptation_rate)
    row_cache_factor: int = ROW_CACHE_TOP_K_FACTOR  # --row-cache-factor


def make_plan(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], quant: KVQuantConfig,
              profile: DeviceProfile, request: PlanRequest) -> MemoryPlan:
    """The plan for one request; PlanError for impossible requests (not for ones that do not fit:
    callers decide, see `require_fit`). `request.weights` is one of WEIGHT_CHOICES (see `choose_weights`
    for auto)."""
    r = request
    max_seq = cfg.max_position_embeddings if r.max_seq is None else r.max_seq
    max_batch, max_top_k, max_rate = r.max_batch, r.max_top_k, r.max_rate
    if max_seq > cfg.max_position_embeddings:
        raise PlanError(f"--max-seq {max_seq} is beyond the model's max_position_embeddings "
                        f"({cfg.max_position_embeddings}); use --max-seq {cfg.max_position_embeddings} or less")
    if max_seq < 1 or max_batch < 1:
        raise PlanError(f"--max-seq and --max-batch must be >= 1, got {max_seq} and {max_batch}")
    if r.row_cache_factor < 1:
        raise PlanError(f"--row-cache-factor must be >= 1, got {r.row_cache_factor}")
    max_input = min(max_seq, 512) if r.max_input is None else r.max_input
    if not 1 <= max_input <= max_seq:
        raise PlanError(f"--max-input must be in [1, max-seq={max_seq}], got {max_input}")
    low = cfg.gsm.max_top_k_to(max_seq)
    if max_top_k is not None and not low <= max_top_k <= max_seq:
        raise PlanError(f"--max-top-k must be in [{low} (the model's largest top-k within max-seq), "
                        f"max-seq={max_seq}], got {max_top_k}")
    params = param_count(cfg, ranks)
    weights, int4_grid = r.weights, r.int4_grid
    group_size = default_group_size(weights) if r.group_size is None else r.group_size
    head_weights = head_choice(weights, r.head_weights, r.head_moment)
    gsm_weights = gsm_choice(weights, r.gsm_weights)
    tensors = tensor_bytes(cfg, ranks, weights=weights, group_size=group_size, head_weights=head_weights,
                           int4_grid=int4_grid, gsm_weights=gsm_weights)
    wbytes = sum(tensors.values())

    def total(S: int) -> int:
        T = min(max_input, S)
        rows = pool_rows(S, T, cfg, quant, max_rate=max_rate)
        return wbytes + kv_pool_bytes(cfg, ranks, rows, S, max_batch, quant) + \
            activation_bytes(cfg, S, max_batch, T, None if max_top_k is None else min(max_top_k, S)) + \
            WORKSPACE_BYTES

    largest = _largest(total, profile.usable_bytes, cfg.max_position_embeddings)
    rows = pool_rows(max_seq, max_input, cfg, quant, max_rate=max_rate)
    dbytes = decode_bytes_per_token(cfg, ranks, quant, tensors, max_seq)
    return MemoryPlan(
        device=profile.name, max_seq=max_seq, max_batch=max_batch, max_input=max_input, params=params,
        weight_bytes=wbytes, pool_rows=rows, kv_pool_bytes=kv_pool_bytes(cfg, ranks, rows, max_seq, max_batch, quant),
        activation_bytes=activation_bytes(cfg, max_seq, max_batch, max_input, max_top_k),
        workspace_bytes=WORKSPACE_BYTES,
        usable_bytes=profile.usable_bytes, kv_bytes_per_position=kv_bytes_per_position(cfg, ranks, quant),
        dense_fp16_bytes_per_position=dense_fp16_bytes_per_position(cfg), largest_fitting_seq=largest,
        decode_bytes_per_token=dbytes, decode_tokens_per_s_estimate=profile.bandwidth_bytes_s / dbytes,
        weights=weights, group_size=group_size, head_weights=head_weights, int4_grid=int4_grid,
        gsm_weights=gsm_weights, max_top_k=cfg.gsm.max_top_k_to(max_seq) if max_top_k is None else max_top_k,
        cpu_kv_bytes=cpu_cache_bytes(cfg, ranks, rows, max_seq, max_batch, quant, r.row_cache_factor),
        row_cache_bytes=row_cache_bytes(cfg, max_seq, r.row_cache_factor),
        max_adaptation_rate=max(cfg.gsm.quantization_adaptation_rate, max_rate), row_cache_factor=r.row_cache_factor)


def choose_weights(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], quant: KVQuantConfig,
                   profile: DeviceProfile, request: PlanRequest) -> MemoryPlan:
    """The plan at `request.weights`; for "auto" the highest precision of WEIGHT_CHOICES whose plan fits
    (the lowest one's plan when none does, so `require_fit` explains the refusal)."""
    if request.weights != "auto":
        return make_plan(cfg, ranks, quant, profile, request)
    plan = None
    for choice in WEIGHT_CHOICES:
        plan = make_plan(cfg, ranks, quant, profile, replace(request, weights=choice))
        if plan.fits:
            return plan
    assert plan is not None
    return plan


def _largest(total, budget: int, hi: int) -> int:
    """Largest S in [1, hi] with total(S) <= budget (total grows with S); 0 when none."""
    if total(1) > budget:
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def require_fit(plan: MemoryPlan, cfg: ModelConfig, ranks: dict[int, tuple[int, int]],
                quant: KVQuantConfig) -> None:
    """PlanError when the plan does not fit: by how much, and what would fit instead."""
    if plan.fits:
        return
    short = plan.total_bytes - plan.usable_bytes
    msg = (f"the plan does not fit {plan.device}: it needs {fmt_bytes(plan.total_bytes)} (weights "
           f"{fmt_bytes(plan.weight_bytes)} {plan.weights.upper()}, KV pools {fmt_bytes(plan.kv_pool_bytes)}, "
           f"activations "
           f"{fmt_bytes(plan.activation_bytes)}, workspace {fmt_bytes(plan.workspace_bytes)}), "
           f"{fmt_bytes(plan.usable_bytes)} usable: short by {fmt_bytes(short)}. ")
    if plan.largest_fitting_seq > 0:
        msg += f"At --max-batch {plan.max_batch}, --max-seq {plan.largest_fitting_seq} fits"
        if plan.max_batch > 1:
            one = make_plan(cfg, ranks, quant, PROFILES[plan.device], _request_of(plan, max_batch=1))
            if one.fits:
                msg += f"; at --max-batch 1, --max-seq {plan.max_seq} fits"
        msg += "."
    else:
        bigger = [p.name for p in sorted(PROFILES.values(), key=lambda p: p.usable_bytes)
                  if make_plan(cfg, ranks, quant, p, _request_of(plan)).fits]
        msg += "No context length fits on this device; " + (
            f"it fits on: {', '.join(bigger)}." if bigger else "no known device fits it.")
    profile = PROFILES.get(plan.device)
    lower = [w for w in WEIGHT_CHOICES[WEIGHT_CHOICES.index(plan.weights) + 1:]
             if profile is not None and make_plan(cfg, ranks, quant, profile, _request_of(plan, weights=w)).fits]
    if lower:
        msg += f" With --weights {lower[0]} it fits at --max-seq {plan.max_seq}."
    low = cfg.gsm.max_top_k_to(plan.max_seq)
    if profile is not None and plan.max_top_k > low and make_plan(
            cfg, ranks, quant, profile, _request_of(plan, max_top_k=low)).fits:
        msg += (f" With --max-top-k {low} it fits (the TensorRT graph's per-layer selection outputs shrink; "
                "a sequence can then not switch to dense attention there).")
    raise PlanError(msg)


def _request_of(plan: MemoryPlan, **changes: Any) -> PlanRequest:
    """The request that makes `plan` again (its weight formats as the plan resolved them), with `changes`."""
    return replace(PlanRequest(max_seq=plan.max_seq, max_batch=plan.max_batch, max_input=plan.max_input,
                               weights=plan.weights, group_size=plan.group_size, head_weights=plan.head_weights,
                               int4_grid=plan.int4_grid, max_top_k=plan.max_top_k, gsm_weights=plan.gsm_weights,
                               max_rate=plan.max_adaptation_rate), **changes)
