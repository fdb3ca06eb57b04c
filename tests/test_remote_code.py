"""`trust_remote_code` loading (gsm/hf_remote, gsm/remote_code.py, docs/remote_code.md).

`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` on a GSM checkpoint must give
the golden model's exact-mode logits (<= 1e-4) and, through `generate`, its greedy tokens. The
checkpoints exercise what the remote code must get right: untied head + a KV-sharing layer (synth
tiny), tied head + a converted sharing layer (stories260K, --sharing 2:1), shards with dense K/V
extras, and prompts longer than sinks + window + top_k so the sparse selection decides the output.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CALIB_TEXT, EVAL_TEXT, STORIES, needs_data

from gsm import checkpoint
from gsm.golden.model import GoldenModel
from gsm.remote_code import REMOTE_DIR, REMOTE_FILES, install_remote_code
from gsm.synth import synth_checkpoint

transformers = pytest.importorskip("transformers")

N_NEW = 32
# What transformers must find in config.json (the published GSM description's class names).
EXPECTED_AUTO_MAP = {"AutoConfig": "configuration_gsm.GSMConfig",
                     "AutoModelForCausalLM": "modeling_gsm.GSMForCausalLM"}


def loadable(src: Path, dst: Path) -> Path:
    """A copy of checkpoint src that transformers can load with trust_remote_code.

    Until the checkpoint writer installs the remote code itself, add it here the way the writer will
    (files beside config.json, auto_map in it); a checkpoint that already carries it is used as is.
    """
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if "auto_map" not in cfg or not all((dst / f).is_file() for f in REMOTE_FILES):
        cfg["auto_map"] = install_remote_code(dst)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def load_hf(d: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True,
                                                                    output_loading_info=True)
    # no weight of the model may be left at its random initialisation
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    return model.eval()


def record_starts(model) -> list[int]:
    """Record the first new position of every sequence the model computes (0: from scratch)."""
    starts: list[int] = []
    inner = model.model.sequence

    def spy(ids, n0, past):
        starts.append(n0)
        return inner(ids, n0, past)

    model.model.sequence = spy
    return starts


def golden_greedy(g: GoldenModel, prompt: list[int], eos: int | None) -> list[int]:
    """Golden greedy tokens, cut after the first EOS as `generate` stops there."""
    out = g.greedy(prompt, N_NEW)
    return out[: out.index(eos) + 1] if eos in out else out


def assert_sparse_prompt(g: GoldenModel, prompt: list[int]) -> float:
    """The prompt is long enough that sparse selection changes the logits (so agreement tests it)."""
    p = g.p
    assert len(prompt) > p.sink_tokens + p.sparse_window + p.sparse_top_k
    dense = GoldenModel(g.w, mode="exact", params=dataclasses.replace(p, sparse_top_k=10_000))
    gap = float((dense.forward(dense.new_cache(), prompt).logits
                 - g.forward(g.new_cache(), prompt).logits).abs().max())
    assert gap > 1e-3, gap
    return gap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("rc") / "tiny")


TINY_PROMPT = [1, 5, 17, 33, 100, 7, 9, 250, 3, 44, 12, 13, 14, 15, 16, 60, 61, 62, 200, 201]


def test_install_remote_code(tmp_path):
    auto_map = install_remote_code(tmp_path)
    assert auto_map == EXPECTED_AUTO_MAP
    for name in REMOTE_FILES:
        assert (tmp_path / name).read_bytes() == (REMOTE_DIR / name).read_bytes()
    for ref in auto_map.values():  # every class auto_map names is defined in the named file
        module, cls = ref.split(".")
        tree = ast.parse((tmp_path / f"{module}.py").read_text())
        assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def test_remote_files_import_only_torch_transformers_stdlib():
    allowed = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
    for name in REMOTE_FILES:
        for node in ast.walk(ast.parse((REMOTE_DIR / name).read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: only the sibling configuration module
                    assert node.module == "configuration_gsm", (name, node.module)
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, (name, roots)


SUBPROCESS = r"""
import json, sys
class NoGsm:  # a user without the gsm package
    def find_spec(self, name, path=None, target=None):
        if name == "gsm" or name.startswith("gsm."):
            raise ImportError("gsm is not installed here")
