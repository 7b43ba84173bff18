"""The ``attention`` evaluator on structured KV: exact 1.0 for the original, monotone loss."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler import ContextKV, make_evaluator
from kvtierd.profiler.attention import AttentionEvaluator

L, H, HQ, N, D, W = 2, 2, 4, 512, 32, 64


def structured_kv(seed: int = 0) -> ContextKV:
    """Keys with a spread of norms and values tied to keys, probes drawn like the keys: every
    token carries some attention mass, so dropping more tokens moves the output further."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 1.5, N)[torch.randperm(N, generator=g)]
    keys = torch.randn(L, H, N, D, generator=g) * scale[None, None, :, None]
    values = torch.randn(L, H, N, D, generator=g) + 0.5 * keys
    probes = torch.randn(L, HQ, W, D, generator=g)
    return ContextKV(keys=keys, values=values, window_queries=probes)


def test_original_scores_one_and_lossy_below_one() -> None:
    res = AttentionEvaluator().evaluate(structured_kv(), ["none", "knorm@0.5", "int4"])
    assert res["none"] == pytest.approx(1.0, abs=1e-6)
    assert res["knorm@0.5"] < 0.999
    assert res["int4"] < 0.9999
    assert all(0.0 <= q <= 1.0 for q in res.quality.values())
    assert res.num_queries == W


@pytest.mark.parametrize("method", ["knorm", "keydiff", "streamingllm", "snapkv"])
def test_quality_decreases_with_harder_compression(method: str) -> None:
    ratios = [0.9, 0.7, 0.5, 0.3, 0.1]
    names = [f"{method}@{r}" for r in ratios]
    res = make_evaluator("attention").evaluate(structured_kv(), names)
    q = [res[n] for n in names]
    assert all(a > b for a, b in itertools.pairwise(q)), dict(zip(names, q, strict=True))
    assert q[0] > 0.8
    assert q[-1] < q[0] - 0.1


def test_quantization_costs_less_at_more_bits() -> None:
    res = AttentionEvaluator().evaluate(structured_kv(), ["int8", "int4", "knorm@0.5+int4"])
    assert 1.0 > res["int8"] > res["int4"] > res["knorm@0.5+int4"]


def test_batching_does_not_change_results() -> None:
    names = ["knorm@0.8", "streamingllm@0.4", "int8", "keydiff@0.2"]
    kv = structured_kv(1)
    together = AttentionEvaluator().evaluate(kv, names)
    one_by_one = AttentionEvaluator(max_batch_bytes=1).evaluate(kv, names)
    for n in names:
        assert together[n] == pytest.approx(one_by_one[n], abs=1e-6)


def test_key_probes_without_window_queries() -> None:
    kv = structured_kv()
    bare = ContextKV(keys=kv.keys, values=kv.values)
    res = AttentionEvaluator(fallback_probes=8).evaluate(bare, ["none", "knorm@0.3"])
    assert res.num_queries == 8
    assert res["none"] == pytest.approx(1.0, abs=1e-6)
    assert res["knorm@0.3"] < 1.0


def test_snapkv_without_window_queries_raises() -> None:
    kv = structured_kv()
    with pytest.raises(InvalidArgumentError, match="snapkv needs"):
        AttentionEvaluator().evaluate(ContextKV(kv.keys, kv.values), ["snapkv@0.5"])


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match=r"\[L, H, N, D\]"):
        ContextKV(keys=torch.zeros(2, 2, 4), values=torch.zeros(2, 2, 4))
    kv = structured_kv()
    with pytest.raises(InvalidArgumentError, match="window_queries"):
        ContextKV(kv.keys, kv.values, window_queries=torch.zeros(3, 4, 2, D))
    odd = ContextKV(kv.keys, kv.values, window_queries=torch.zeros(L, 3, 2, D))
    with pytest.raises(InvalidArgumentError, match="multiple"):
        AttentionEvaluator().evaluate(odd, ["int8"])


def test_a_layout_rounds_kept_counts_to_chunks_and_page_methods_to_pages() -> None:
    """The daemon profiles in its chunk size: knorm@0.3 of 512 tokens keeps 160 (whole 16-token
    chunks, not 154); a page method keeps whole pages and is never refused for the chunks."""
    from kvtierd.profiler import StoredForm
    from kvtierd.profiler.variant_kv import variant_kvs

    form = StoredForm(chunk_tokens=16)
    kv = structured_kv()
    names = ["knorm@0.3", "paged_eviction_block-page=8@0.3"]
    kept = {x.variant: x.num_kept for x in variant_kvs(kv, names, form)}
    assert kept == {"knorm@0.3": 160, "paged_eviction_block-page=8@0.3": 152}
    res = AttentionEvaluator().evaluate(kv, list(kept), form=form)
    assert all(0.0 < q < 1.0 for q in res.quality.values())
