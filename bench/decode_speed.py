"""Decode speed of a GSM bundle on ONNX Runtime (CPU), with llama.cpp and transformers as anchors, in one run.

    python bench/decode_speed.py --checkpoint out/smol-gsm --threads 2 --out bench-decode.json
    python bench/decode_speed.py --bundle out/b8k --contexts 256,1024 --batches 1 --max-seqs ""   # quick
    python bench/decode_speed.py --bundle out/b8k --threads 1 --contexts 256,1024,4096 --top-ks 64,256   # issue 9 table

Measures (each configuration in a fresh subprocess, so its peak RSS is its own):
- decode tokens/s and ms per step against the context length (`--contexts`), batch 1, in the
  bundle of the largest `--max-seq`; prefill tokens/s of that context;
- decode ms per step at a fixed context (`--fixed-context`) in bundles built with each `--max-seqs`;
- batch throughput at each `--batch-contexts` for `--batches` sequences decoded together (decode_batch);
- each of these at every run-time selection budget in `--top-ks` (`runtime.load(sparse_top_k=...)`; default the
  checkpoint's);
- peak RSS of each; optionally (`--profile`) ONNX Runtime's profile of decode steps per op type;
- llama.cpp on the same model and thread count when its tools are found (`--llama-dir`, default
  ~/.cache/gsm-edge/llama.cpp, built by ../shared/tools/llama_cpp.sh): `llama-bench -p 0 -n N` from an
  empty context, `llama-completion` after a prompt of each context length ("eval time" = decode,
  "prompt eval time" = prefill), with its F32 GGUF (the precision of a float32 bundle; `--llama-quant Q8_0`
  against a `--weights int8` bundle, made once from the F32 file with llama-quantize when llama_cpp.sh's folder
  has none); for the batch runs llama.cpp's server with a slot per sequence (`--llama-server-dir`, built by
  scripts/llama_server.sh): the same texts at once, its decode tok/s and peak RSS;
- transformers with eager attention on the same weights (`--transformers-gguf`, dequantised to float32 by
  its GGUF loader) and thread count: prefill in 512-token chunks and greedy decode after each context;
- ONNX Runtime GenAI's own INT4 model of the same GGUF (`--genai-dir`, built there once by
  ../shared/tools/ort_genai.sh, about 5 minutes): prefill and greedy decode after each context, same threads;
- a closing table: our decode tok/s by context beside each anchor's, and the ratios.
Bundles are built from `--checkpoint` into `--work` unless given. Figures are for this machine's CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # gsm.progress from this checkout when run as `python bench/decode_speed.py`
sys.path.insert(0, str(ROOT / "bench"))  # its helpers, also where another bench imports it
from llama_server import DEFAULT_DIR as DEFAULT_LLAMA_SERVER  # noqa: E402
from llama_server import LlamaServer, binary  # noqa: E402

from gsm.progress import track  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
DEFAULT_LLAMA = Path.home() / ".cache" / "gsm-edge" / "llama.cpp"
DEFAULT_GENAI = Path.home() / ".cache" / "gsm-edge" / "ort-genai"
GENAI_SCRIPT = ROOT.parent / "shared" / "tools" / "ort_genai.sh"
BATCH_TEXT_OFFSET = 997  # characters between the texts of a batch's sequences (each its own text, ours and llama.cpp's)


@functools.cache
def text_runtime(bundle: Path):
    """The bundle's runtime in this (the parent) process, for its tokenizer: the anchors' prompts are our tokens."""
    import runtime

    return runtime.load(bundle, backend="onnxruntime", threads=1)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# -- one measurement, in its own process ---------------------------------------------------------
def context_ids(rt, text_file: Path, n: int, offset: int = 0) -> list[int]:
    """n tokens of the text (BOS first), starting `offset` characters in; repeated if too short. Only a prefix of
    the text is encoded (8 characters a token, more where that falls short): the whole file's tokens would count in
    the measured process's peak RSS, which is the engine's."""
    text = text_file.read_text(encoding="utf-8")[offset:]
    chars = 8 * n
    ids = rt.encode(text[:chars])
    while len(ids) < n + 16 and chars < len(text):  # the cut's last tokens may merge otherwise: keep a margin
        chars *= 2
        ids = rt.encode(text[:chars])
    while len(ids) < n:
        ids += ids[1:]
    return ids[:n]


def _timed(fn, spent: dict[str, float], part: str):
    """fn, with its wall time added to spent[part]."""
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[part] += time.perf_counter() - t
    return run


def measure(args: argparse.Namespace) -> dict:
    import numpy as np

    import runtime
    from runtime.ort_backend import SessionTuning

    rt = runtime.load(args.bundle, backend="onnxruntime", threads=args.threads, sparse_top_k=args.top_k,
                      spinning=args.spinning, graph=args.graph)
    tuning = SessionTuning(threads=args.threads, spinning=args.spinning, optimization=args.optimization,
                           arena=args.arena, graph=args.graph)
    if tuning != rt.backend.tuning:  # a session tuned otherwise than the runtime's default
        from runtime.ort_backend import OrtBackend

        rt.backend = OrtBackend(Path(args.bundle), rt.cfg, tuning=tuning)
    if args.profile:  # ONNX Runtime's profiler on the decode steps only (a second session, same tuning)
        import onnxruntime as ort

        from runtime.ort_backend import session_options

        be = rt.backend
        so = session_options(tuning)
        so.enable_profiling = True
        # ONNX Runtime writes its profile (tens of MB) there: a temporary folder unless the caller names one
        profile_dir = args.profile_dir or tempfile.mkdtemp(prefix="gsm-ort-profile-")
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        so.profile_file_prefix = str(Path(profile_dir) / "ort_profile")
    B, ctx, steps = args.batch, args.context, args.steps
    prompts = [context_ids(rt, args.text, ctx, offset=BATCH_TEXT_OFFSET * b) for b in range(B)]
    seqs = [rt.new_sequence() for _ in range(B)]
    # the rows' cache pages faulted in before timing (runtime/page_reserve.py), as llama.cpp and GenAI allocate and
    # clear their caches before theirs; a server's rows are reused, so its steps seldom fault
    for s in seqs:
        rt.backend.pages.reserve(s.cache.row, ctx + steps + 2)
    t0 = time.perf_counter()
    logits = rt.prefill_batch(seqs, prompts)
    prefill_s = time.perf_counter() - t0
    if args.profile:
        be.session = be.open_session(so)
        be.binding = be.session.io_binding()
        for name, buf in be.buffers.items():
            be.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buf))
    rt.decode_batch(seqs, [int(np.argmax(lg)) for lg in logits])  # warm-up step (allocations, caches)
    # the step's network run and its demotion passes, timed apart: the rest of a step is the runtime's own (Python)
    spent = {"network": 0.0, "demotion": 0.0}
    # the demotion: the portable graph's demotion session, or model.cpu.onnx's pools (the plugins' reference)
    demoter = (rt.backend.demote_session, "run") if rt.backend.pools is None else (rt.backend.pools, "demote")
    for part, obj, name in (("network", rt.backend.session, "run_with_iobinding"), ("demotion", *demoter)):
        setattr(obj, name, _timed(getattr(obj, name), spent, part))
    spent.update(network=0.0, demotion=0.0)
    times = []
    for _ in range(steps):
        tok = [int(np.argmax(lg)) for lg in logits]
        t = time.perf_counter()
        logits = rt.decode_batch(seqs, tok)
        times.append(time.perf_counter() - t)
    res = {"bundle": str(args.bundle), "tuning": tuning.__dict__, "graph": rt.backend.graph, "n_max": rt.n_max,
           "context": ctx, "batch": B,
           "top_k": args.top_k,
           "steps": steps,
           "threads": args.threads, "prefill_tokens_per_s": B * ctx / prefill_s,
           "decode_ms_per_step": 1e3 * float(np.median(times)),
           "decode_tokens_per_s": B * steps / sum(times),
           "network_ms_per_step": 1e3 * spent["network"] / steps,
           "demotion_ms_per_step": 1e3 * spent["demotion"] / steps,
           "runtime_ms_per_step": 1e3 * (sum(times) - spent["network"] - spent["demotion"]) / steps,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if args.profile:
        events = json.loads(Path(be.session.end_profiling()).read_text())
        by_op: dict[str, float] = {}
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0.0) + e["dur"]
        total = sum(by_op.values())
        res["profile_ms_per_step_by_op"] = {k: round(v / 1e3 / (steps + 1), 3)
                                            for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])}
        res["profile_total_ms_per_step"] = round(total / 1e3 / (steps + 1), 3)
    return res


def measured(n: int = 1) -> None:
    """Counts finished measurements; main() points it at the run's progress."""


