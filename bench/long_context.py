"""Long context on a real model: perplexity by position at 2K-8K, and fact retrieval through the chat template.

    python bench/long_context.py ppl --checkpoint C --dense SRC --eval-text EVAL [--lengths 2048,4096,8192]
        [--sequences 2] [--models dense,gsm,all,recency]
    python bench/long_context.py retrieval --checkpoint C --dense SRC --eval-text EVAL [--lengths 1024,2048,4096,8192]
        [--depths 0.1,0.5,0.9] [--models dense,gsm,recency]

Models (`--models`), all scored on the same token sequences:
- `dense`: the dense source in float32 (a dequantised GGUF is the model GSM was converted from);
- `gsm`: the GSM golden model (exact mode) at the checkpoint's own selection (its per-layer choices
  when it has them);
- `all`: GSM with every position selected, which isolates the latents' cost from the selection's;
- `recency`: GSM with the same rows per layer given to sinks + a window (no indexer), the baseline a
  selector has to beat.
Each is a chunked prefill (`--chunk` positions at a time, cache kept), so memory holds the cache and one
chunk's [heads, chunk, T] attention, never [heads, T, T]: an 8K window fits in a few GB.

`ppl`: held-out windows of the evaluation text (paragraphs joined by a blank line, as bench/quality_real.py),
perplexity over the whole window and per position bucket (0-1K, 1-2K, 2-4K, 4-8K), each model against dense.
`retrieval`: a fact ("The code of the <colour> <object> is <5 digits>.") placed at a depth of a filler cut
from the evaluation text, a question for it after the filler, one user turn through the checkpoint's
chat template, greedy answer; scored exactly: the answer contains the fact's digits. Facts, fillers and
questions are a pure function of (length, depth, trial), so every model sees the same prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from quality_real import Setup, chat_prompt_ids, eval_stream, greedy_until  # noqa: E402

from gsm.convert.quality import prefill_chunks, token_nll  # noqa: E402
from gsm.golden.model import GoldenModel  # noqa: E402

MODELS = ("dense", "gsm", "all", "recency")
BUCKETS = (0, 1024, 2048, 4096, 8192)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


# -- the models, one chunked interface ---------------------------------------------------------------
def golden_variant(setup: Setup, name: str, n: int) -> GoldenModel:
    """The GSM golden model of `name` for contexts up to n positions (exact mode)."""
    g, p = setup.gsm, setup.cfg.gsm
    if name == "gsm":
        return g
    if name == "all":
        return GoldenModel(g.w, mode="exact", params=p.overridden(sparse_top_k=n))
    if name == "recency":
        rp = p.recency_equivalent(n)  # a growing budget: the rows of its query at position n - 1
        return GoldenModel(replace(g.w, cfg=setup.cfg.replace(gsm=rp)), mode="exact")
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


class Runner:
    """One model of MODELS, one sequence at a time: prefill(ids) -> last logits, chunked (gsm.convert.quality's
    prefill_chunks); step(token) -> next logits; token_nll(ids) -> each next token's NLL."""

    def __init__(self, setup: Setup, name: str, n: int, chunk: int) -> None:
        self.chunk = chunk
        self.golden = None if name == "dense" else golden_variant(setup, name, n)
        self.dense = setup.dense if self.golden is None else None

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits [V] after a chunked prefill of ids (the cache kept for `step`)."""
        self.state = [] if self.golden is None else self.golden.new_cache()
        for _, logits in prefill_chunks(self.dense, self.golden, ids, self.state, self.chunk):
            last = logits[-1]
        return last

    def token_nll(self, ids: torch.Tensor) -> torch.Tensor:
        """[T - 1] NLL of each next token, chunk by chunk: never the [T, V] logits (1.6 GB at 8K for SmolLM2)."""
        return token_nll(self.dense, self.golden, ids, self.chunk)

    def step(self, token: int) -> torch.Tensor:
        if self.golden is None:
            return self.dense.run_cached(torch.tensor([[token]]), self.state)[0][0, -1]
        return self.golden.forward(self.state, [token]).logits[-1]


# -- perplexity by position --------------------------------------------------------------------------
def bucket_edges(n: int) -> list[tuple[int, int]]:
    edges = [b for b in BUCKETS if b < n] + [n]
    return list(zip(edges[:-1], edges[1:]))


def summarise(nll: dict[str, torch.Tensor], L: int, secs: dict[str, float]) -> dict[str, Any]:
    """Perplexity over the windows scored so far and per bucket of query positions (the query at position j
    predicts token j + 1 having seen j + 1 positions), each model against dense when dense was scored."""
    per_seq = L - 1
    done = min(v.numel() for v in nll.values()) // per_seq  # windows every model has scored
    out: dict[str, Any] = {"sequences": done, "tokens": done * per_seq, "seconds": dict(secs), "perplexity": {},
                           "buckets": {}}
    for m, v in nll.items():
        by = v[:done * per_seq].view(done, per_seq)
        out["perplexity"][m] = math.exp(float(by.mean()))
        out["buckets"][m] = {f"{lo}-{hi}": math.exp(float(by[:, lo:min(hi, per_seq)].mean()))
                             for lo, hi in bucket_edges(L)}
    if "dense" in nll:
        out["relative_to_dense"] = {m: p / out["perplexity"]["dense"] - 1 for m, p in out["perplexity"].items()}
        out["buckets_relative_to_dense"] = {
            m: {k: v / out["buckets"]["dense"][k] - 1 for k, v in bk.items()} for m, bk in out["buckets"].items()}
    return out


@torch.no_grad()
def cmd_ppl(a: argparse.Namespace) -> dict[str, Any]:
    s = Setup(a.checkpoint, a.dense, a.eval_text)
    res: dict[str, Any] = {"checkpoint": str(a.checkpoint), "selection": s.cfg.gsm.selection_summary(),
                           "by_length": {}}
    for L in a.lengths:
        seqs = s.sequences(L, a.sequences)
        nll = {m: torch.zeros(0) for m in a.models}
        secs = dict.fromkeys(a.models, 0.0)
        for b, row in enumerate(seqs):
            for m in a.models:
                t0 = time.perf_counter()
                tok = Runner(s, m, L, a.chunk).token_nll(row)  # query j predicts token j + 1
                nll[m] = torch.cat([nll[m], tok])
                secs[m] += time.perf_counter() - t0
                print(f"[ppl] {L} seq {b} {m}: {math.exp(float(tok.mean())):.4f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            res["by_length"][L] = summarise(nll, L, secs)
            if a.out:  # after each window: a long run stopped early keeps what it measured
                a.out.write_text(json.dumps(res, indent=1))
        out = res["by_length"][L]
        print(f"[ppl] {L}: " + ", ".join(f"{m} {p:.4f}" + (f" ({out['relative_to_dense'][m]:+.2%})"
                                                           if "dense" in nll else "")
                                         for m, p in out["perplexity"].items()), flush=True)
    return res


# -- retrieval ---------------------------------------------------------------------------------------
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
OBJECTS = ("box", "door", "bottle", "drawer", "suitcase", "gate", "locker", "chest")


def fact_of(length: int, depth: float, trial: int) -> tuple[str, str, str]:
    """(fact sentence, question, digits) for one probe, a pure function of its coordinates."""
    r = random.Random(f"{length}/{depth}/{trial}")
    what = f"{r.choice(COLOURS)} {r.choice(OBJECTS)}"
    digits = str(r.randrange(10000, 100000))
    return (f"The code of the {what} is {digits}.", f"What is the code of the {what}? Answer with the number only.",
            digits)


def probe_text(s: Setup, filler: list[int], length: int, depth: float, trial: int) -> str:
    """The user turn of one probe: filler text with the fact at `depth`, then the question."""
    fact, question, _ = fact_of(length, depth, trial)
    dec = s.tokenizer.decode
    wrap, _ = chat_prompt_ids(s.ckpt, f"{fact}\n\n{question}")
    body = max(length - len(wrap) - 2, 16)  # template, fact, question, two separators
    start = (trial * 7919) % max(len(filler) - body, 1)  # each trial its own stretch of text
    text = filler[start:start + body]
    cut = int(depth * len(text))
    doc = dec(text[:cut]).rstrip() + "\n" + fact + "\n" + dec(text[cut:]).lstrip()
    return f"{doc}\n\n{question}"


def probe_prompt(s: Setup, filler: list[int], length: int, depth: float, trial: int) -> tuple[list[int], list[int],
                                                                                                str]:
    """The chat-template prompt of `length` tokens (within a few) holding the fact at `depth` of the filler."""
    ids, stops = chat_prompt_ids(s.ckpt, probe_text(s, filler, length, depth, trial))
    return ids, stops, fact_of(length, depth, trial)[2]


PROMPT_SLACK = 8  # probe_prompt lands within a few tokens of the length it is asked for


def probe_length(length: int, context: int, max_new: int) -> int:
    """The prompt length of a probe asked at `length`: the answer must fit the context too, so a probe at the full
    context is cut to leave max_new positions (and the prompt's slack) for it."""
    return min(length, context - max_new - PROMPT_SLACK)


def answer(r: Runner, ids: list[int], stops: list[int], max_new: int) -> list[int]:
    return greedy_until(lambda: r.prefill(torch.tensor(ids)), r.step, max_new, stops)


def cmd_retrieval(a: argparse.Namespace) -> dict[str, Any]:
    s = Setup(a.checkpoint, a.dense, a.eval_text)
    filler = eval_stream(a.eval_text, s.tokenizer, max(a.lengths) * 4)
    res: dict[str, Any] = {"checkpoint": str(a.checkpoint), "selection": s.cfg.gsm.selection_summary(),
                           "probes": [], "score": {}}
    ctx = s.cfg.max_position_embeddings
    for L in a.lengths:
        fit = probe_length(L, ctx, a.max_new)
        if fit < L:
            print(f"[retrieval] {L}: prompts of {fit} tokens, leaving {a.max_new} of the {ctx}-position context for "
                  "the answer", flush=True)
        for depth in a.depths:
            for trial in range(a.trials):
                ids, stops, digits = probe_prompt(s, filler, fit, depth, trial)
                row: dict[str, Any] = {"length": L, "prompt_tokens": len(ids), "depth": depth, "trial": trial,
                                       "digits": digits}
                for m in a.models:
                    t0 = time.perf_counter()
                    text = s.tokenizer.decode(answer(Runner(s, m, len(ids) + a.max_new, a.chunk), ids, stops,
                                                     a.max_new))
                    row[m] = {"answer": text, "correct": digits in text, "seconds": time.perf_counter() - t0}
                    verdict = "ok  " if digits in text else "MISS"
                    print(f"[retrieval] {L} depth {depth} trial {trial} {m} (wants {digits}): {verdict} "
                          f"{text!r} ({row[m]['seconds']:.0f} s)", flush=True)
                res["probes"].append(row)
                if a.out:
                    a.out.write_text(json.dumps(res, indent=1))
    for m in a.models:
        res["score"][m] = {f"{L}@{d}": sum(p[m]["correct"] for p in res["probes"] if p["length"] == L
                                           and p["depth"] == d) for L in a.lengths for d in a.depths}
        res["score"][m]["total"] = sum(p[m]["correct"] for p in res["probes"])
    res["trials_per_cell"] = a.trials
    print(f"[retrieval] correct of {a.trials} per (length@depth): " + json.dumps(res["score"]), flush=True)
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, lengths: list[int], models: str) -> None:
        p.add_argument("--checkpoint", type=Path, required=True)
        p.add_argument("--dense", type=Path, required=True, help="the dense source (.gguf, HF dir)")
        p.add_argument("--eval-text", type=Path, required=True)
        p.add_argument("--lengths", type=ints, default=lengths)
        p.add_argument("--models", type=lambda v: v.split(","), default=models.split(","))
        p.add_argument("--chunk", type=int, default=512, help="positions per prefill call")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--out", type=Path, help="write the results JSON here")

    pp = sub.add_parser("ppl", help="perplexity by position, each model against dense")
    common(pp, [2048, 4096, 8192], "dense,gsm,all")
    pp.add_argument("--sequences", type=int, default=2, help="held-out windows per length")

    rt = sub.add_parser("retrieval", help="a fact at a depth of long filler, asked for at the end")
    common(rt, [1024, 2048, 4096, 8192], "dense,gsm,recency")
    rt.add_argument("--depths", type=floats, default=[0.1, 0.5, 0.9])
    rt.add_argument("--trials", type=int, default=1, help="probes per (length, depth)")
    rt.add_argument("--max-new", type=int, default=24)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    bad = [m for m in a.models if m not in MODELS]
    if bad:
        print(f"error: --models {','.join(bad)}: choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        res = {"ppl": cmd_ppl, "retrieval": cmd_retrieval}[a.cmd](a)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    res["command"] = " ".join(sys.argv)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
