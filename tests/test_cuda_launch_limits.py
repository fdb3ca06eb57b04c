"""Every CUDA kernel launch within the SM limits of the devices the builder targets, checked without a GPU.

Why statically: a launch beyond a limit (1024 threads per block, gridDim.y 65535, 48 KiB of shared memory without
the opt-in, 163 / 227 KiB with it, 64K registers per block) fails only on the device, and only for the shapes that
reach it. Here the launches come from the launchers' own host code (gsm_cuda_launch_geometry, the function the
launchers take their grids from), registers and static shared memory from ptxas, and the shapes from the builder's
memory plan: per device profile, model geometry and max-seq, the largest max-batch at several max-input that fits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from gsm_edge_plugins import launch_limits as ll
from gsm_edge_plugins.ref import Dims

from builder.plan import WEIGHT_CHOICES, PlanRequest, make_plan, pool_rows
from gsm.config import KVQuantConfig, ModelConfig
from gsm.synth import PRESETS, Preset, preset_config, preset_ranks
from jetson.profiles import PROFILES, DeviceProfile

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PROFILE_NAMES = ("orin-nano-8", "orin-agx-64", "h200")
QUANT = KVQuantConfig()  # the tier policy only sizes the pools' regions, never a launch
WEIGHTS = WEIGHT_CHOICES[-1]  # the smallest weights leave the most memory for batch and context
INT32_MAX = 2**31 - 1

# SmolLM2-135M-Instruct as ../shared/data/SmolLM2-135M-Instruct.Q4_1.gguf's llama.* metadata gives it (read once by
# hand: opening the GGUF costs ~5 s, a tenth of this file's budget), with the GSM parameters a GGUF conversion
# starts from (gsm/sources/gguf.py: the GSMParams defaults, no KV sharing).
SMOLLM2 = ModelConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True)
MODELS = {"SmolLM2-135M": (SMOLLM2, None),
          **{f"synth-{name}": (preset_config(p), p) for name, p in PRESETS.items()}}


@dataclass(frozen=True)
class Shape:
    """One build the memory plan accepts."""

    max_seq: int
    max_batch: int
    max_input: int
    max_top_k: int


@dataclass(frozen=True)
class Case:
    """One call of one layer's nodes on an engine built at `shape`."""

    label: str
    dims: Dims
    batch: int
    seq: int
    workspace: int
    demote_entries: int


def rank_variants(cfg: ModelConfig, preset: Preset | None) -> dict[str, dict[int, tuple[int, int]]]:
    """The preset's ranks and the extremes gsm/checker.py accepts (1..min(kvD, H) each), which bracket every
    conversion: the largest take the most shared memory, the smallest fit the most rows in a workspace chunk."""
    top = min(cfg.kv_dim, cfg.hidden_size)
    out = {"ranks 1+1": {i: (1, 1) for i in cfg.owning_layers},
           f"ranks {top}+{top}": {i: (top, top) for i in cfg.owning_layers}}
    if preset is not None:
        out["preset ranks"] = preset_ranks(preset, cfg)
    return out


def seq_choices(cfg: ModelConfig) -> tuple[int, ...]:
    """The model's context (what `builder build` defaults to) and short ones: the most sequences fit there, and a
    small N_max makes a query row's workspace small, so the most rows share a chunk (gridDim.y)."""
    return tuple(sorted({cfg.max_position_embeddings, min(64, cfg.max_position_embeddings), 1}, reverse=True))


def input_choices(max_seq: int) -> tuple[int, ...]:
    """max-input values to search the largest batch at: decode-only engines, short prompts, whole contexts."""
    return tuple(sorted({t for t in (1, 16, 256, max_seq) if t <= max_seq}))