def planned_measurements(a: argparse.Namespace, top_ks: list) -> int:
    """Fresh-process runs and anchors main() makes (the units of its progress)."""
    n = len(top_ks) * (len(a.contexts) + len(a.batch_contexts) * len(a.batches)) * a.repeat
    n += 0 if a.bundle else len(a.max_seqs) * a.repeat
    n += (1 + len(a.profile_batches)) if a.profile else 0
    n += (not a.no_llama) + (not a.no_transformers) + (not a.no_genai) + (a.profile and not a.no_genai)
    n += not a.no_llama and any(b > 1 for b in a.batches) and bool(a.batch_contexts)
    return n


def run_one(bundle: Path, context: int, batch: int, a: argparse.Namespace, profile: bool = False,
            top_k: int | None = None) -> dict:
    """The best of `--repeat` fresh-process runs (the least disturbed one on a shared machine)."""
    runs = []
    for _ in range(1 if profile else a.repeat):
        runs.append(_run_one(bundle, context, batch, a, profile, top_k))
        measured(1)
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    best = min(ok, key=lambda r: r["decode_ms_per_step"])
    best["decode_ms_per_step_runs"] = [round(r["decode_ms_per_step"], 2) for r in ok]
    best["prefill_tokens_per_s"] = max(r["prefill_tokens_per_s"] for r in ok)
    return best


