"""The golden model against an implementation we did not write (spec 4.1 reduces to dense attention).

With full rank (tolerance 0), no sharing and top_k >= sequence length, GSM attention is dense
attention with K/V factored as U·diag(S)·Vt; the golden `exact` model must then compute the
logits of `transformers.LlamaForCausalLM` holding the same stories260K weights. Tolerance 1e-4:
float32 with a different summation order (the factored K/V adds one more matmul) and RoPE tables
that transformers builds in float32 while ours are rounded from float64. The factors are the SVD's own
(`u_grid=False`): the converter's U on the FP16 grid changes the model itself by that rounding
(tests/test_convert_math.py bounds it), which is not the golden's arithmetic this file checks.
"""

from __future__ import annotations

import torch
from conftest import EVAL_TEXT, needs_data

from gsm.config import GSMParams
from gsm.convert import indexer as ixr
from gsm.convert.pipeline import Plan, assemble, golden_of
from gsm.convert.svd import whitened_svd

pytestmark = needs_data


def full_rank_gsm(src, params: GSMParams):
    L, kvd, H = src.config.num_hidden_layers, src.config.kv_dim, src.config.hidden_size
    lowranks = {(i, kv): whitened_svd(src.get(f"model.layers.{i}.self_attn.{kv}_proj.weight"), None)
                for i in range(L) for kv in ("k", "v")}
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731 - any indexer: selection is dense
    idx = {i: ixr.Indexer(q=rnd(params.indexer_heads * params.indexer_dim, H), k=rnd(params.indexer_dim, H),
                          w=rnd(params.indexer_heads, H)) for i in range(L)}
    plan = Plan(ranks={i: (kvd, kvd) for i in range(L)}, sharing={}, indexers=idx, indexer_losses={},
                params=params)
    return golden_of(*assemble(src, lowranks, plan, u_grid=False))


def real_ids(tok, n: int) -> list[int]:
    return [1] + tok.encode(EVAL_TEXT.read_text(encoding="utf-8")[:2000], add_special_tokens=False).ids[: n - 1]


def test_golden_exact_equals_transformers(stories_src, stories_tok, stories_hf):
    ids = real_ids(stories_tok, 64)
    gsm = full_rank_gsm(stories_src, GSMParams(sparse_top_k=10_000, indexer_heads=2, indexer_dim=8))
    mine = gsm.forward(gsm.new_cache(), ids).logits
    with torch.no_grad():
        ref = stories_hf(torch.tensor([ids])).logits[0]
    diff = float((mine - ref).abs().max())
    assert diff <= 1e-4, diff
    # decode token by token through the latent cache gives the same logits
    cache = gsm.new_cache()
    steps = [gsm.prefill(cache, ids[:1]).logits] + [gsm.decode(cache, t).logits for t in ids[1:]]
    assert float((torch.cat(steps) - ref).abs().max()) <= 1e-4


def test_short_prompt_with_small_top_k_is_still_dense(stories_src, stories_tok, stories_hf):
    """Spec 4.1: t + 1 <= sinks + window + top_k means every position is selected."""
    p = GSMParams(sparse_top_k=8, sparse_window=3, sink_tokens=1, indexer_heads=2, indexer_dim=8)
    gsm = full_rank_gsm(stories_src, p)
    ids = real_ids(stories_tok, 64)
    budget = 1 + 3 + 8
    mine = gsm.forward(gsm.new_cache(), ids).logits
    with torch.no_grad():
        ref = stories_hf(torch.tensor([ids])).logits[0]
    assert float((mine[:budget] - ref[:budget]).abs().max()) <= 1e-4
    assert float((mine[budget:] - ref[budget:]).abs().max()) > 1e-3  # sparse beyond: it really selects
    one = gsm.forward(gsm.new_cache(), ids[:1]).logits
    assert float((one[0] - ref[0]).abs().max()) <= 1e-4  # a single token


def test_greedy_of_full_rank_gsm_is_the_reference_story(stories_src, stories_tok):
    gsm = full_rank_gsm(stories_src, GSMParams(sparse_top_k=10_000, indexer_heads=2, indexer_dim=8))
    text = stories_tok.decode(gsm.greedy([1], 30))
    assert text.startswith("Once upon a time, there was a little girl named Lily.")
