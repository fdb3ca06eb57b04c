"""KV bytes per position against held-out perplexity: GSM latent precisions beside llama.cpp's KV cache types.

    python bench/kv_frontier.py --checkpoint CKPT --lengths 512,2048 --sequences 4 [--formats fp16,tiers:0/0/0/1,...]
        [--llama-dir DIR] [--out F]

GSM rows are the golden model in deployed mode (FP16 rows, spec 5), one prefill per held-out window, with
every latent row (K and V latents of every owning layer) re-quantised as it is written:
- `fp16`: the deployed baseline (what a bundle's FP16 tier holds);
- `int8`: symmetric, one scale per latent channel, absmax over the calibration text / 127;
- `int4`: symmetric, one scale per latent channel, 4-bit codes in [-7, 7]; `absmax` takes absmax / 7,
  `mse` the clip per channel (a fraction of absmax on a grid) with the least squared error on the
  calibration latents (KVQuant quantises keys per channel before RoPE, which GSM's latents are);
- `int4-g32`: symmetric 4-bit per row in groups of 32 channels, one FP16 scale each (absmax / 7), the layout of
  llama.cpp's q4_0 (0.5625 bytes per value), no calibration;
- `+keys8`: also the indexer keys INT8 per channel, as every engine holds them (decisions "INT8 indexer keys":
  the golden's own codes, with the checkpoint's calibrated index_key.scale_int8); without it the keys are FP16.
These latent formats are a simulation in the golden model, a bound: in one prefill every row is quantised, also
the recent window and sinks an engine keeps in FP16, and no compensation term is added.

`tiers:F16/F12/F8/F4` rows are the engines' tier policy itself (spec 5, decisions "A 4-bit tier"): the golden
deployed model with the checkpoint's calibrated tables (kv_calibration.safetensors: scales, compensation, the
INT4 pair), the window prefilled in chunks of `--retier-every` tokens, each chunk a prefill call that ends with
the re-tier pass (so rows are demoted by hotness rank while the window is read, the sinks and the last
fp16_window rows stay FP16), every chunk's logits scored. `+keys8` holds INT8 indexer keys as above.
Bytes per position follow spec 6: (r_k + r_v) x average bytes per value under the tier fractions + the indexer
key, summed over owning layers; dense FP16 is L x 2 x kvD x 2.

`--copy-len L`: a number-copy test at L tokens under every format (the seed description warns that INT4 KV
corrupted numbers in long legal text): a sentence with a serial number is placed at several depths of held-out
filler, the prompt ends asking for it, greedy decoding must reproduce its characters exactly.

llama.cpp rows: `llama-perplexity` on the F32 GGUF (`../shared/tools/llama_cpp.sh`) over the same text,
`-c L --chunks n -fa on -ctk T -ctv T` for T in f16, q8_0, q4_0 (its own protocol: each chunk's second half is
scored). Compare each method's increase over its own full-precision row, never absolute perplexities.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
DATA = ROOT.parent / "shared" / "data"
DEFAULT_LLAMA = Path.home() / ".cache" / "gsm-edge" / "llama.cpp"
LLAMA_TYPES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per K/V value (ggml block layouts)
CLIPS = [x / 20 for x in range(8, 21)]  # 0.40 .. 1.00 of absmax


def quantise(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(x / scale), -qmax, qmax) * scale


def group_rows(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x [n, r] quantised per row in groups of `group` channels (the last may be short): 4-bit, FP16 scales."""
    from gsm.golden.quant import round_fp16

    out = torch.empty_like(x)
    for c0 in range(0, x.shape[1], group):
        blk = x[:, c0:c0 + group]
        out[:, c0:c0 + group] = quantise(blk, round_fp16(blk.abs().amax(dim=1, keepdim=True) / 7), 7)
    return out


def channel_scales(rows: torch.Tensor, qmax: int, mse: bool) -> torch.Tensor:
    """One scale per channel of rows [n, r]: absmax / qmax, or the clip of CLIPS with the least squared error."""
    from gsm.golden.quant import round_fp16

    amax = rows.abs().amax(dim=0)
    if not mse:
        return round_fp16(amax / qmax)
    best, best_err = None, None
    for c in CLIPS:
        s = round_fp16(amax * c / qmax)
        err = ((quantise(rows, s, qmax) - rows) ** 2).sum(dim=0)
        if best is None:
            best, best_err = s, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


