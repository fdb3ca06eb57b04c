"""Cheap bundles for the runtime tests: the builder's demo model (seconds), optionally with another
tokenizer.json and a tokenizer_config.json, the manifest rewritten so the bundle still verifies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Text with 2-, 3- and 4-byte UTF-8 characters, so byte-level tokens split characters.
MIXED_TEXT = ("Once upon a time, a café in Zürich served crème brûlée. 日本語の文章です。 The cat said 🐱 and 😀! "
              "Ein kleines Mädchen aß Äpfel; ¿qué pasa? Ωμέγα.")


def run_module(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=timeout)


SERVE_MAX_SEQ, SERVE_MAX_INPUT, SERVE_VOCAB = 64, 16, 384  # the serving tests' bundles (conftest `bundles`)


def build_demo(out: Path, *, max_seq: int = 64, max_input: int = 16, max_batch: int = 1,
               extra: tuple[str, ...] = ()) -> Path:
    """The demo model through `python -m builder build` (byte-level tokenizer, vocab 384); max_batch: the memory
    plan's cache rows, the sequences that may be resident at once; extra: more build flags."""
    r = run_module("builder", "build", "--device", "orin", "--output", str(out), "--max-seq", str(max_seq),
                   "--max-input", str(max_input), "--max-batch", str(max_batch), *extra, cwd=out.parent)
    assert r.returncode == 0, r.stderr
    return out


def byte_bpe_json(vocab_size: int, specials: tuple[str, ...] = ()) -> str:
    """A GPT-2 style byte-level BPE (ByteLevel pre-tokenizer and decoder) with exactly `vocab_size`
    ids: <unk> <s> </s> at 0..2, merges trained on MIXED_TEXT, then `specials` at the top ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([MIXED_TEXT] * 4, trainer)
    assert tok.get_vocab_size() == vocab_size - len(specials), "training text too short for the vocab size"
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == vocab_size
    return tok.to_str()


def with_text_files(src: Path, out: Path, *, tokenizer_json: str | None = None,
                    tokenizer_config: dict | None = None) -> Path:
    """A copy of bundle `src` with tokenizer.json replaced and/or tokenizer_config.json added."""
    from gsm.atomic import MANIFEST_NAME, write_manifest

    shutil.copytree(src, out)
    if tokenizer_json is not None:
        (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    if tokenizer_config is not None:
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    write_manifest(out, {k: v for k, v in manifest.items() if k not in ("format", "version", "files")})
    return out


def demo_and_chat_bundles(d: Path, *, max_seq: int, max_input: int, vocab: int,
                          max_batch: int = 1) -> dict[str, Path]:
    """The demo bundle, and a copy with a ChatML byte-level tokenizer and template (no BOS)."""
    demo = build_demo(d / "demo", max_seq=max_seq, max_input=max_input, max_batch=max_batch)
    chat = with_text_files(demo, d / "chat", tokenizer_json=byte_bpe_json(vocab, ("<|im_start|>", "<|im_end|>")),
                           tokenizer_config={"chat_template": CHATML, "bos_token": "<s>", "eos_token": "<|im_end|>",
                                             "add_bos_token": False})
    return {"demo": demo, "chat": chat}