def _run_one(bundle: Path, context: int, batch: int, a: argparse.Namespace, profile: bool,
             top_k: int | None) -> dict:
    cmd = [sys.executable, __file__, "--one", "--bundle", str(bundle), "--context", str(context), "--batch", str(batch),
           "--steps", str(a.steps), "--threads", str(a.threads), "--text", str(a.text)]
    if top_k is not None:
        cmd += ["--top-k", str(top_k)]
    if profile:
        cmd += ["--profile", "--profile-dir", str(a.work)]
    cmd += ["--graph", a.graph, "--optimization", a.optimization]
    cmd += ["--spinning" if a.spinning else "--no-spinning", "--arena" if a.arena else "--no-arena"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(a.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"bundle": str(bundle), "context": context, "batch": batch, "top_k": top_k,
                "error": r.stderr.strip().splitlines()[-1:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- bundles -------------------------------------------------------------------------------------
def ensure_bundle(a: argparse.Namespace, max_seq: int) -> Path:
    out = a.work / f"bundle-{max_seq}"
    if not (out / "manifest.json").is_file():
        r = subprocess.run([sys.executable, "-m", "builder", "build", "--device", a.device, "--checkpoint",
                            str(a.checkpoint), "--output", str(out), "--max-seq", str(max_seq), "--max-batch",
                            str(max(a.batches or [1])), "--max-input", "512", "--overwrite"],
                           capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if r.returncode != 0:
            raise SystemExit(f"error: building the bundle failed: {r.stderr.strip()[-500:]}")
    return out


# -- transformers eager (the reference implementation, same weights) -------------------------------
def transformers_measure(a: argparse.Namespace) -> dict:
    """In its own process: SmolLM2 from the GGUF through transformers' GGUF loader (dequantised to float32,
    the weights llama.cpp's F32 copy holds), eager attention, `a.threads` torch threads; per context the
    prompt is fed in 512-token chunks through the KV cache (prefill tokens/s), then `a.steps` greedy
    steps (median ms per step)."""
    import statistics

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import runtime

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(str(a.transformers_gguf.parent), gguf_file=a.transformers_gguf.name,
                                                 torch_dtype=torch.float32, attn_implementation="eager").eval()
    rt = runtime.load(a.bundle, backend="onnxruntime", threads=1)  # the same token ids as our runs
    rows = []
    with torch.inference_mode():
        for ctx in a.contexts:
            ids = torch.tensor([context_ids(rt, a.text, ctx)])
            t0, past, out = time.perf_counter(), None, None
            for i in range(0, ctx, 512):
                out = model(ids[:, i:i + 512], past_key_values=past, use_cache=True)
                past = out.past_key_values
            prefill_s = time.perf_counter() - t0
            tok, times = int(out.logits[0, -1].argmax()), []
            for _ in range(a.steps):
                t = time.perf_counter()
                out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                times.append(time.perf_counter() - t)
                past, tok = out.past_key_values, int(np.argmax(out.logits[0, -1].numpy()))
            ms = 1e3 * statistics.median(times)
            rows.append({"context": ctx, "prefill_tokens_per_s": ctx / prefill_s, "decode_ms_per_step": ms,
                         "decode_tokens_per_s": 1e3 / ms})
    return {"gguf": a.transformers_gguf.name, "threads": a.threads, "attention": "eager", "by_context": rows}


def transformers_anchor(a: argparse.Namespace, bundle: Path) -> dict:
    if not a.transformers_gguf.is_file():
        return {"status": f"{a.transformers_gguf} not found"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"status": "transformers is not installed"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-transformers", "--bundle", str(bundle), "--threads",
           str(a.threads), "--steps", str(a.steps), "--text", str(a.text), "--transformers-gguf",
           str(a.transformers_gguf), "--contexts", ",".join(map(str, a.contexts))]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- llama.cpp -----------------------------------------------------------------------------------
# a command's own peak RSS: run it from a child Python that waits for it alone and reports RUSAGE_CHILDREN (this
# process's would be the largest of every child so far)
_PEAK_WRAP = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
              "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
              "sys.exit(r.returncode)")


def run_peak(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float | None]:
    """subprocess.run(cmd) with its output captured; returns it and the command's peak RSS in MiB."""
    r = subprocess.run([sys.executable, "-c", _PEAK_WRAP, *cmd], capture_output=True, text=True, **kw)
    m = re.search(r"PEAK_RSS_KIB (\d+)", r.stderr)
    return r, (int(m.group(1)) / 1024 if m else None)


def llama_gguf(a: argparse.Namespace) -> Path | None:
    """The GGUF of `--llama-quant`: the user's own file where it is that precision (the shared Q4_1 source), else
    llama_cpp.sh's copies, else made once from its F32 file with llama-quantize (e.g. Q8_0)."""
    d = a.llama_dir
    gguf = next(iter(sorted(d.glob(f"*.{a.llama_quant}.gguf")) + sorted(DATA.glob(f"*.{a.llama_quant}.gguf"))), None)
    f32, quantize = next(iter(sorted(d.glob("*.F32.gguf"))), None), d / "bin" / "llama-quantize"
    if gguf is None and f32 is not None and quantize.is_file():  # llama_cpp.sh makes F32 and F16 only
        made = f32.with_name(f32.name.replace(".F32.", f".{a.llama_quant}."))
        r = subprocess.run([str(quantize), str(f32), str(made), a.llama_quant], capture_output=True, text=True)
        gguf = made if r.returncode == 0 and made.is_file() else None
    return gguf


def llama_anchor(a: argparse.Namespace, bundle: Path) -> dict:
    d = a.llama_dir
    bench, compl = d / "bin" / "llama-bench", d / "bin" / "llama-completion"
    gguf = llama_gguf(a)
    if not (bench.is_file() and gguf):
        return {"status": f"llama-bench in {d} or *.{a.llama_quant}.gguf in {d} or {DATA} not found "
                          "(../shared/tools/llama_cpp.sh)"}
    out: dict = {"gguf": gguf.name, "threads": a.threads}
    r = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(a.steps * 2), "-t", str(a.threads), "-o",
                        "json"], capture_output=True, text=True)
    try:
        out["empty_context_decode_tokens_per_s"] = json.loads(r.stdout)[0]["avg_ts"]
    except (ValueError, IndexError, KeyError):
        out["llama_bench_error"] = r.stderr.strip()[-300:]
    rt = text_runtime(bundle)
    for ctx in a.contexts:
        ids = context_ids(rt, a.text, ctx)
        prompt = a.work / f"prompt-{ctx}.txt"
        prompt.write_text(rt.decode(ids[1:]), encoding="utf-8")  # llama.cpp adds its own BOS
        # -c: this context and the steps (as a user sizes it), so the F16 KV cache llama.cpp allocates is this run's
        r, peak = run_peak([str(compl), "-m", str(gguf), "-c", str(ctx + 2 * a.steps + 64), "-n", str(a.steps), "-t",
                            str(a.threads), "-f", str(prompt), "--temp", "0", "-no-cnv", "--no-warmup"],
                           stdin=subprocess.DEVNULL)
        text = r.stdout + r.stderr
        pe = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", text)
        ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", text)
        row: dict = {"context": ctx, "peak_rss_mib": peak}
        if pe:
            row["prompt_tokens"] = int(pe.group(2))
            row["prefill_tokens_per_s"] = 1e3 * int(pe.group(2)) / float(pe.group(1))
        if ev:
            row["decode_tokens_per_s"] = 1e3 * int(ev.group(2)) / float(ev.group(1))
        if not (pe and ev):
            row["error"] = text.strip()[-300:]
        out.setdefault("by_context", []).append(row)
    return out


def in_slots(srv: LlamaServer, texts: list[str], n_predict: int) -> list[dict]:
    """Each text in its own slot of the server at once, greedy, its prompt kept there (a second call decodes from it);
    the server's timings of each."""
    reqs = [{"prompt": t, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": True,
             "id_slot": i} for i, t in enumerate(texts)]
    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: srv.post("/completion", r)["timings"], reqs))


