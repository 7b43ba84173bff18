"""Coverage (kvtierd/profiler/coverage.py): the share of a context's distinct n-grams a
token-dropping variant keeps whole somewhere. A context that repeats itself keeps more of them
than one that says each thing once, under the same method and ratio."""

from __future__ import annotations

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.coverage import ngram_coverage
from kvtierd.profiler.quality import ContextKV, StoredForm

L, H, D = 10, 2, 16


def context(ids: list[int], seed: int = 0) -> ContextKV:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    return ContextKV(torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g),
                     token_ids=tuple(ids))  # fmt: skip


def test_a_redundant_context_keeps_more_of_its_ngrams_than_a_dense_one() -> None:
    dense = list(range(256))  # every n-gram once
    redundant = list(range(64)) * 4  # every n-gram four times
    for variant in ("knorm@0.5", "keydiff@0.5", "knorm@0.3"):
        got_dense = ngram_coverage(context(dense), [variant], n=2)[variant]
        got_redundant = ngram_coverage(context(redundant), [variant], n=2)[variant]
        assert got_redundant > got_dense + 0.1, (variant, got_redundant, got_dense)
        # the default 4-grams: fewer kept whole in both, still about 4 copies' worth more
        dense4 = ngram_coverage(context(dense), [variant])[variant]
        redundant4 = ngram_coverage(context(redundant), [variant])[variant]
        assert redundant4 > 2 * dense4, (variant, redundant4, dense4)


def test_every_entry_kept_covers_everything_and_fewer_kept_cover_less() -> None:
    kv = context(list(range(128)))
    got = ngram_coverage(kv, ["int4", "knorm@0.9", "knorm@0.5", "knorm@0.1"], layer_stride=1)
    assert got["int4"] == 1.0
    assert 1.0 > got["knorm@0.9"] > got["knorm@0.5"] > got["knorm@0.1"] >= 0.0
    # a dense context keeps a 1-gram exactly when it keeps its one entry: the ratio itself
    one = ngram_coverage(kv, ["knorm@0.5"], n=1, layer_stride=1)["knorm@0.5"]
    assert one == pytest.approx(0.5, abs=1 / 128)


def test_stored_chunks_and_strides_count_as_the_daemon_keeps() -> None:
    kv = context(list(range(160)))
    whole_chunks = ngram_coverage(kv, ["knorm@0.5"], StoredForm(chunk_tokens=16), n=1)
    assert whole_chunks["knorm@0.5"] == pytest.approx(80 / 160)
    assert ngram_coverage(kv, ["knorm@0.5"], layer_stride=3) != ngram_coverage(
        kv, ["knorm@0.5"], layer_stride=1
    )


def test_it_needs_the_token_ids_and_sane_options() -> None:
    kv = context(list(range(32)))
    bare = ContextKV(kv.keys, kv.values)
    with pytest.raises(InvalidArgumentError, match="needs the context's 32 token ids, got 0"):
        ngram_coverage(bare, ["knorm@0.5"])
    with pytest.raises(InvalidArgumentError, match="must be >= 1"):
        ngram_coverage(kv, ["knorm@0.5"], n=0)


def test_the_estimator_reads_coverage_at_a_first_put_and_the_prior_for_quantizations() -> None:
    """``query_attention`` without a question or a model: a token-dropping variant's estimate
    is its calibrated coverage averaged with the prior, so a redundant context's is higher
    than a dense one's; int4 keeps the prior; without token ids everything is the prior."""
    from kvtierd.profiler.quality_tables import COVERAGE_CALIBRATION, calibrate, prior_quality
    from kvtierd.profiler.query_attention import QueryAttentionEvaluator

    ev = QueryAttentionEvaluator()
    names = ["int4", "knorm@0.5"]
    prior = prior_quality(names)
    assert prior is not None
    redundant, dense = context(list(range(64)) * 4), context(list(range(256)))
    got = ev.evaluate(redundant, names)
    cov = ngram_coverage(redundant, ["knorm@0.5"])["knorm@0.5"]
    want = 0.5 * calibrate(cov, COVERAGE_CALIBRATION) + 0.5 * prior["knorm@0.5"]
    assert got["knorm@0.5"] == pytest.approx(want)
    assert got["int4"] == prior["int4"] and got.num_queries == 1
    assert ev.evaluate(dense, names)["knorm@0.5"] < got["knorm@0.5"]
    blind = ev.evaluate(ContextKV(redundant.keys, redundant.values), names)
    assert dict(blind.quality) == prior and blind.num_queries == 0
