"""The Profiler facade: profiles the placer can use, persistence across restarts, drift."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from kvtierd.errors import CorruptObjectError, InvalidArgumentError
from kvtierd.kernels.api import compress_dense
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import (
    EVALUATORS,
    INITIAL_QUERIES,
    ContextKV,
    Decision,
    Profiler,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    QueryStore,
    RestoreCost,
    StoredForm,
    TtftModel,
    evaluator_class,
    files,
    make_evaluator,
)
from kvtierd.profiler.quality import DEFAULT_FORM

POLICY = parse_policy(
    "placer: evicpress\nvariants: {methods: [knorm, int8], ratios: [1.0, 0.5]}\n"
    "profiling: {reprofile_threshold: 0.1, interval_s: 1}\nfrequency: {half_life_s: 100}\n",
    "test.yaml",
)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ttft() -> TtftModel:
    restore = RestoreCost()
    restore.set("int8", 1e-10)
    return TtftModel(prefill_tokens_per_s=1000.0, restore=restore)


def kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, 96, 16, generator=g).half(),
            torch.randn(2, 2, 96, 16, generator=g).half())  # fmt: skip


def make(tmp_path: Path | None, clock: Clock, **kw: object) -> Profiler:
    return Profiler(
        make_evaluator("attention"), ttft(), policy=POLICY, directory=tmp_path,
        wall_clock=clock, clock=clock, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_profile_has_exact_sizes_qualities_and_costs(tmp_path: Path) -> None:
    p = make(tmp_path, Clock())
    keys, values = kv()
    prof = p.profile("ctx", keys, values)
    assert [v.variant for v in prof.variants] == list(POLICY.variants)
    for v in prof.variants:
        stored = compress_dense(keys, values, v.variant)
        assert v.size_bytes == stored.payload_bytes
        assert 0.0 <= v.quality <= 1.0
    assert prof.variant("none").quality == 1.0
    assert prof.variant("knorm@0.5").quality < 1.0
    assert prof.variant("int8").restore_s == pytest.approx(1e-10 * prof.variant("int8").size_bytes)
    assert prof.variant("knorm@0.5").restore_s == 0.0  # stored pre-rotated: nothing to restore
    assert prof.prefill_s == pytest.approx(96 / 1000.0)
    assert prof.frequency == 1.0  # the put is the first access
    rec = p.record("ctx")
    assert rec is not None and rec.query_source == "initial" and rec.num_tokens == 96


def test_profiles_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    p = make(tmp_path, clock)
    keys, values = kv()
    before = p.profile("ctx/α", keys, values, queries=[ProfilingQuery(text="who?")])
    p.record_query("ctx/α", ProfilingQuery(text="when?"))
    p.flush()
    clock.t += 100.0  # one half-life later, in a new process
    q = make(tmp_path, clock)
    assert q.load() == 1
    after = q.profile_of("ctx/α")
    assert after.variants == before.variants
    assert after.prefill_s == before.prefill_s
    assert after.frequency == pytest.approx(1.0)  # (1 + 1) accesses, halved once
    assert q.queries.profiling_set("ctx/α") == (
        "user+traffic",
        (ProfilingQuery(text="who?"), ProfilingQuery(text="when?")),
    )
    assert q.reprofile_candidates() == ["ctx/α"]
    q.forget("ctx/α")
    assert make(tmp_path, clock).load() == 0


def test_a_flush_writes_only_what_changed_since_it_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop flushes the profiler: it wrote every profiled context's two files, one fsync
    each, changed or not (issue 42: ~26 s of a stop at 1M puts, 5,000 profiled contexts).
    Now only those whose count or queries changed since they were written."""
    clock = Clock()
    p = make(tmp_path, clock)
    keys, values = kv()
    for cid in ("a", "b", "c"):
        p.profile(cid, keys, values)  # written as it is made
    written: list[str] = []
    real_write = files.JsonDir.write

    def counted(self: files.JsonDir, context_id: str, doc: dict[str, object]) -> None:
        written.append(f"{self.directory.name}/{context_id}")
        real_write(self, context_id, doc)

    monkeypatch.setattr(files.JsonDir, "write", counted)
    p.flush()
    assert written == []  # nothing changed since the profiles were written
    p.record_access("b")
    p.record_query("c", ProfilingQuery(text="when?"))  # kept in memory until a flush
    p.flush()
    assert sorted(written) == ["profiles/b", "profiles/c", "queries/c"]
    written.clear()
    p.flush()
    assert written == []
    clock.t += 100.0  # one half-life later, in a new process: what was flushed is there
    q = make(tmp_path, clock)
    assert q.load() == 3
    assert q.profile_of("b").frequency == pytest.approx(1.0)  # (1 + 1) accesses, halved once
    assert q.profile_of("a").frequency == pytest.approx(0.5)
    assert q.queries.recent("c") == (ProfilingQuery(text="when?"),)