def llama_batch_anchor(a: argparse.Namespace, bundle: Path) -> dict:
    """llama.cpp's server with a slot per sequence (`-np B`, `-c` B x (context + steps + 64): its F16 KV cache for
    them all) on the batch runs' contexts and texts, greedy: the B prompts read at once (one token generated), then B
    completions of `--steps` tokens at once from the prompts kept in their slots; decode tok/s = B x steps over the
    longest slot's decode time (the slots decode together), prefill = B x context over the first round's wall time,
    the server's peak RSS."""
    server, gguf = binary(a.llama_server_dir), llama_gguf(a)
    if server is None or gguf is None:
        return {"status": f"{a.llama_server_dir}/bin/llama-server (scripts/llama_server.sh) or the "
                          f"{a.llama_quant} GGUF not found"}
    rt = text_runtime(bundle)
    rows = []
    for ctx in a.batch_contexts:
        for B in [b for b in a.batches if b > 1]:
            texts = [rt.decode(context_ids(rt, a.text, ctx, offset=BATCH_TEXT_OFFSET * b)[1:])  # its own BOS
                     for b in range(B)]
            # --cache-ram 0: no copy of idle slots' caches in host memory (the second round would be charged one)
            with LlamaServer(server, gguf, threads=a.threads, ctx=B * (ctx + a.steps + 64), parallel=B,
                             extra=("--cache-ram", "0")) as srv:
                # prompts first, then the decode alone: a slot decoding while others still read their prompts would
                # time their prefill too (the server mixes both in its batches)
                t0 = time.perf_counter()
                in_slots(srv, texts, 1)
                prefill_s = time.perf_counter() - t0
                done = in_slots(srv, texts, a.steps)
                rows.append({"context": ctx, "batch": B, "peak_rss_mib": srv.peak_rss_mib(),
                             "decode_tokens_per_s": sum(t["predicted_n"] for t in done)
                             / max(t["predicted_ms"] for t in done) * 1e3,
                             "prefill_tokens_per_s": B * ctx / prefill_s,
                             "prompt_tokens_read_again": sum(t["prompt_n"] for t in done)})
    return {"gguf": gguf.name, "threads": a.threads, "by_batch": rows}


