"""The confidence rule (issue 18.11): a refined profile (``answer``, ``served``) scored on fewer
than ``profiling.min_queries`` queries is kept and shown, but it moves no context, and it never
replaces one that had enough. On the real model one query scored keydiff@0.5 at 1.000 and the
placer acted on it; with three the ranking was right. The cheap estimator's profile is trusted
from the start (issue 26): every context has one from its first put."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from kvtierd.errors import ConfigError
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import (
    EVALUATORS,
    ContextKV,
    Profiler,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
    TtftModel,
)
from kvtierd.profiler.quality import DEFAULT_FORM

ROOT = Path(__file__).resolve().parents[2]
POLICY = "placer: evicpress\nvariants: {methods: [knorm], ratios: [0.5]}\n"


class QueryCountEvaluator(QualityEvaluator):
    """A lossy variant scores 1.0 on one query and 0.6 on more: the over-optimism a single
    query showed on the real model."""

    name = "test-query-count"

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        q = 1.0 if len(queries) == 1 else 0.6
        quality = {v: 1.0 if v == "none" else q for v in variants}
        return QualityResult(self.name, MappingProxyType(quality), len(queries))


@pytest.fixture(autouse=True)
def registered_evaluator() -> Iterator[None]:
    with EVALUATORS.registered(QueryCountEvaluator):
        yield


def profiler(min_queries: str = "") -> Profiler:
    """The attention estimator, refined by :class:`QueryCountEvaluator`."""
    from kvtierd.profiler import make_evaluator

    text = POLICY + (f"profiling: {{min_queries: {min_queries}}}\n" if min_queries else "")
    return Profiler(
        make_evaluator("attention"),
        TtftModel(prefill_tokens_per_s=1e3),
        policy=parse_policy(text, "p.yaml"),
        refiner=QueryCountEvaluator(),
    )


def kv() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 2, 32, 16, generator=g)


def ask(p: Profiler, n: int) -> None:
    """``n`` more distinct real queries of the context."""
    start = len(p.queries.recent("doc"))
    for i in range(start, start + n):
        p.queries.record("doc", ProfilingQuery(text=f"question {i}"))


def test_the_estimators_profile_is_trusted_from_one_query_or_none() -> None:
    p = profiler()
    p.profile("doc", *kv())  # the estimator's, at the first put: no query yet
    assert p.trusted("doc") and not p.refined("doc")
    ask(p, 1)
    p.profile("doc", *kv(), refine=True)  # a refinement from one query does not replace it
    assert p.record("doc").evaluator == "attention" and p.trusted("doc")


def test_a_first_profile_that_ends_after_a_refinement_does_not_replace_it() -> None:
    """The estimator's first profile, queued at the put, can end after a refinement asked for
    meanwhile (kvtierctl profile run): the refined, trusted profile stays
    (test_daemon_served_profiling saw the estimator's prior replace served's)."""
    p = profiler()
    ask(p, 3)
    p.profile("doc", *kv(), refine=True)
    assert p.refined("doc") and p.trusted("doc")
    p.profile("doc", *kv())  # the estimator's, late
    assert p.record("doc").evaluator == "test-query-count" and p.trusted("doc")


def test_a_profile_from_too_few_queries_is_kept_but_not_trusted() -> None:
    p = profiler()
    ask(p, 1)
    profile = p.profile("doc", *kv(), refine=True)
    assert profile.variant("knorm@0.5").quality == 1.0  # shown as measured ...
    assert (p.record("doc").num_queries, p.trusted("doc")) == (1, False)  # ... not trusted
    ask(p, 2)
    assert p.profile("doc", *kv(), refine=True).variant("knorm@0.5").quality == 0.6
    assert (p.record("doc").num_queries, p.trusted("doc")) == (3, True)


def test_a_trusted_profile_is_not_replaced_by_one_from_fewer_queries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = profiler()
    ask(p, 3)
    p.profile("doc", *kv(), refine=True)
    p.queries.forget("doc")  # the profiling set is now a single new query
    ask(p, 1)
    with caplog.at_level("INFO", "kvtierd.profiler.profiler"):
        kept = p.profile("doc", *kv(), refine=True)
    assert kept.variant("knorm@0.5").quality == 0.6 and p.record("doc").num_queries == 3
    assert "a profile from 1 queries (traffic) is below profiling.min_queries 3" in caplog.text
    assert p.queries.new_since_profile("doc") == 0  # its queries were scored


def test_traffic_that_repeats_its_queries_trusts_a_profile_on_them() -> None:
    """bench_e2e's most asked context had 17 requests over 2 distinct questions: a profile on
    both scores all of its traffic, yet by distinct queries alone it was never trusted and the
    placer never used its compressed forms."""
    p = profiler()
    first, second = ProfilingQuery(text="first"), ProfilingQuery(text="second")
    for q in (first, second, first):  # "second" came once: not all of the traffic repeats
        p.queries.record("doc", q)
    assert not p.enough_queries("doc")
    p.profile("doc", *kv(), refine=True)
    assert (p.record("doc").num_queries, p.record("doc").repeated_requests) == (2, 0)
    assert not p.trusted("doc")
    p.queries.record("doc", second)  # now each came twice, in 4 requests >= min_queries 3
    assert p.queries.repeated_requests("doc", (first, second)) == 4
    assert p.enough_queries("doc")
    p.profile("doc", *kv(), refine=True)
    assert (p.record("doc").num_queries, p.record("doc").repeated_requests) == (2, 4)
    assert p.trusted("doc")
    assert not profiler("5").queries.repeated_requests("doc", (first,))  # no traffic: 0


def test_repeated_requests_survive_a_restart(tmp_path: Path) -> None:
    from kvtierd.profiler.store import ProfileStore

    p = profiler()
    for q in ("a", "b", "a", "b"):
        p.queries.record("doc", ProfilingQuery(text=q))
    p.profile("doc", *kv(), refine=True)
    store = ProfileStore(tmp_path)
    store.save(p.record("doc"))
    (again,) = store.records()
    assert again.repeated_requests == 4


def test_min_queries_is_configurable_and_checked() -> None:
    p = profiler("1")
    ask(p, 1)
    p.profile("doc", *kv(), refine=True)
    assert p.trusted("doc")
    assert parse_policy(POLICY, "p.yaml").min_queries == 3  # the default
    for bad in ("0", "2.5", "x"):
        with pytest.raises(ConfigError, match=r"p.yaml:4: profiling.min_queries: .*integer >= 1"):
            parse_policy(POLICY + f"profiling:\n  min_queries: {bad}\n", "p.yaml")


def test_max_share_is_configurable_and_checked() -> None:
    assert parse_policy(POLICY, "p.yaml").profiling_share == 1.0  # the default
    assert parse_policy(POLICY + "profiling: {max_share: 0.25}\n", "p.yaml").profiling_share == 0.25
    for bad in ("0", "1.5", "-1", "x"):
        with pytest.raises(ConfigError, match=r"p.yaml:4: profiling.max_share: .*in \(0, 1\]"):
            parse_policy(POLICY + f"profiling:\n  max_share: {bad}\n", "p.yaml")


def test_an_original_only_grid_needs_no_queries() -> None:
    from kvtierd.profiler import make_evaluator

    p = Profiler(make_evaluator("attention"), TtftModel(prefill_tokens_per_s=1e3),
                 policy=parse_policy("placer: lru\n", "p.yaml"),
                 refiner=QueryCountEvaluator())  # fmt: skip
    p.profile("doc", *kv(), refine=True)
    assert p.refined("doc") and p.record("doc").num_queries == 0 and p.trusted("doc")


def test_min_queries_is_documented() -> None:
    for doc in ("configuration.md", "profiler.md"):
        assert "`profiling.min_queries`" in (ROOT / "docs" / doc).read_text(), doc