def test_a_dropped_context_keeps_its_profile_frequency_and_queries(
    tmp_path: Path,
) -> None:
    """EvicPress weighs dropped contexts too: when the prompt comes back (the same KV), its
    profile and access count are still there; the newest ``gone_kept`` are kept."""
    p = make(tmp_path, Clock())
    keys, values = kv()
    p.queries.set_tokens("a", range(96))
    before = p.profile("a", keys, values, queries=[ProfilingQuery(text="who?")])
    p.record_access("a")
    p.set_aside("a")
    p.queries.drop_tokens("a")  # ids come back with the prompt
    assert p.queries.tokens("a", 96) == ()
    assert p.queries.profiling_set("a")[1] == (ProfilingQuery(text="who?"),)
    assert p.profile_of("a").variants == before.variants
    assert p.profile_of("a").frequency == pytest.approx(2.0)
    p.returned("a")  # stored again: a live context is never pruned
    p.gone_kept = 1
    for cid in ("b", "c"):
        p.profile(cid, keys, values)
        p.set_aside(cid)
    assert p.record("a") is not None and p.record("c") is not None
    assert p.record("b") is None  # the oldest set aside beyond gone_kept is forgotten
    assert p.frequency.frequency("b", 1000.0) == 0.0


def test_a_corrupt_profile_file_is_an_error_not_a_silent_skip(tmp_path: Path) -> None:
    p = make(tmp_path, Clock())
    p.profile("ctx", *kv())
    (f,) = (tmp_path / "profiles").glob("*.json")
    f.write_text("{not json")
    with pytest.raises(CorruptObjectError, match="cannot read"):
        make(tmp_path, Clock()).load()


def test_query_store_sample_is_bounded_and_newest() -> None:
    s = QueryStore(sample_size=3)
    assert s.profiling_set("c") == ("initial", INITIAL_QUERIES)
    for i in range(5):
        s.record("c", ProfilingQuery(text=str(i)))
    assert [q.text for q in s.recent("c")] == ["2", "3", "4"]
    assert s.new_since_profile("c") == 5
    s.mark_profiled("c")
    assert s.new_since_profile("c") == 0
    with pytest.raises(InvalidArgumentError, match="text or token_ids"):
        ProfilingQuery()


class TopicEvaluator(QualityEvaluator):
    """Quality depends on the queries: questions about 'tail' facts suffer under compression.
    Stands in for a model whose answers change with the query distribution (drift)."""

    name = "test-topic"

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        tail = sum("tail" in q.text for q in queries) / len(queries)
        q = {v: 1.0 if v == "none" else 0.95 - 0.6 * tail for v in variants}
        return QualityResult(self.name, MappingProxyType(q), len(queries))


def test_drift_fires_when_real_queries_move_and_not_while_busy() -> None:
    clock, busy = Clock(), [False]
    p = Profiler(
        TopicEvaluator(), ttft(), policy=POLICY, wall_clock=clock, clock=clock,
        is_busy=lambda: busy[0],
    )  # fmt: skip
    keys, values = kv()
    p.profile("c", keys, values, queries=[ProfilingQuery(text="head fact")])
    assert p.check_drift("c", keys, values, "knorm@0.5") is None  # no traffic yet
    p.record_query("c", ProfilingQuery(text="another head fact"))
    same = p.check_drift("c", keys, values, "knorm@0.5")
    assert same is not None and same.drop == pytest.approx(0.0)
    assert p.due_for_reprofile(same) is Decision.NO_DRIFT
    for i in range(3):
        p.record_query("c", ProfilingQuery(text=f"a tail fact {i}"))
    moved = p.check_drift("c", keys, values, "knorm@0.5")
    assert moved is not None and moved.drop == pytest.approx(0.45)
    busy[0] = True
    assert p.due_for_reprofile(moved) is Decision.BUSY
    busy[0] = False
    assert p.due_for_reprofile(moved) is Decision.REPROFILE
    again = p.profile("c", keys, values)  # re-profiled on user + traffic queries
    assert again.variant("knorm@0.5").quality == pytest.approx(0.95 - 0.6 * 3 / 5)
    assert p.reprofile_candidates() == []