def largest_batch(fits: Callable[[int], bool]) -> int:
    """Largest max-batch with fits(b) (fits grows false with b); 0 when not even 1 fits."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def accepted_shapes(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], profile: DeviceProfile) -> list[Shape]:
    """Per max-seq and max-input, the largest max-batch whose plan fits `profile` (builder/plan.py, as
    `builder build` refuses the rest): together the largest max_batch x max_input at every context."""
    out = []
    for max_seq in seq_choices(cfg):
        for max_input in input_choices(max_seq):
            def plan(b: int, s: int = max_seq, t: int = max_input):
                return make_plan(cfg, ranks, QUANT, profile,
                                 PlanRequest(max_seq=s, max_batch=b, max_input=t, weights=WEIGHTS))
            batch = largest_batch(lambda b: plan(b).fits)
            if batch:
                out.append(Shape(max_seq, batch, max_input, plan(batch).max_top_k))
    return out


def layer_dims(cfg: ModelConfig, ranks: dict[int, tuple[int, int]], shape: Shape) -> list[Dims]:
    """The node attributes of every distinct layer (builder/graph_trt.py PluginOps)."""
    rows = pool_rows(shape.max_seq, shape.max_input, cfg, QUANT)
    g = cfg.gsm
    out = set()
    for i in range(cfg.num_hidden_layers):
        rk, rv = ranks[i] if cfg.is_owning(i) else ranks[g.kv_sharing[i]]
        out.add(Dims(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     rank_k=rk, rank_v=rv, n_max=shape.max_seq, rows_fp16=rows.fp16, rows_int12=rows.int12,
                     rows_int8=rows.int8, rows_int4=rows.int4, index_heads=g.indexer_heads, index_dim=g.indexer_dim,
                     sink_tokens=g.sink_tokens, max_top_k=shape.max_top_k, max_sparse_window=g.max_sparse_window,
                     layer_kind=0 if cfg.is_owning(i) else 1))
    return sorted(out, key=lambda d: (d.layer_kind, d.rank_k, d.rank_v))


def shape_cases(model: str, variant: str, dims: Dims, shape: Shape, workspace: int) -> list[Case]:
    """A prefill call at the profile's maximum and a decode step; the prefill carries the largest demotion the
    runtime sends (runtime/trt_backend.py: demote_list holds max_batch x n_max entries, the engine's profile too)."""
    where = (f"{model} {variant} {'owning' if dims.layer_kind == 0 else 'sharing'} layer, max-seq {shape.max_seq} "
             f"max-batch {shape.max_batch} max-input {shape.max_input} (workspace {workspace} B)")
    calls = {(shape.max_batch, shape.max_input, shape.max_batch * shape.max_seq, "prefill"),
             (shape.max_batch, 1, 0, "decode")}
    return [Case(f"{where}: {kind} B={b} S={s}" + (f" demotion M={m}" if m else ""), dims, b, s, workspace, m)
            for b, s, m, kind in sorted(calls)]


@functools.cache
def profile_cases(profile: str, lib: ll.GeometryLibrary) -> list[Case]:
    out = []
    for model, (cfg, preset) in MODELS.items():
        for variant, ranks in rank_variants(cfg, preset).items():
            for shape in accepted_shapes(cfg, ranks, PROFILES[profile]):
                for dims in layer_dims(cfg, ranks, shape):
                    ws = lib.attention_workspace_bytes(dims, shape.max_batch * shape.max_input)
                    out += shape_cases(model, variant, dims, shape, ws)
    return out


def violation_message(kernel: str, profile: str, limits: ll.SmLimits, case: str, launch: ll.Launch, what: str
                      ) -> str:
    return f"{kernel} on {profile} ({limits.arch}), {case}: {what} [{launch.describe()}]"


def case_violations(case: Case, profile: str, lib: ll.GeometryLibrary,
                    resources: dict[tuple[str, str, str], ll.KernelResources]) -> list[str]:
    limits = ll.SM_LIMITS[PROFILES[profile].sm]
    if case.demote_entries > INT32_MAX:  # the demotion's M is an int32 (and gridDim.x): no launch could take it
        return [f"GsmKVDemote on {profile}, {case.label}: M {case.demote_entries} > {INT32_MAX}"]
    out = []
    for launch in lib.launches(case.dims, case.batch, case.seq, case.workspace, case.demote_entries):
        found = [(inst, r) for (arch, k, inst), r in resources.items() if arch == limits.arch and k == launch.kernel]
        if not found:
            out.append(violation_message(launch.kernel, profile, limits, case.label, launch, "no ptxas report"))
        for inst, res in found:
            name = f"{launch.kernel}<{inst}>" if inst else launch.kernel
            out += [violation_message(name, profile, limits, case.label, launch, v)
                    for v in ll.limit_violations(launch, res, limits)]
    return out


@pytest.fixture(scope="module")
def geometry() -> ll.GeometryLibrary:
    lib = ll.geometry_library()
    if lib is None:
        if ll.nvcc() is None:
            pytest.skip("no CUDA kernels library: nvcc was not found when the plugins were built (CI has nvcc)")
        pytest.fail("nvcc is on PATH but neither libgsm_plugins_cuda_emulated.so nor libgsm_plugins_cuda.so is "
                    "installed: pip install -e .")
    return lib


@pytest.fixture(scope="module")
def resources(geometry, tmp_path_factory) -> dict[tuple[str, str, str], ll.KernelResources]:
    """Registers and static shared memory per (arch, kernel, instantiation): one nvcc per source for all SMs."""
    compiler = ll.nvcc()
    if compiler is None:
        pytest.skip("nvcc not on PATH: registers and static shared memory come from ptxas (CI has nvcc)")
    archs = sorted({ll.SM_LIMITS[PROFILES[p].sm].arch for p in PROFILE_NAMES})
    report = ""
    for proc in ll.start_resource_usage(compiler, PLUGINS, archs, tmp_path_factory.mktemp("ptxas")):
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"nvcc --resource-usage failed:\n{out[-4000:]}"
        report += out
    return ll.by_kernel(ll.parse_resource_usage(report), geometry.kernel_names())


def test_ptxas_reports_every_kernel_on_every_sm(geometry, resources):
    archs = {ll.SM_LIMITS[PROFILES[p].sm].arch for p in PROFILE_NAMES}
    missing = [(a, k) for a in sorted(archs) for k in geometry.kernel_names()
               if not any(arch == a and kernel == k for arch, kernel, _ in resources)]
    assert not missing, f"ptxas compiled no entry for {missing}"


@pytest.mark.parametrize("profile", PROFILE_NAMES)
def test_every_launch_fits_the_sm(profile, geometry, resources):
    cases = profile_cases(profile, geometry)
    assert cases, f"the memory plan accepts no shape on {profile}"
    bad = [v for case in cases for v in case_violations(case, profile, geometry, resources)]
    assert not bad, f"{len(bad)} launches exceed the limits of {profile}:\n" + "\n".join(bad[:15])


def test_a_launch_beyond_a_limit_is_named():
    """The check's message names the kernel, the device, the shape and the limit (what a reader needs to act)."""
    limits = ll.SM_LIMITS["8.7"]
    launch = ll.Launch("attendKernel", (3, 70000, 1), (2048, 1, 1), 200_000, True, 1)
    got = ll.limit_violations(launch, ll.KernelResources(registers=64, static_smem=0), limits)
    assert got == ["threads per block 2048 > 1024", "blockDim.x 2048 outside 1..1024",
                   "gridDim.y 70000 outside 1..65535",
                   "shared memory 200000 B (static 0 + dynamic 200000) > 166912 B per block even with the opt-in",
                   "registers per block 131072 (64 x 2048 threads, allocated per warp) > 65536"]
    msg = violation_message("attendKernel<float>", "orin-nano-8", limits, "synth-tiny decode B=4 S=1", launch, got[0])
    assert msg.startswith("attendKernel<float> on orin-nano-8 (sm_87), synth-tiny decode B=4 S=1: threads per block")
    no_opt_in = ll.Launch("attendKernel", (3, 1, 1), (128, 1, 1), 40_000, False, 1)
    assert ll.limit_violations(no_opt_in, ll.KernelResources(32, 10_000), limits) == [
        "shared memory 50000 B (static 10000 + dynamic 40000) > 49152 B without the "
        "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) opt-in, which the launcher does not do"]


def test_rows_beyond_grid_y_go_to_further_launches(geometry):
    """Regression: a small model's 64 MiB chunk held 100k+ query rows, and indexScoresKernel / attendKernel take
    the row from blockIdx.y (<= 65535); GsmKVCacheUpdate took the sequence from blockIdx.y for any max-batch."""
    cfg = preset_config(PRESETS["tiny"])
    for kind in (0, 1):
        d = Dims(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                 rank_k=1, rank_v=1, n_max=16, rows_fp16=16, rows_int12=0, rows_int8=0, index_heads=2,
                 index_dim=16, max_top_k=8, layer_kind=kind)
        B, S = 100_003, 3
        launches = geometry.launches(d, B, S, geometry.attention_workspace_bytes(d, B * S), demote_entries=B)
        attend = [g for g in launches if g.kernel == "attendKernel"]
        assert sum(g.grid[1] * g.launches for g in attend) == B * S  # every row once
        assert max(g.grid[1] for g in launches) <= 65535, launches
        if kind == 0:
            update = [g for g in launches if g.kernel == "kvCacheUpdateKernel"]
            assert sum(g.grid[1] * g.launches for g in update) == B and {g.grid[0] for g in update} == {S}
            assert sorted(g.kernel for g in launches if g.grid[0] == B) == ["kvDemoteStageKernel",
                                                                            "kvDemoteWriteKernel"]


def test_opt_in_above_48k_of_dynamic_shared_memory(geometry):
    # 64 query heads on one 256-wide key head: attendKernel stages (64*256 + r + 2*256 + 64) floats
    d = Dims(num_heads=64, num_kv_heads=1, head_dim=256, rank_k=256, rank_v=256, n_max=64, rows_fp16=64,
             rows_int12=0, rows_int8=0)
    launches = geometry.launches(d, 1, 1, geometry.attention_workspace_bytes(d, 1))
    attend = next(g for g in launches if g.kernel == "attendKernel")
    assert attend.dynamic_smem > 48 * 1024 and attend.opt_in
    assert not any(g.opt_in for g in launches if g.kernel != "attendKernel")