class Formats:
    """The golden's latent hook for one row format, and the key precision and tier fractions it runs with."""

    def __init__(self, gsm) -> None:
        self.gsm, self.quant0 = gsm, gsm.quant
        self.fmt = "fp16"
        self.scales: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.collected: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        gsm.latent_hooks.append(self._hook)

    def _hook(self, i: int, n0: int, ck: torch.Tensor, cv: torch.Tensor) -> None:
        if self.fmt == "collect":
            self.collected.setdefault(i, []).append((ck.clone(), cv.clone()))
            return
        base = self.fmt.split("+")[0]
        if base == "fp16":
            return
        if base == "int4-g32":
            ck.copy_(group_rows(ck))
            cv.copy_(group_rows(cv))
            return
        qmax = 127 if base == "int8" else 7  # int4-absmax / int4-mse
        sk, sv = self.scales[base][i]
        ck.copy_(quantise(ck, sk, qmax))  # views of the cache: the rows are stored quantised
        cv.copy_(quantise(cv, sv, qmax))

    def quant_of(self, fmt: str) -> Any:
        """The golden's kv_quantization for a format: INT8 keys for `+keys8` (FP16 otherwise), and for `tiers:` the
        fractions."""
        base = fmt.split("+")[0]
        q = self.quant0.replace(index_key_bits=8 if fmt.endswith("+keys8") else 16)
        return q.with_fractions(tier_mix(base)) if base.startswith("tiers:") else q

    def use(self, fmt: str) -> bool:
        """Set the golden up for `fmt`; whether it runs the engines' tier policy (a `tiers:` format)."""
        tiers = fmt.split("+")[0].startswith("tiers:")
        self.fmt = "fp16" if tiers else fmt
        self.gsm.quant = self.quant_of(fmt)
        return tiers

    def calibrate(self, calib: torch.Tensor) -> None:
        self.fmt = "collect"
        self.gsm.quant = self.quant0.replace(index_key_bits=16)
        for row in calib:
            self.gsm.forward(self.gsm.new_cache(), row)
        rows = {i: (torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) for i, v in self.collected.items()}
        def per_layer(qmax: int, mse: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
            return {i: (channel_scales(k, qmax, mse), channel_scales(v, qmax, mse)) for i, (k, v) in rows.items()}

        self.scales = {"int8": per_layer(127, False), "int4-absmax": per_layer(7, False),
                       "int4-mse": per_layer(7, True)}
        self.collected = {}

    def nll(self, row: torch.Tensor, fmt: str, retier_every: int = 64) -> float:
        from quality_real import token_nll

        if not self.use(fmt):
            return float(token_nll(self.gsm.forward(self.gsm.new_cache(), row).logits, row).sum())
        # chunked prefill: each call ends with the re-tier pass
        cache, total = self.gsm.new_cache(), 0.0
        for a in range(0, row.numel() - 1, retier_every):
            logits = self.gsm.prefill(cache, row[a:a + retier_every]).logits
            target = row[a + 1:a + 1 + logits.shape[0]]
            total += float(torch.nn.functional.cross_entropy(logits[:target.numel()], target, reduction="sum"))
        return total


def tier_mix(base: str) -> tuple[float, ...]:
    """`tiers:F16/F12/F8/F4` -> the tier fractions."""
    return tuple(float(x) for x in base.removeprefix("tiers:").split("/"))


def format_bytes(fmt: str) -> tuple[float, float]:
    """(bytes per latent value, bytes per indexer-key value) of a format name."""
    from gsm.tiers import avg_bytes

    base = fmt.split("+")[0]
    key = 1.0 if fmt.endswith("+keys8") else 2.0
    return (avg_bytes(tier_mix(base)) if base.startswith("tiers:") else GSM_FORMATS[base][0]), key


def valid_format(fmt: str) -> bool:
    base, _, extra = fmt.partition("+")
    if extra not in ("", "keys8"):
        return False
    if base in GSM_FORMATS:
        return True
    try:
        mix = tier_mix(base)
    except ValueError:
        return False
    return base.startswith("tiers:") and len(mix) in (3, 4) and abs(sum(mix) - 1) < 1e-6 and min(mix) >= 0


def bytes_per_position(cfg, ranks: dict[int, tuple[int, int]], value_bytes: float, key_bytes: float) -> float:
    return sum((rk + rv) * value_bytes + cfg.gsm.indexer_dim * key_bytes for rk, rv in ranks.values())


GSM_FORMATS = {  # name: (bytes per latent value, bytes per indexer-key value without +keys8)
    "fp16": (2.0, 2.0), "int8": (1.0, 2.0), "int4-absmax": (0.5, 2.0), "int4-mse": (0.5, 2.0),
    "int4-g32": (0.5625, 2.0),
}


def calibrated(a: argparse.Namespace) -> tuple[Any, Any, Formats]:
    """The benchmark's setup, the deployed golden model and its row formats, scales taken on the calibration
    text (never on the evaluation text the rows are scored on)."""
    from quality_real import Setup, eval_stream, windows

    from gsm.golden.model import GoldenModel

    s = Setup(a.checkpoint, a.dense, a.eval_text)
    dep = GoldenModel(s.gsm.w, mode="deployed", quant=s.gsm.quant, calibration=s.gsm.calib)
    if any(f.endswith("+keys8") for f in a.formats) and not s.gsm.calib.keys_fitted(s.cfg):
        raise SystemExit(f"--formats ...+keys8: {a.checkpoint} has no INT8 indexer-key scales; calibrate it "
                         "(python -m calibration run, INT8 keys by default)")
    f = Formats(dep)
    calib = windows(eval_stream(a.calib_text, s.tokenizer, a.calib_sequences * a.calib_len), a.calib_len,
                    a.calib_sequences, s.bos_id)
    t0 = time.perf_counter()
    f.calibrate(calib)
    print(f"[gsm] scales from {calib.shape[0]} x {calib.shape[1]} calibration tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return s, dep, f


@torch.no_grad()
def gsm_rows(a: argparse.Namespace) -> dict[str, Any]:
    s, dep, f = calibrated(a)
    ranks = s.gsm.w.ranks
    dense = s.cfg.num_hidden_layers * 2 * s.cfg.kv_dim * 2
    out: dict[str, Any] = {"dense_fp16_bytes_per_position": dense, "by_length": {}}
    for L in a.lengths:
        seqs = s.sequences(L, a.sequences)
        sums, n_tok = dict.fromkeys(a.formats, 0.0), 0
        for b, row in enumerate(seqs):
            t0 = time.perf_counter()
            for name in a.formats:
                sums[name] += f.nll(row, name, a.retier_every)
            n_tok += row.numel() - 1
            print(f"[gsm] {L} seq {b}: " + ", ".join(f"{k} {math.exp(v / n_tok):.4f}" for k, v in sums.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        ppl = {k: math.exp(v / n_tok) for k, v in sums.items()}
        out["by_length"][L] = {"tokens": n_tok, "rows": [
            {"format": k, "kv_bytes_per_position": bytes_per_position(s.cfg, ranks, *format_bytes(k)),
             "vs_dense_fp16": bytes_per_position(s.cfg, ranks, *format_bytes(k)) / dense,
             "perplexity": p, "increase_over_fp16": p / ppl["fp16"] - 1} for k, p in ppl.items()]}
    return out


COPY_NUMBERS = ("48213-77-905", "3391-0046-72", "7702-518-36")
COPY_DEPTHS = (0.1, 0.5, 0.9)


@torch.no_grad()
def copy_rows(a: argparse.Namespace) -> dict[str, Any]:
    """Per format: how many (number, depth) trials greedy decoding answers with the number's exact characters."""
    s, dep, f = calibrated(a)
    paras = [" ".join(p.split()) for p in a.eval_text.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    question = "\n\nQuestion: What is the serial number of the steel plate?\nAnswer: The serial number is"
    results: dict[str, Any] = {"length": a.copy_len, "trials": []}
    for number in COPY_NUMBERS[: a.copy_numbers]:
        for depth in COPY_DEPTHS:
            fact = f"The serial number of the steel plate is {number}."
            body: list[str] = []
            n_tok = 0
            for para in paras[COPY_NUMBERS.index(number) * 50:]:  # different filler per number
                t = len(s.tokenizer.encode(para + "\n\n", add_special_tokens=False).ids)
                if n_tok + t > a.copy_len - 60:
                    break
                body.append(para)
                n_tok += t
            body.insert(int(depth * len(body)), fact)
            ids = s.tokenizer.encode("\n\n".join(body) + question, add_special_tokens=False).ids
            trial: dict[str, Any] = {"number": number, "depth": depth, "prompt_tokens": len(ids), "answers": {}}
            for fmt in a.formats:
                tiers = f.use(fmt)
                cache = dep.new_cache()
                if tiers:  # the engines' policy: chunked prefill, each call ending with a re-tier pass
                    for c0 in range(0, len(ids), a.retier_every):
                        logits = dep.prefill(cache, ids[c0:c0 + a.retier_every]).logits[-1]
                else:  # forward, not prefill: no re-tier pass, the rows keep the format they were written in
                    logits = dep.forward(cache, ids).logits[-1]
                out: list[int] = []
                for _ in range(16):  # digits are one token each: the whole number and a stop
                    out.append(int(torch.argmax(logits)))
                    step = dep.decode(cache, out[-1]) if tiers else dep.forward(cache, [out[-1]])
                    logits = step.logits[-1]
                text = s.tokenizer.decode(out)
                trial["answers"][fmt] = {"text": text, "exact": number in text}
            results["trials"].append(trial)
            print(f"[copy] {number} at {depth:.0%} ({len(ids)} tokens): " + ", ".join(
                f"{k} {'ok' if v['exact'] else repr(v['text'])}" for k, v in trial["answers"].items()), flush=True)
    results["exact"] = {fmt: sum(t["answers"][fmt]["exact"] for t in results["trials"]) for fmt in a.formats}
    results["of"] = len(results["trials"])
    return results


def llama_rows(a: argparse.Namespace, dense_bytes: int) -> dict[str, Any]:
    exe = a.llama_dir / "bin" / "llama-perplexity"
    gguf = a.llama_dir / "SmolLM2-135M-Instruct.F32.gguf"
    if not (exe.is_file() and gguf.is_file()):
        return {"status": f"{exe} or {gguf.name} not found (../shared/tools/llama_cpp.sh)"}
    out: dict[str, Any] = {"gguf": gguf.name, "by_length": {}}
    for L in a.lengths:
        rows = []
        for t, per_value in LLAMA_TYPES.items():
            cmd = [str(exe), "-m", str(gguf), "-f", str(a.eval_text), "-c", str(L), "--chunks", str(a.sequences),
                   "-t", str(a.threads), "-fa", "on", "-ctk", t, "-ctv", t]
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            m = re.search(r"Final estimate: PPL = ([\d.]+)", r.stdout + r.stderr)
            row: dict[str, Any] = {"cache_type": t, "kv_bytes_per_position": dense_bytes / 2 * per_value,
                                   "vs_dense_fp16": per_value / 2}
            if m:
                row["perplexity"] = float(m.group(1))
            else:
                row["error"] = (r.stderr or r.stdout).strip()[-300:]
            rows.append(row)
            print(f"[llama.cpp] {L} {t}: {row.get('perplexity', row.get('error'))}", flush=True)
        base = next((r["perplexity"] for r in rows if r["cache_type"] == "f16" and "perplexity" in r), None)
        for r in rows:
            if base and "perplexity" in r:
                r["increase_over_f16"] = r["perplexity"] / base - 1
        out["by_length"][L] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--dense", type=Path, default=DATA / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--eval-text", type=Path, default=DATA / "tinystories_eval.txt")
    ap.add_argument("--calib-text", type=Path, default=DATA / "tinystories_calib.txt")
    ap.add_argument("--calib-sequences", type=int, default=2)
    ap.add_argument("--calib-len", type=int, default=1024)
    ap.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",") if x], default=[512, 2048])
    ap.add_argument("--sequences", type=int, default=4, help="held-out windows per length (llama.cpp: --chunks)")
    ap.add_argument("--formats", type=lambda t: t.split(","), default=list(GSM_FORMATS),
                    help=f"GSM row formats, fp16 first ({', '.join(GSM_FORMATS)}), or the engines' tier policy at "
                    "fractions tiers:F16/F12/F8/F4 (e.g. tiers:0.25/0/0.25/0.5, +keys8 allowed)")
    ap.add_argument("--retier-every", type=int, default=64, help="tokens per prefill chunk of the tiers: rows "
                    "(a re-tier pass ends each; default %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--copy-len", type=int, default=0, help="number-copy test at this many tokens (0: skip)")
    ap.add_argument("--copy-numbers", type=int, default=len(COPY_NUMBERS), help="numbers tried (x 3 depths)")
    ap.add_argument("--no-perplexity", action="store_true", help="only the copy test")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    bad = [f for f in a.formats if not valid_format(f)]
    if bad or "fp16" not in a.formats:
        ap.error(f"--formats: {bad[0]!r} is not one of {', '.join(GSM_FORMATS)}" if bad else
                 "--formats must include fp16 (every row is compared with it)")
    torch.set_num_threads(a.threads)
    res: dict[str, Any] = {}
    if a.copy_len:
        res["copy"] = copy_rows(a)
        print(f"number copy at {a.copy_len} tokens, exact answers of {res['copy']['of']}: {res['copy']['exact']}")
    if a.no_perplexity:
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
        return 0
    res["gsm"] = gsm_rows(a)
    if not a.no_llama:
        res["llama_cpp"] = llama_rows(a, res["gsm"]["dense_fp16_bytes_per_position"])
    print(f"{'length':>6} {'method':>36} {'KV B/pos':>9} {'x dense':>8} {'ppl':>9} {'increase':>9}")
    for L in a.lengths:
        for r in res["gsm"]["by_length"][L]["rows"]:
            print(f"{L:6d} {'GSM ' + r['format']:>36} {r['kv_bytes_per_position']:9.0f} {r['vs_dense_fp16']:8.3f} "
                  f"{r['perplexity']:9.4f} {r['increase_over_fp16']:+9.2%}")
        for r in res.get("llama_cpp", {}).get("by_length", {}).get(L, []):
            if "perplexity" in r:
                print(f"{L:6d} {'llama.cpp ' + r['cache_type']:>36} {r['kv_bytes_per_position']:9.0f} "
                      f"{r['vs_dense_fp16']:8.3f} {r['perplexity']:9.4f} {r.get('increase_over_f16', 0):+9.2%}")
    res["command"] = " ".join(sys.argv)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