sys.meta_path.insert(0, NoGsm())
import torch, transformers
torch.set_num_threads(1)
d, prompt, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
m, info = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, output_loading_info=True)
with torch.no_grad():
    logits = m(torch.tensor([prompt])).logits[0]
out = m.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)
assert not any(k == "gsm" or k.startswith("gsm.") for k in sys.modules)
json.dump({"missing": sorted(info["missing_keys"]), "logits": logits.tolist(),
           "tokens": out[0, len(prompt):].tolist()}, sys.stdout)
"""


def test_tiny_without_gsm_package_equals_golden(tiny, tmp_path):
    """Untied head, layer 3 reads layer 1's latents through its kv_projector; gsm not importable."""
    d = loadable(tiny, tmp_path / "tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", SUBPROCESS, str(d), json.dumps(TINY_PROMPT), str(N_NEW)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["missing"] == []
    g = GoldenModel.from_checkpoint(d, mode="exact")
    assert g.cfg.sharing_layers == [3]
    assert_sparse_prompt(g, TINY_PROMPT)
    ref = g.forward(g.new_cache(), TINY_PROMPT).logits
    assert float((torch.tensor(got["logits"]) - ref).abs().max()) <= 1e-4
    want = golden_greedy(g, TINY_PROMPT, g.cfg.eos_token_id)
    assert got["tokens"] == want
    assert len(want) == N_NEW  # this seed has no EOS in 32 steps: all 32 are compared


def test_sharded_checkpoint_with_dense_kv_extras(tiny, tmp_path):
    """Shards + index, and the optional dense k_proj/v_proj of owning layers (spec 3) ignored."""
    cfg = checkpoint.load_config(tiny)
    arrays = checkpoint.load_state_dict(tiny)
    rng = np.random.default_rng(0)
    for i in cfg.owning_layers:
        for kv in ("k", "v"):
            arrays[f"model.layers.{i}.self_attn.{kv}_proj.weight"] = \
                rng.standard_normal((cfg.kv_dim, cfg.hidden_size)).astype(np.float32)
    src = checkpoint.write_checkpoint_arrays(tmp_path / "src", cfg, checkpoint.load_quant(tiny), arrays,
                                             max_shard_bytes=200_000, progress=False)
    assert (src / "model.safetensors.index.json").is_file()
    m = load_hf(loadable(src, tmp_path / "sharded"))
    g = GoldenModel.from_checkpoint(tiny, mode="exact")
    assert m.config.latent_ranks == {str(i): list(g.w.owning(i).ranks) for i in cfg.owning_layers}
    with torch.no_grad():
        logits = m(torch.tensor([TINY_PROMPT])).logits[0]
    assert float((logits - g.forward(g.new_cache(), TINY_PROMPT).logits).abs().max()) <= 1e-4


def test_batch_rows_are_independent_and_padding_is_refused(tiny, tmp_path):
    d = loadable(tiny, tmp_path / "tiny")
    m = load_hf(d)
    g = GoldenModel.from_checkpoint(d, mode="exact")
    a, b = TINY_PROMPT, TINY_PROMPT[::-1]
    with torch.no_grad():
        both = m(torch.tensor([a, b])).logits
    assert float((both[1] - g.forward(g.new_cache(), b).logits).abs().max()) <= 1e-4
    out = m.generate(torch.tensor([a, b]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None)
    for row, prompt in zip(out, (a, b)):
        assert row[len(prompt):].tolist() == g.greedy(prompt, N_NEW)
    mask = torch.ones(2, len(a), dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"):
        m(torch.tensor([a, b]), attention_mask=mask)


def test_written_checkpoints_carry_remote_code(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg.get("auto_map") == EXPECTED_AUTO_MAP
    manifest = json.loads((tiny / "manifest.json").read_text())["files"]
    for name in REMOTE_FILES:
        assert (tiny / name).read_bytes() == (REMOTE_DIR / name).read_bytes()
        assert name in manifest


@pytest.fixture(scope="module")
def stories_gsm(tmp_path_factory) -> Path:
    """stories260K converted with layer 2 sharing layer 1's latents and a small selection budget."""
    if not STORIES.is_file():
        pytest.skip("real data not found")
    out = tmp_path_factory.mktemp("rc") / "stories"
    r = subprocess.run([sys.executable, "-m", "gsm", "convert", "--from", "llama2c", str(STORIES), "--out", str(out),
                        "--sharing", "2:1", "--top-k", "8", "--window", "3", "--calib-text", str(CALIB_TEXT),
                        "--eval-text", str(EVAL_TEXT), "--calib-tokens", "8192", "--eval-tokens", "2048",
                        "--indexer-steps", "50"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@needs_data
@pytest.mark.slow
def test_stories260k_equals_golden_exact(stories_gsm, tmp_path, stories_tok):
    """Tied head, converted kv_projector, real text: logits and 32 greedy tokens of the golden."""
    d = loadable(stories_gsm, tmp_path / "stories")
    m = load_hf(d)
    g = GoldenModel.from_checkpoint(d, mode="exact")
    assert g.cfg.tie_word_embeddings and g.cfg.sharing_layers == [2]
    text = EVAL_TEXT.read_text(encoding="utf-8")[:400]
    prompt = [1] + stories_tok.encode(text, add_special_tokens=False).ids[:39]
    assert_sparse_prompt(g, prompt)
    with torch.no_grad():
        logits = m(torch.tensor([prompt])).logits[0]
    assert float((logits - g.forward(g.new_cache(), prompt).logits).abs().max()) <= 1e-4
    starts = record_starts(m)
    out = m.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, output_logits=True,
                     return_dict_in_generate=True)
    want = golden_greedy(g, prompt, g.cfg.eos_token_id)
    assert out.sequences[0, len(prompt):].tolist() == want
    assert len(want) >= 16  # enough of the continuation is compared
    # each step after the prompt computed only its new position, with the golden decode's logits
    assert starts == [0] + list(range(len(prompt), len(prompt) + len(want) - 1))
    cache = g.new_cache()
    ref = [g.prefill(cache, prompt).logits[-1]] + [g.decode(cache, t).logits[-1] for t in want[:-1]]
    assert max(float((a[0] - b).abs().max()) for a, b in zip(out.logits, ref)) <= 1e-4


@needs_data
@pytest.mark.slow
def test_stories260k_long_greedy_through_indexer_ties(stories_gsm, tmp_path):
    """256 greedy tokens. Repeated tokens have identical layer-0 indexer keys, so top-k meets exact
    ties (spec: lower position first); with this prompt one arrives at step 78, where parameters
    left in misaligned memory-mapped storage rounded the decode step differently and the output
    parted from the golden model's."""
    d = loadable(stories_gsm, tmp_path / "stories")
    m = load_hf(d)
    g = GoldenModel.from_checkpoint(d, mode="exact")
    prompt = [1] + list(range(300, 339))
    out = m.generate(torch.tensor([prompt]), max_new_tokens=256, do_sample=False, eos_token_id=None)
    assert out[0, len(prompt):].tolist() == g.greedy(prompt, 256)


def test_per_layer_selection_equals_golden(tiny, tmp_path):
    """gsm_config layer_selection (a streaming layer wider than max_sparse_window, a layer with its own window and
    top-k) read by the remote code as by the golden; the uniform model's logits differ, so the table is used."""
    from conftest import layer_selection_copy

    d = loadable(layer_selection_copy(tiny, tmp_path / "per-layer", {0: (12, 0), 1: (2, 12)}), tmp_path / "hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", SUBPROCESS, str(d), json.dumps(TINY_PROMPT), "4"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.tensor(json.loads(r.stdout)["logits"])
    g = GoldenModel.from_checkpoint(d, mode="exact")
    assert float((got - g.forward(g.new_cache(), TINY_PROMPT).logits).abs().max()) <= 1e-4
    uniform = GoldenModel.from_checkpoint(tiny, mode="exact")
    assert float((got - uniform.forward(uniform.new_cache(), TINY_PROMPT).logits).abs().max()) > 1e-2
