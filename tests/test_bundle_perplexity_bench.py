"""bench/bundle_perplexity.py --genai: the scorer of ONNX Runtime GenAI's model folder, on a hand-made model with
GenAI's interface (input_ids, attention_mask, past_key_values.* -> logits) whose logits are a bigram table, so the
perplexity is known from the table alone."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
tokenizers = pytest.importorskip("tokenizers")
from onnx import TensorProto, helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bundle_perplexity import genai_perplexity  # noqa: E402

WORDS = ["<bos>", "a", "b", "c", "d", "e"]


def genai_folder(root: Path, table: np.ndarray, bos: bool) -> Path:
    d = root / "smollm2-int4"
    d.mkdir(parents=True)
    V = table.shape[0]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "T"])]
    inputs += [helper.make_tensor_value_info(f"past_key_values.0.{kv}", TensorProto.FLOAT, [1, 2, "P", 4])
               for kv in ("key", "value")]
    node = helper.make_node("Gather", ["table", "input_ids"], ["logits"], axis=0)  # [1, S, V]: row of each token
    graph = helper.make_graph([node], "bigram", inputs, [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                                                        [1, "S", V])],
                              [helper.make_tensor("table", TensorProto.FLOAT, list(table.shape), table.tobytes(),
                                                  raw=True)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, d / "model.onnx")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": bos, "bos_token": "<bos>"}))
    (d / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"num_key_value_heads": 2,
                                                                           "head_size": 4}}}))
    return root


@pytest.mark.parametrize("bos", [False, True])
def test_genai_perplexity_is_the_tables(tmp_path, bos):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((len(WORDS), len(WORDS))).astype(np.float32)
    text = " ".join(rng.choice(WORDS[1:], 40))
    ids = ([0] if bos else []) + [WORDS.index(w) for w in text.split()]
    window, windows = 8, 3
    lp = table.astype(np.float64) - np.log(np.exp(table.astype(np.float64)).sum(axis=1, keepdims=True))
    nll = -sum(lp[a, b] for w in range(windows) for a, b in zip(ids[w * window:(w + 1) * window - 1],
                                                               ids[w * window + 1:(w + 1) * window]))
    r = genai_perplexity(genai_folder(tmp_path, table, bos), text, windows, window, 1)
    assert r["tokens"] == windows * (window - 1) and r["first_ids"] == ids[:4]
    assert math.isclose(r["perplexity"], math.exp(nll / r["tokens"]), rel_tol=1e-6)


def test_missing_model_names_the_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="ort_genai.sh builds it"):
        genai_perplexity(tmp_path, "a b", 1, 2, 1)
