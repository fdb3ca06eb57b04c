"""bench/long_context.py: probes are a pure function of their coordinates and hold the fact at the asked depth,
the recency baseline gives each layer the same rows, and the chunked prefill scores what one pass scores."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gsm.config import GSMParams, LayerSelection

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def lc():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("long_context", BENCH / "long_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_facts_are_deterministic_and_distinct(lc):
    a = lc.fact_of(2048, 0.5, 0)
    assert a == lc.fact_of(2048, 0.5, 0)
    assert a[2] in a[0] and a[2] not in a[1] and len(a[2]) == 5
    assert len({lc.fact_of(L, d, 0)[2] for L in (1024, 2048, 4096) for d in (0.1, 0.5, 0.9)}) == 9


def test_probes_leave_the_answer_room_in_the_context(lc):
    assert lc.probe_length(8192, 8192, 24) == 8192 - 24 - lc.PROMPT_SLACK  # the dense model refuses 8193 positions
    assert lc.probe_length(4096, 8192, 24) == 4096


def test_buckets_cover_the_window(lc):
    assert lc.bucket_edges(8192) == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert lc.bucket_edges(3000) == [(0, 1024), (1024, 2048), (2048, 3000)]


def test_recency_baseline_reads_the_same_rows_per_layer():
    p = GSMParams(sparse_window=32, max_sparse_window=32, sparse_top_k=512,
                  layer_selection={0: LayerSelection(96, 0), 1: LayerSelection(32, 200)})
    r = p.recency_equivalent()
    for layer in (0, 1, 2):
        assert r.selection_of(layer).sparse_top_k == 0
        assert r.selection_of(layer).rows == p.selection_of(layer).rows
    assert r.mean_rows([0, 1, 2], 8192) == p.mean_rows([0, 1, 2], 8192) == 1 + (96 + 232 + 544) / 3
    # a growing budget: the baseline's window is the rows of the query at position n - 1
    g = GSMParams(sparse_window=32, max_sparse_window=32, sparse_top_k=512, sparse_top_k_divisor=8,
                  layer_selection={0: LayerSelection(96, 0), 1: LayerSelection(32, 200, 16)})
    for n in (1024, 8192):
        r = g.recency_equivalent(n)
        assert r.mean_rows([0, 1, 2], n) == g.mean_rows([0, 1, 2], n)
        assert r.sparse_top_k_divisor == 0 and not any(ls.sparse_top_k_divisor for ls in r.layer_selection.values())
    assert g.recency_equivalent(8192).selection_of(1).sparse_window == 32 + 512


def test_probe_places_the_fact_at_its_depth(lc, monkeypatch):
    """A probe prompt holds the fact once, at about the asked depth of the filler, with the question after it."""
    filler = [1 + i % 50 for i in range(3000)]

    def prompt(ckpt, text):  # the chat template's stand-in: the user text as words
        return [len(w) for w in text.split()], [0]

    monkeypatch.setattr(lc, "chat_prompt_ids", prompt)
    s = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: " ".join(f"w{i - 1}" for i in ids)), ckpt=None)
    for depth in (0.1, 0.5, 0.9):
        ids, _, digits = lc.probe_prompt(s, filler, 1000, depth, 0)
        fact, question, _ = lc.fact_of(1000, depth, 0)
        text = lc.probe_text(s, filler, 1000, depth, 0)
        assert text.count(fact) == 1 and text.endswith(question)
        where = text.index(fact) / len(text)
        assert abs(where - depth) < 0.05, (depth, where)