def test_registry_rejects_duplicates_and_lists_known_names() -> None:
    # the built-ins register on first lookup
    assert evaluator_class("attention").name == "attention"
    assert evaluator_class("answer").name == "answer"
    with EVALUATORS.registered(TopicEvaluator):
        assert {"attention", "answer", "served", "test-topic"} <= set(EVALUATORS.names())
        with pytest.raises(ValueError, match="'test-topic' is already registered"):
            EVALUATORS.register(TopicEvaluator)
    assert "test-topic" not in EVALUATORS.names()
    with pytest.raises(ValueError, match="'attention' is built in"):
        EVALUATORS.register(evaluator_class("attention"))
    with pytest.raises(InvalidArgumentError, match=r"unknown quality evaluator 'nope'; known: .*"
                       r"answer, attention"):  # fmt: skip
        make_evaluator("nope")
    with pytest.raises(InvalidArgumentError, match="bad options"):
        make_evaluator("attention", {"no_such_option": 1})


def test_ttft_model() -> None:
    m = ttft()
    assert m.restore_s("int8", 10**9) == pytest.approx(0.1)
    assert m.restore_s("none", 10**9) == 0.0
    assert m.prefill_s(500) == pytest.approx(0.5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="prefill_tokens_per_s must be > 0"):
            TtftModel(prefill_tokens_per_s=bad)


def test_restore_cost_is_measured_once_per_kind() -> None:
    r = RestoreCost(reference_tokens=256, repeats=1)
    s = r.seconds_per_byte("int4")
    assert 0 < s < float("inf")  # a time, measured (its size is a benchmark's business:
    # a bound of 1 MB/s failed once under CI's load, the first call paying kernel set-up)
    assert r.seconds_per_byte("int4") == s  # cached
    assert r.restore_s("knorm@0.5", 1000) == 0.0
    assert r.restore_s("knorm@0.5", 1000, rotate_on_load=True) > 0.0
    with pytest.raises(InvalidArgumentError, match="unknown restore kind"):
        r.seconds_per_byte("fp8")


def test_records_added_during_a_pass_over_them_do_not_end_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profiles finish on the profiling threads and add records while the reprofile loop (or
    a flush) goes over them: "dictionary changed size during iteration" ended the loop, and
    a graceful stop with it, at 50,000 contexts. Here the pass itself adds one, as such a
    thread would between two of its steps."""
    p = make(tmp_path, Clock())
    keys, values = kv()
    p.profile("a", keys, values, queries=[ProfilingQuery(text="who?")])
    p.record_query("a", ProfilingQuery(text="when?"))
    asked = p.queries.new_since_profile

    def profile_finishing_meanwhile(context_id: str) -> int:
        if "b" not in p.profiled_ids():
            p.profile("b", keys, values)
        return asked(context_id)

    monkeypatch.setattr(p.queries, "new_since_profile", profile_finishing_meanwhile)
    assert p.reprofile_candidates() == ["a"]
    monkeypatch.setattr(
        p, "_save", lambda cid: p.profile("c", keys, values) if cid == "a" else None
    )
    p.flush()
    assert sorted(p.profiled_ids()) == ["a", "b", "c"]


def test_token_counts_are_known_tokens_of_every_context_with_ids() -> None:
    """What a restart reads in one call (issue 42): only contexts a writer gave ids for."""
    q = QueryStore()
    q.set_tokens("a", range(96))
    q.set_tokens("b", range(7))
    q.add_user("c", [ProfilingQuery(text="who?")])  # queries, no ids
    assert q.token_counts() == {"a": 96, "b": 7}
    assert {c: q.known_tokens(c) for c in "abc"} == {"a": 96, "b": 7, "c": 0}


def test_an_access_keeps_only_the_contexts_decayed_count() -> None:
    """Issue 42: a put counts as an access of its context, so the profiler holds something per
    stored context. Its decayed count (a slotted counter, its time, a dict entry) is all: the
    daemon keeps last accesses on its own records, and a second map of them here cost ~60
    bytes a context more."""

    class Ticking(Clock):  # a new float at each call, as time.time() and time.monotonic()
        def __call__(self) -> float:
            self.t += 1e-6
            return self.t

    p = make(None, Ticking())
    ids = [f"context-{i}" for i in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for cid in ids:
            p.record_access(cid)
        per_context = (tracemalloc.get_traced_memory()[0] - before) / len(ids)
    finally:
        tracemalloc.stop()
    assert per_context < 130, per_context  # counter 56 + its time 24 + the dict's entry
    assert p.frequency.frequency("context-7", 1000.0) == pytest.approx(1.0, rel=1e-6)
