"""How often a draft cut from SmolLM2 itself, without training, picks the whole model's token: the case for a draft
bundle (runtime.draft_model) being another, smaller model and not a layer-truncated or layer-skipping copy.

The dense model from ../shared/data's GGUF (transformers' GGUF loader, float32), greedy answers to the chat questions
of bench/speculative.py, then teacher-forced on prompt + answer: the share of answer positions where the cut model's
argmax (the kept layers, then the final norm and the head) equals the whole model's. Needs `.[test]` (torch,
transformers, gguf); nothing is downloaded.

    python bench/layer_draft_agreement.py [--questions 4] [--tokens 120]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# name -> the decoder layers kept, in order (SmolLM2 has 30)
CUTS = {
    "first 8": range(8), "first 16": range(16), "first 20": range(20), "first 24": range(24),
    "skip 12-17": [*range(12), *range(18, 30)], "skip 10-19": [*range(10), *range(20, 30)],
    "every other": range(0, 30, 2),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=120)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from bench.speculative import QUESTIONS

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(DATA, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(DATA, gguf_file=GGUF, dtype=torch.float32)
    layers = list(model.model.layers)
    answers = []
    with torch.no_grad():
        for q in QUESTIONS[:a.questions]:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=a.tokens, do_sample=False)
            answers.append((ids.shape[1], out, model(out, use_cache=False).logits[0].argmax(-1)))
        print(f"SmolLM2-135M-Instruct, {len(answers)} chat answers of up to {a.tokens} tokens, teacher-forced:")
        print("| draft | layers | agrees with the whole model |\n| --- | --- | --- |")
        for name, keep in CUTS.items():
            model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
            agree = total = 0
            for start, out, full in answers:
                cut = model(out, use_cache=False).logits[0].argmax(-1)
                agree += int((cut[start - 1:-1] == full[start - 1:-1]).sum())
                total += out.shape[1] - start
            model.model.layers = torch.nn.ModuleList(layers)
            print(f"| {name} | {len(list(keep))} | {agree / total:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
