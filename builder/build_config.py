"""The options of one build: `python -m builder build`'s flags as one checked dataclass, `builder.build.build`'s input.

Every option is checked when a BuildConfig is made, before anything is read or written: a bad value is one
BuildError naming the flag, the choices and the value (the CLI's argparse catches most of them first). What depends
on the checkpoint (whether it fits, whether its calibration has what a flag asks for) is checked by the build.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from builder.plan import HEAD_CHOICES, INT4_GRIDS, PER_CHANNEL, ROW_CACHE_TOP_K_FACTOR, WEIGHT_CHOICES, PlanRequest


class BuildError(RuntimeError):
    """A build refused or failed; the message is the whole explanation (no traceback needed)."""


UNCALIBRATED = ("fp16", "data-free")  # --uncalibrated
WEIGHTS = (*WEIGHT_CHOICES, "auto")  # --weights
INT4_GRID_CHOICES = ("auto", *INT4_GRIDS)  # --int4-grid
MATMUL_ACCURACY = {"exact": 0, "fast": 4}  # --matmul-accuracy -> MatMulNBits accuracy_level
INDEX_KEYS = {"int8": 8, "fp16": 16}  # --index-keys -> kv_quantization.index_key_bits


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """Every option of a build, with the Python API's defaults (the CLI's are the same but for `uncalibrated`: the
    CLI keeps an uncalibrated checkpoint's cache FP16, the API uses data-free scales for the golden-regression
    tests; docs/builder.md).

    weights: fp16 | int8 | int4 | auto (the highest precision whose plan fits); group_size: the group along
    K (INT4 default 128 or the detected grid's; INT8 default 32, plan.PER_CHANNEL = one per row);
    int4_grid: auto | sym | asym-f (docs/weights.md); head_weights: fp16 | int8 | int4, the embedding and LM
    head (None: plan.head_choice's default, INT4 for a calibrated INT4 build; plan.head_config; an INT4 head is
    quantised by GPTQ on the calibration's head input moment when there is one);
    matmul_accuracy: exact | fast, the portable graph's MatMulNBits accuracy level (0 / 4); default
    fast for INT8 and INT4 (ONNX Runtime has no fast float32 INT8 kernel, and INT4 decodes 6-54 % faster
    with INT8 activations at +0.07 % perplexity on SmolLM2, docs/weights.md); awq_scales: a
    `python -m calibration.awq` file (symmetric INT4 only); tier_fractions: the KV tier fractions instead of the
    checkpoint's (three or four); index_keys: int8 | fp16 instead of the checkpoint's index_key_bits; gsm_weights:
    fp16 | int8 (per output channel), the GSM-side projections (None: DEFAULT_GSM of the --weights choice);
    max_adaptation_rate: room in the FP16 region for re-tier passes this many decode steps apart (0: the model's
    quantization_adaptation_rate), so that a bundle patch may lengthen the rate up to it; row_cache_factor: the CPU
    graph's row caches of K rows hold sinks, window and this many times a query's top-k (fewer: less memory, more
    rows made again each step)."""

    device: str  # a profile of jetson/profiles.py, or "auto"
    checkpoint: Path | None = None  # None: the synthetic demo model
    output: Path | None = None  # None: out/<checkpoint>-<device> (builder.build.default_output)
    max_seq: int | None = None  # None: the model's max_position_embeddings
    max_batch: int = 1
    max_input: int | None = None  # None: min(max_seq, 512)
    calibration: Path | None = None  # a kv_calibration.safetensors instead of the checkpoint's
    overwrite: bool = False
    logits: str = "last"  # "last" | "all"
    debug_outputs: bool = False  # tests only: bind each owning layer's selected.{l}
    trt_precision: str = "fp16"  # activations of model.onnx: "fp16" | "fp32"
    uncalibrated: str = "data-free"  # UNCALIBRATED
    weights: str = "fp16"  # WEIGHTS
    group_size: int | None = None
    int4_grid: str = "auto"  # INT4_GRID_CHOICES
    head_weights: str | None = None  # HEAD_CHOICES
    matmul_accuracy: str | None = None  # MATMUL_ACCURACY
    awq_scales: Path | None = None
    max_top_k: int | None = None  # None: the model's sparse_top_k
    tier_fractions: tuple[float, ...] | None = None
    index_keys: str | None = None  # INDEX_KEYS
    gsm_weights: str | None = None
    max_adaptation_rate: int = 0
    row_cache_factor: int = ROW_CACHE_TOP_K_FACTOR

    def __post_init__(self) -> None:
        for name in ("checkpoint", "output", "calibration", "awq_scales"):  # a str is taken as the path it names
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        check_weight_options(self.weights, self.group_size, self.int4_grid, self.matmul_accuracy, self.head_weights)
        _check_choice("--uncalibrated", self.uncalibrated, UNCALIBRATED)
        if self.index_keys is not None:
            _check_choice("--index-keys", self.index_keys, INDEX_KEYS)

    def plan_request(self, *, group_size: int | None, int4_grid: str, head_moment: bool) -> PlanRequest:
        """The memory plan's request of this build, at the group and INT4 grid the build resolved (`int4_grid`
        auto looks at the checkpoint: builder.build.resolve_int4_grid)."""
        return PlanRequest(max_seq=self.max_seq, max_batch=self.max_batch, max_input=self.max_input,
                           weights=self.weights, group_size=group_size, head_weights=self.head_weights,
                           int4_grid=int4_grid, max_top_k=self.max_top_k, gsm_weights=self.gsm_weights,
                           head_moment=head_moment, max_rate=self.max_adaptation_rate,
                           row_cache_factor=self.row_cache_factor)


def _check_choice(flag: str, value: object, choices: tuple[str, ...] | dict[str, int]) -> None:
    if value not in choices:
        raise BuildError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def check_weight_options(weights: str, group_size: int | None, int4_grid: str, matmul_accuracy: str | None,
                         head_weights: str | None) -> None:
    """BuildError for a weight option outside its choices, or a group size the format cannot take."""
    _check_choice("--weights", weights, WEIGHTS)
    if head_weights is not None:
        _check_choice("--head-weights", head_weights, HEAD_CHOICES)
    _check_choice("--int4-grid", int4_grid, INT4_GRID_CHOICES)
    if matmul_accuracy is not None:
        _check_choice("--matmul-accuracy", matmul_accuracy, MATMUL_ACCURACY)
    if group_size == PER_CHANNEL and weights != "int8":
        raise BuildError(f"--group-size channel (one group per output row) is for --weights int8 only, not {weights}")
    if group_size not in (None, PER_CHANNEL) and (group_size < 16 or group_size & (group_size - 1)):
        raise BuildError(f"--group-size must be a power of two >= 16 (ONNX Runtime's MatMulNBits) or channel, "
                         f"got {group_size}")
