"""A routed prompt's link (its context's tokens and a real query) is recorded while a profile
runs (issue 18.6's ``prompt ... not linked ... TimeoutError``): a profile through the serving
stack takes seconds to minutes on the profiler's thread, and links queued behind it made the
router give them up after 10 s."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

import pytest

from kvtierd.engine import Engine
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import (
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.profiler.quality import DEFAULT_FORM, EVALUATORS
from tests.daemon.test_profiling_engine import CHUNKS, T, _config, _put_context, _until

RELEASE = threading.Event()
STARTED = threading.Event()


class HeldEvaluator(QualityEvaluator):
    """Scores only once the test lets it: a profile that takes as long as the test needs."""

    name = "test-held"

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        assert RELEASE.wait(60), "the test never released the profile"
        return QualityResult(self.name, MappingProxyType(dict.fromkeys(variants, 1.0)), 3)


class CountingEvaluator(QualityEvaluator):
    """Scores over the queries it is given (its result counts them), its first run held until
    the test lets it."""

    name = "test-counting"
    runs: ClassVar[list[int]] = []

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        if not self.runs:
            STARTED.set()
            assert RELEASE.wait(60), "the test never released the profile"
        self.runs.append(len(queries))
        scores = MappingProxyType(dict.fromkeys(variants, 1.0))
        return QualityResult(self.name, scores, len(queries))


@pytest.fixture(autouse=True)
def registered_evaluator() -> Iterator[None]:
    with EVALUATORS.registered(HeldEvaluator), EVALUATORS.registered(CountingEvaluator):
        yield


async def test_links_and_queries_do_not_wait_for_a_running_profile(tmp_path: Path) -> None:
    RELEASE.clear()
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        policy = parse_policy("placer: evicpress\nvariants: {methods: [knorm]}\n", "p.yaml")
        await engine.apply_policy(
            replace(policy, estimator=HeldEvaluator.name, evaluator=HeldEvaluator.name)
        )
        await _put_context(engine, "doc")
        profiling = asyncio.ensure_future(engine.profiling.profile_context(engine.contexts["doc"]))
        await _until(lambda: engine.profiling.profiler is not None and not profiling.done())
        await asyncio.sleep(0.2)  # the profile is on the profiler's thread, held
        prompt = tuple(range(CHUNKS * T + 3))
        engine.profiling.inputs.note_prompt(engine.contexts["doc"].tenant, "req-1", prompt)
        await asyncio.wait_for(engine.profiling.inputs.link_prompt("doc", "req-1"), 5)
        await asyncio.wait_for(engine.profiling.inputs.add_queries("doc", ["more"], True), 5)
        assert not profiling.done()  # both were recorded while it ran
        profiler = engine.profiling.profiler
        assert (
            profiler is not None and profiler.queries.known_tokens("doc") == CHUNKS * T
        )  # the context's part
        assert len(profiler.queries.recent("doc")) == 2  # the prompt's tail, and "more"
    finally:
        RELEASE.set()
        await engine.close()


async def test_queries_that_arrive_during_a_refinement_bring_the_next_one(
    tmp_path: Path,
) -> None:
    """A context refined on some queries is refined again once new ones come; those that
    arrived while it ran count too. Before, they were checked against no finished profile and
    forgotten, so the context waited for another query (bench_e2e waited its whole settle)."""
    RELEASE.clear()
    STARTED.clear()
    CountingEvaluator.runs.clear()
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        policy = parse_policy(
            "placer: evicpress\nvariants: {methods: [knorm]}\n"
            "profiling: {min_queries: 1, estimator_error: 1.0}\n",
            "p.yaml",
        )  # an error of 1: every decision is close enough to refine
        await engine.apply_policy(replace(policy, evaluator=CountingEvaluator.name))
        await engine.profiling.inputs.add_queries("doc", ["one"], True)  # before it exists
        await _put_context(engine, "doc")  # estimated once it settles, then refined
        assert await asyncio.to_thread(STARTED.wait, 60)
        await engine.profiling.inputs.add_queries("doc", ["two", "three"], True)
        RELEASE.set()
        await _until(lambda: len(CountingEvaluator.runs) >= 2)
        assert CountingEvaluator.runs == [1, 3]
        profiler = engine.profiling.profiler
        assert profiler is not None and profiler.refined("doc") and profiler.trusted("doc")
    finally:
        RELEASE.set()
        await engine.close()