# -- ONNX Runtime GenAI ---------------------------------------------------------------------------
def genai_anchor(a: argparse.Namespace) -> dict:
    """GenAI's INT4 CPU model (model builder, RTN INT4 incl. the LM head, GroupQueryAttention) after the same
    contexts of the same text, greedy, `a.threads` intra-op threads: one JSON line per context from the script."""
    if not GENAI_SCRIPT.is_file():
        return {"status": f"{GENAI_SCRIPT} not found"}
    # the script times its contexts in one process, in order: the first carries ONNX Runtime's first-run costs
    # (measured here: 45 tok/s at 256 then 61 at 1K), so a warm-up context runs first and is dropped, as our
    # runs warm up before timing
    # one process per context (a warm-up one first), so each context's peak RSS is its own
    rows, warm = [], None
    for ctx in a.contexts:
        r, peak = run_peak(["bash", str(GENAI_SCRIPT), str(a.genai_dir), f"{min(a.contexts)},{ctx}", str(a.threads)],
                           stdin=subprocess.DEVNULL)
        got = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or len(got) < 2:
            return {"error": (r.stderr or r.stdout).strip()[-300:]}
        warm = warm or got[0]
        rows.append({**got[1], "peak_rss_mib": peak})
    return {"model": str(a.genai_dir / "smollm2-int4"), "threads": a.threads, "warm_up": warm, "by_context": rows}


def genai_profile(a: argparse.Namespace, context: int) -> dict:
    """ONNX Runtime's per-op profile of GenAI's model.onnx itself on our onnxruntime, decode steps after a
    `context`-token past (random K/V: the cost does not depend on the values), same threads and spinning:
    the breakdown to set beside ours. Its session.run time per step is its whole step (GenAI's own loop
    adds its sampling and KV bookkeeping)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    path = a.genai_dir / "smollm2-int4" / "model.onnx"
    if not path.is_file():
        return {"status": f"{path} not found (../shared/tools/ort_genai.sh builds it)"}
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if a.spinning else "0")
    graph = onnx.load(str(path), load_external_data=False).graph
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[42]], np.int64), "attention_mask": np.ones((1, context + 1), np.int64)}
    dec = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]
    for i in graph.input:
        if i.name.startswith("past_key_values"):
            shape = (1, dec["num_key_value_heads"], context, dec["head_size"])
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)

    def run(profile: bool) -> tuple[float, dict]:
        if profile:
            so.enable_profiling = True
            so.profile_file_prefix = str(a.work / "genai_profile")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        sess.run(["logits"], feeds)  # warm-up
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            sess.run(["logits"], feeds)
            times.append(time.perf_counter() - t)
        by_op: dict[str, float] = {}
        if profile:
            for e in json.loads(Path(sess.end_profiling()).read_text()):
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                    by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0.0) + e["dur"]
        return 1e3 * float(np.median(times)), by_op

    ms, _ = run(False)
    _, by_op = run(True)
    return {"model": str(path), "context": context, "threads": a.threads, "session_ms_per_step": ms,
            "profile_total_ms_per_step": round(sum(by_op.values()) / 1e3 / (a.steps + 1), 3),
            "profile_ms_per_step_by_op": {k: round(v / 1e3 / (a.steps + 1), 3)
                                          for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])}}


def comparison(results: dict) -> list[str]:
    """Lines of the closing table: decode tok/s and peak RSS (MiB) by context, ours and each anchor's, and ours /
    anchor for both."""
    def rss(r: dict) -> float:
        return r.get("peak_rss_mib") or float("nan")

    ours = {r["context"]: (r["decode_tokens_per_s"], rss(r)) for r in results["by_context"]
            if r.get("batch", 1) == 1 and "decode_tokens_per_s" in r}
    anchors = {name: {r["context"]: (r["decode_tokens_per_s"], rss(r)) for r in results[key].get("by_context", [])
                      if "decode_tokens_per_s" in r}
               for key, name in (("llama_cpp", "llama.cpp"), ("genai", "GenAI")) if key in results}
    head = f"{'context':>8} {'ours tok/s':>10} {'MiB':>6}" + "".join(
        f" {n + ' tok/s':>16} {'MiB':>6} {'speed':>6} {'memory':>6}" for n in anchors)
    lines = [head]
    for ctx in sorted(ours):
        (tps, mib) = ours[ctx]
        row = f"{ctx:8d} {tps:10.1f} {mib:6.0f}"
        for table in anchors.values():
            # an anchor's context may differ by the few tokens its tokenizer adds: take the nearest
            near = min(table, key=lambda c: abs(c - ctx), default=None)
            if near is None or abs(near - ctx) > max(8, ctx // 50):
                row += f" {'-':>16} {'-':>6} {'-':>6} {'-':>6}"
            else:
                t2, m2 = table[near]
                row += f" {t2:16.1f} {m2:6.0f} {tps / t2:6.2f} {mib / m2:6.2f}"
        lines.append(row)
    return lines


def batch_comparison(results: dict) -> list[str]:
    """Lines of the batch table: ours and llama.cpp's server per (batch, context), and ours / llama.cpp."""
    theirs = {(r["batch"], r["context"]): r for r in results.get("llama_cpp_batch", {}).get("by_batch", [])}
    lines = [f"{'batch':>5} {'context':>8} {'ours tok/s':>10} {'MiB':>6} {'llama.cpp tok/s':>16} {'MiB':>6} "
             f"{'speed':>6} {'memory':>6}"]
    for r in results["by_batch"]:
        if "decode_tokens_per_s" not in r:
            continue
        row = f"{r['batch']:5d} {r['context']:8d} {r['decode_tokens_per_s']:10.1f} {r['peak_rss_mib']:6.0f}"
        t = theirs.get((r["batch"], r["context"]))
        if t is None:
            row += f" {'-':>16} {'-':>6} {'-':>6} {'-':>6}"
        else:
            speed, memory = r["decode_tokens_per_s"] / t["decode_tokens_per_s"], r["peak_rss_mib"] / t["peak_rss_mib"]
            row += f" {t['decode_tokens_per_s']:16.1f} {t['peak_rss_mib']:6.0f} {speed:6.2f} {memory:6.2f}"
        lines.append(row)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, help="GSM checkpoint to build the bundles from")
    ap.add_argument("--bundle", type=Path, help="use this bundle for the context/batch runs (no build)")
    ap.add_argument("--work", type=Path, default=Path("out/bench-decode"), help="bundles, prompts, profiles")
    ap.add_argument("--device", default="orin-agx-64")
    ap.add_argument("--contexts", type=ints, default=[256, 1024, 4096, 8192])
    ap.add_argument("--max-seqs", type=ints, default=[2048, 8192], help="bundles compared at --fixed-context")
    ap.add_argument("--fixed-context", type=int, default=1024)
    ap.add_argument("--batches", type=ints, default=[1, 4, 8])
    ap.add_argument("--batch-contexts", type=ints, default=[256], help="contexts of the batch runs")
    ap.add_argument("--top-ks", type=ints, default=[],
                    help="run-time selection budgets (runtime.load(sparse_top_k=...)) each run is measured at; "
                         "default: the checkpoint's")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spinning", action=argparse.BooleanOptionalAction, default=True,
                    help="ONNX Runtime intra-op threads spin between operators (the runtime's default: on)")
    ap.add_argument("--optimization", default="all", choices=["all", "extended", "basic", "none"])
    ap.add_argument("--graph", default="auto", choices=["auto", "cpu", "portable"],
                    help="which network the onnxruntime backend runs (runtime.load(graph=...))")
    ap.add_argument("--arena", action=argparse.BooleanOptionalAction, default=False,
                    help="ONNX Runtime's CPU memory arena (the runtime's default: off)")
    ap.add_argument("--repeat", type=int, default=2, help="fresh-process runs per configuration; the best is kept")
    ap.add_argument("--text", type=Path, default=DATA / "tinystories_eval.txt", help="context text")
    ap.add_argument("--profile", action="store_true", help="ONNX Runtime profile per op type (with --one: here)")
    ap.add_argument("--profile-context", type=int, default=4096)
    ap.add_argument("--profile-batches", type=ints, default=[], help="with --profile: also profile these batch "
                    "sizes at the first --batch-contexts")
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA)
    ap.add_argument("--llama-server-dir", type=Path, default=DEFAULT_LLAMA_SERVER,
                    help="scripts/llama_server.sh's folder: llama.cpp's server for the batch runs (-np B)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-quant", default="F32",
                    help="the llama.cpp GGUF in --llama-dir to compare with: F32 (the float32 bundle's precision), "
                         "F16, Q8_0 (against a `--weights int8` bundle)")
    ap.add_argument("--transformers-gguf", type=Path, default=DATA / "SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="the model for the transformers-eager anchor (its GGUF loader dequantises to float32)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--genai-dir", type=Path, default=DEFAULT_GENAI,
                    help="ONNX Runtime GenAI's venv and INT4 model (../shared/tools/ort_genai.sh builds them there)")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--out", type=Path, help="write all results as JSON here")
    ap.add_argument("--one-transformers", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--top-k", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--profile-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a)))
        return 0
    if a.one_transformers:
        print(json.dumps(transformers_measure(a)))
        return 0
    if not a.bundle and not a.checkpoint:
        ap.error("give --checkpoint (bundles are built) or --bundle")
    if not a.text.is_file():
        ap.error(f"--text {a.text}: no such file")
    a.work.mkdir(parents=True, exist_ok=True)
    main_bundle = a.bundle or ensure_bundle(a, max(a.max_seqs or [max(a.contexts) + a.steps + 2]))
    results: dict = {"threads": a.threads, "steps": a.steps, "machine": os.uname().nodename,
                     "cpus": os.cpu_count(), "by_context": [], "by_max_seq": [], "by_batch": []}

    def show(r: dict, label: str) -> None:
        if "error" in r:
            print(f"{label}: error {r['error']}", flush=True)
            return
        split = (f" (network {r['network_ms_per_step']:.2f}, demotion {r['demotion_ms_per_step']:.2f}, runtime "
                 f"{r['runtime_ms_per_step']:.2f})" if "network_ms_per_step" in r else "")
        print(f"{label}: decode {r['decode_tokens_per_s']:7.2f} tok/s, {r['decode_ms_per_step']:7.1f} ms/step{split}; "
              f"prefill {r['prefill_tokens_per_s']:7.1f} tok/s; peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)

    from gsm.bundle_format import BundleConfig

    n_main = BundleConfig.load(main_bundle).n_max
    room = n_main - a.steps - 2  # the decode steps (and the warm-up step) must fit after the context
    if a.contexts and max(a.contexts) > room:
        print(f"contexts above {room} are measured at {room}: bundle max-seq {n_main} - {a.steps + 2} decode steps",
              flush=True)
    a.contexts = sorted({min(c, room) for c in a.contexts})
    top_ks = a.top_ks or [None]
    tk = {k: "" if k is None else f", top-k {k}" for k in top_ks}
    # each measurement is a fresh process of up to minutes: progress (a bar on a terminal, else a line every few
    # seconds) says how many are done and about how long the rest takes
    progress = contextlib.ExitStack()
    global measured
    measured = progress.enter_context(track("decode_speed", planned_measurements(a, top_ks), "measurements"))
    for k in top_ks:
        for ctx in a.contexts:
            r = run_one(main_bundle, ctx, 1, a, top_k=k)
            results["by_context"].append(r)
            show(r, f"context {ctx:5d}, batch 1, max-seq {r.get('n_max')}{tk[k]}")
    for n in a.max_seqs if not a.bundle else []:
        r = run_one(ensure_bundle(a, n), a.fixed_context, 1, a, top_k=top_ks[0])
        results["by_max_seq"].append(r)
        show(r, f"context {a.fixed_context:5d}, batch 1, max-seq {n}{tk[top_ks[0]]}")
    for k in top_ks:
        for ctx in a.batch_contexts:
            for b in a.batches:
                r = run_one(main_bundle, min(ctx, room), b, a, top_k=k)
                results["by_batch"].append(r)
                show(r, f"context {min(ctx, room):5d}, batch {b}{tk[k]}")
    if a.profile:
        r = run_one(main_bundle, min(a.profile_context, room), 1, a, profile=True, top_k=top_ks[-1])
        results["profile"] = r
        if "profile_ms_per_step_by_op" in r:
            print(f"ONNX Runtime profile at context {a.profile_context} (ms per decode step, kernel time "
                  f"{r['profile_total_ms_per_step']} of {r['decode_ms_per_step']:.1f}):")
            for op, ms in list(r["profile_ms_per_step_by_op"].items())[:12]:
                print(f"  {op:24s} {ms:8.3f}")
        for b in a.profile_batches:  # per-op growth with the batch (issue 9: Transpose/Gather at B > 1)
            r = run_one(main_bundle, min(a.batch_contexts[0], room), b, a, profile=True, top_k=top_ks[-1])
            results.setdefault("profile_by_batch", []).append(r)
            if "profile_ms_per_step_by_op" in r:
                print(f"ONNX Runtime profile at context {r['context']}, batch {b} (kernel ms per decode step "
                      f"{r['profile_total_ms_per_step']} of {r['decode_ms_per_step']:.1f}): " + ", ".join(
                          f"{op} {ms:.2f}" for op, ms in list(r["profile_ms_per_step_by_op"].items())[:10]), flush=True)
    if not a.no_llama:
        results["llama_cpp"] = llama_anchor(a, main_bundle)
        measured(1)
        print("llama.cpp:", json.dumps(results["llama_cpp"]), flush=True)
        if any(b > 1 for b in a.batches) and a.batch_contexts:
            results["llama_cpp_batch"] = llama_batch_anchor(a, main_bundle)
            measured(1)
            print("llama.cpp server, a slot per sequence:", json.dumps(results["llama_cpp_batch"]), flush=True)
    if not a.no_transformers:
        results["transformers"] = transformers_anchor(a, main_bundle)
        measured(1)
        print("transformers eager:", json.dumps(results["transformers"]), flush=True)
    if not a.no_genai:
        results["genai"] = genai_anchor(a)
        measured(1)
        print("onnxruntime-genai:", json.dumps(results["genai"]), flush=True)
        if a.profile:
            g = results["genai_profile"] = genai_profile(a, min(a.profile_context, room))
            measured(1)
            if "profile_ms_per_step_by_op" in g:
                print(f"GenAI's model.onnx, ONNX Runtime profile at context {g['context']} (ms per decode step, "
                      f"kernel time {g['profile_total_ms_per_step']}; session.run {g['session_ms_per_step']:.1f} "
                      "ms without profiling):")
                for op, ms in list(g["profile_ms_per_step_by_op"].items())[:12]:
                    print(f"  {op:32s} {ms:8.3f}")
    progress.close()
    print(f"decode tok/s at batch 1, {a.threads} threads, one run:", flush=True)
    for line in comparison(results):
        print("  " + line, flush=True)
    if results["by_batch"]:
        print("batches: decode tok/s, peak RSS MiB (ours; llama.cpp's server with a slot per sequence), one run:")
        for line in batch_comparison(results):
            print("  " + line, flush=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
