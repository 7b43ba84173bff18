"""The facade the engine calls: profile contexts, record traffic, detect drift (EvicPress §4.1).

    profiler = Profiler(make_evaluator("attention"), ttft, policy=policy,
                        directory=data_dir / "profiler", is_busy=engine.loads_queued)
    profiler.load()                                      # after a restart
    profile = profiler.profile(cid, keys, values)        # -> ContextProfile for the placer
    profiler.record_query(cid, ProfilingQuery(text=q))   # on every served request
    sample = profiler.check_drift(cid, keys, values, placed_variant)
    if profiler.due_for_reprofile(sample) is Decision.REPROFILE: ...

A profile holds, per variant of the policy's grid, its exact size (``variant_size_bytes``), its
quality (the evaluator, on the context's profiling queries) and its restore cost (the TTFT
model); plus the context's prefill time and decayed access frequency.

Two evaluators (issue 26): ``evaluator``, the cheap estimator, gives every context its first
profile, trusted from the start; ``refiner`` (``answer`` or ``served``, optional) refines it
where a decision is close (``profile(..., refine=True)``), and only its profiles are held to
``profiling.min_queries`` (the confidence rule).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvtierd.errors import InvalidArgumentError
from kvtierd.policy_config import PolicyConfig
from kvtierd.profiler.frequency import FrequencyTracker
from kvtierd.profiler.quality import (
    DEFAULT_FORM,
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    StoredForm,
)
from kvtierd.profiler.queries import QueryStore
from kvtierd.profiler.reprofile import (
    Decision,
    DriftSample,
    ReprofileLoop,
    ReprofileScheduler,
)
from kvtierd.profiler.store import ProfileRecord, ProfileStore
from kvtierd.profiler.ttft import TtftModel
from kvtierd.sizes import count_unit, variant_size_bytes
from kvtierd.types import ORIGINAL_VARIANT, ContextProfile, VariantProfile

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GONE_KEPT = 4096
"""Contexts whose profile and frequency outlive their bytes (:meth:`Profiler.set_aside`)."""


class Profiler:
    """Profiles, queries, frequencies and re-profiling decisions for every context.

    ``directory`` (``None``: in memory only) holds ``profiles/`` and ``queries/``, one JSON file
    per context each. ``wall_clock`` dates profiles and decays frequencies (survives restarts);
    ``clock`` (monotonic) drives the rate limit. A context's last access is not kept here: the
    daemon keeps it on its record (``ContextRecord.last_access_s``), which is what placements
    read; a second copy per context here was ~60 bytes a context (issue 42).
    Not thread-safe: the engine calls it from one thread (or serialises calls).
    """

    def __init__(
        self,
        evaluator: QualityEvaluator,
        ttft: TtftModel,
        *,
        policy: PolicyConfig,
        refiner: QualityEvaluator | None = None,
        directory: str | os.PathLike[str] | None = None,
        form: StoredForm = DEFAULT_FORM,
        is_busy: Callable[[], bool] = lambda: False,
        reprofile_rate_per_s: float = 1 / 60,
        reprofile_burst: float = 4,
        query_sample_size: int = 32,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.evaluator = evaluator  # the cheap estimator: every context's first profile
        self.refiner = refiner  # refines where a decision is close (None: nothing refines)
        self.ttft = ttft
        self.policy = policy
        self.form = form
        self.wall_clock = wall_clock
        self.clock = clock
        root = None if directory is None else Path(directory)
        self.queries = QueryStore(
            None if root is None else root / "queries", sample_size=query_sample_size
        )
        self.store = None if root is None else ProfileStore(root / "profiles")
        self.frequency = FrequencyTracker(policy.frequency_half_life_s)
        self.scheduler = ReprofileScheduler(
            policy.reprofile_threshold,
            is_busy,
            rate_per_s=reprofile_rate_per_s,
            burst=reprofile_burst,
            clock=clock,
        )
        self._records: dict[str, ProfileRecord] = {}
        self._unsaved: set[str] = set()  # profiled contexts whose count changed since saved
        self._gone: OrderedDict[str, None] = OrderedDict()  # set aside, oldest first
        self.gone_kept = GONE_KEPT

    # -- profiles ----------------------------------------------------------------------------

    def profile(
        self,
        context_id: str,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: Sequence[ProfilingQuery] = (),
        variants: Sequence[str] | None = None,
        window_queries: torch.Tensor | None = None,
        form: StoredForm | None = None,
        refine: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ContextProfile:
        """Profile one context's ``[L, H, N, D]`` KV on its profiling queries (``queries`` are
        added to the user-supplied ones first) over ``variants`` (default: the policy's grid),
        compressed as they are stored (``form``, default the profiler's), with the estimator
        (with the refiner when ``refine``); persist and return the :class:`ContextProfile`.
        ``prefix``: the keys and values ``[L, H, P, D]`` of the context's ancestors, which a
        request reads before it (``ContextKV.prefix_keys``; issue 29)."""
        evaluator = self.evaluator_for(refine)
        form = form or self.form
        if queries:
            self.queries.add_user(context_id, list(queries))
        tokens = self.queries.tokens(context_id, int(keys.shape[2]))
        pk, pv = prefix if prefix is not None else (None, None)
        kv = ContextKV(keys=keys, values=values, window_queries=window_queries, token_ids=tokens,
                       prefix_keys=pk, prefix_values=pv)  # fmt: skip
        names = list(dict.fromkeys([ORIGINAL_VARIANT, *(variants or self.policy.variants)]))
        source, qs = self.queries.profiling_set(context_id)
        lossy = [v for v in names if v != ORIGINAL_VARIANT]
        result = evaluator.evaluate(kv, lossy, qs, form=form) if lossy else None
        lyr, h, n, d = (int(s) for s in keys.shape)
        profiles = []
        for v in names:
            size = variant_size_bytes(
                lyr,
                h,
                d,
                n,
                keys.element_size(),
                v,
                chunk_tokens=count_unit(v, form.chunk_tokens),
                group_size=form.group_size,
            )
            quality = 1.0 if result is None or v == ORIGINAL_VARIANT else result[v]
            if not 0.0 <= quality <= 1.0:  # NaN too: a placer must never see one (issue 27.4)
                raise InvalidArgumentError(
                    f"context {context_id}: the quality of {v} came out {quality!r}, not a "
                    "number in [0, 1] (are its stored bytes KV? NaN or huge values in them)"
                )
            profiles.append(VariantProfile(v, size, quality, self.ttft.restore_s(v, size)))
        now = self.wall_clock()
        if self.frequency.frequency(context_id, now) == 0.0:
            self.record_access(context_id)  # the put that brought the context is its first use
        record = ProfileRecord(
            profile=ContextProfile(context_id, tuple(profiles), prefill_s=self.ttft.prefill_s(n)),
            evaluator=evaluator.name,
            query_source=source,
            num_queries=result.num_queries if result else 0,
            num_tokens=n,
            repeated_requests=self.queries.repeated_requests(context_id, qs) if result else 0,
            profiled_at_s=now,
        )
        self.queries.mark_profiled(context_id)
        if not self._confident(record) and self.trusted(context_id):
            logger.info(
                "context %s: a profile from %d queries (%s) is below profiling.min_queries %d; "
                "the one from %d queries stays", context_id, record.num_queries, source,
                self.policy.min_queries, self._records[context_id].num_queries,
            )  # fmt: skip
            return self.profile_of(context_id)
        if not refine and self.refined(context_id) and self.trusted(context_id):
            # A first profile queued at the put can end after a refinement asked for
            # meanwhile (kvtierctl profile run): the estimator never replaces the refiner.
            logger.info("context %s: its refined profile stays over the estimator's", context_id)
            return self.profile_of(context_id)
        self._records[context_id] = record
        self._save(context_id)
        return self.profile_of(context_id)

    def evaluator_for(self, refine: bool) -> QualityEvaluator:
        """The refiner when ``refine`` and there is one, else the estimator."""
        return self.refiner if refine and self.refiner is not None else self.evaluator

    def trusted(self, context_id: str) -> bool:
        """Whether the context's profile may move it (the confidence rule): the estimator's
        always (it is every context's first, with whatever probes it has); the refiner's when
        scored on at least ``policy.min_queries`` queries, or on queries that each came at
        least twice in at least that many requests (docs/profiler.md). A refined profile
        from fewer is kept and shown, but a placer must treat the context as unprofiled; it
        never replaces one that was trusted."""
        record = self._records.get(context_id)
        return record is not None and self._confident(record)

    def refined(self, context_id: str) -> bool:
        """Whether the context's profile is the refiner's."""
        record = self._records.get(context_id)
        return self.refiner is not None and record is not None and (
            record.evaluator == self.refiner.name
        )  # fmt: skip

    def _confident(self, record: ProfileRecord) -> bool:
        if self.refiner is None or record.evaluator != self.refiner.name:
            return True  # the estimator's: trusted from the start (issue 26)
        lossy = any(v.variant != ORIGINAL_VARIANT for v in record.profile.variants)
        least = self.policy.min_queries
        return not lossy or record.num_queries >= least or record.repeated_requests >= least

    def enough_queries(self, context_id: str) -> bool:
        """Whether a refined profile made now would be trusted (the confidence rule, on the
        context's current profiling set)."""
        _, queries = self.queries.profiling_set(context_id)
        least = self.policy.min_queries
        return len(queries) >= least or self.queries.repeated_requests(context_id, queries) >= least

    def profile_of(self, context_id: str) -> ContextProfile:
        """The context's profile with its frequency as of now (its ``last_access_s`` is 0.0:
        the daemon keeps last accesses on its records)."""
        p = self._records[context_id].profile
        return replace(p, frequency=self.frequency.frequency(context_id, self.wall_clock()))

    def record(self, context_id: str) -> ProfileRecord | None:
        return self._records.get(context_id)

    def profiled_ids(self) -> list[str]:
        return list(self._records)

    def set_aside(self, context_id: str) -> None:
        """The context's bytes left the daemon (dropped for recompute, evicted, deleted, lost):
        its KV is the same when its prompt is computed again, so its profile, frequency and
        queries are kept for when it returns (EvicPress weighs every context's frequency,
        dropped ones too). Its token ids should go (``queries.drop_tokens``, on the thread
        that registers them): they are the heavy part and come back with the prompt. Only the
        newest ``gone_kept`` such contexts are kept; older ones are forgotten."""
        self._gone[context_id] = None
        self._gone.move_to_end(context_id)
        while len(self._gone) > self.gone_kept:
            oldest, _ = self._gone.popitem(last=False)
            self.forget(oldest)

    def is_set_aside(self, context_id: str) -> bool:
        return context_id in self._gone

    def returned(self, context_id: str) -> None:
        """A context set aside is stored again: its profile is live, never pruned."""
        self._gone.pop(context_id, None)

    def forget(self, context_id: str) -> None:
        """Drop everything kept about a context: profile, queries and counts (files too)."""
        self._records.pop(context_id, None)
        self._unsaved.discard(context_id)
        self.frequency.forget(context_id)
        self.queries.forget(context_id)
        if self.store is not None:
            self.store.delete(context_id)

    # -- traffic -----------------------------------------------------------------------------

    def record_access(self, context_id: str, weight: float = 1.0) -> None:
        """A load of the context (frequency only; in memory until :meth:`flush`)."""
        self.frequency.record(context_id, self.wall_clock(), weight)
        if context_id in self._records:
            self._unsaved.add(context_id)

    def record_query(self, context_id: str, query: ProfilingQuery) -> None:
        """A served request on the context: count the access and keep the query as a sample."""
        self.record_access(context_id)
        self.queries.record(context_id, query, persist=False)

    # -- drift -------------------------------------------------------------------------------

    def check_drift(
        self,
        context_id: str,
        keys: torch.Tensor,
        values: torch.Tensor,
        variant: str,
        *,
        window_queries: torch.Tensor | None = None,
        form: StoredForm | None = None,
    ) -> DriftSample | None:
        """Quality of the stored ``variant`` on the newest real queries vs its profiled quality;
        ``None`` when the context has no profile or no new traffic since it was profiled."""
        record = self._records.get(context_id)
        recent = self.queries.recent(context_id)
        if record is None or not recent or self.queries.new_since_profile(context_id) == 0:
            return None
        profiled = record.profile.variant(variant).quality
        online = 1.0
        if variant != ORIGINAL_VARIANT:
            tokens = self.queries.tokens(context_id, int(keys.shape[2]))
            kv = ContextKV(
                keys=keys, values=values, window_queries=window_queries, token_ids=tokens
            )
            form = form or self.form
            online = self.evaluator.evaluate(kv, [variant], recent, form=form)[variant]
        return DriftSample(context_id, variant, profiled, online, len(recent))

    def due_for_reprofile(self, sample: DriftSample | None) -> Decision:
        return self.scheduler.decide(sample)

    def reprofile_candidates(self) -> list[str]:
        """Profiled contexts with real queries recorded since their last profile."""
        # A copy first: profiles finish on the profiling threads and add records meanwhile
        # ("dictionary changed size during iteration" ended the reprofile loop, and with it
        # a graceful stop, at 50,000 contexts).
        return [c for c in list(self._records) if self.queries.new_since_profile(c) > 0]

    def reprofile_loop(
        self,
        measure: Callable[[str], Awaitable[DriftSample | None]],
        reprofile: Callable[[str], Awaitable[None]],
    ) -> ReprofileLoop:
        """The periodic loop over :meth:`reprofile_candidates` every ``policy.interval_s``."""
        return ReprofileLoop(
            self.scheduler,
            candidates=self.reprofile_candidates,
            measure=measure,
            reprofile=reprofile,
            interval_s=self.policy.reprofile_interval_s,
        )

    # -- persistence -------------------------------------------------------------------------

    def load(self) -> int:
        """Reload profiles, frequencies and queries persisted before a restart."""
        self.queries.load()
        if self.store is None:
            return 0
        states = {}
        for r in self.store.records():
            self._records[r.context_id] = r
            states[r.context_id] = (r.frequency_value, r.frequency_t_ref_s)
        self.frequency.restore(states)
        return len(states)

    def flush(self) -> None:
        """Persist the frequencies and sampled queries that changed since they were last
        written (call periodically and at shutdown); a profile is written when it is made."""
        for cid in list(self._unsaved):  # a copy: profiles finish on other threads meanwhile
            if cid in self._records:
                self._save(cid)
        self.queries.flush()

    def _save(self, context_id: str) -> None:
        self._unsaved.discard(context_id)
        if self.store is None:
            return
        record = self._records[context_id]
        value, t_ref = (
            self.frequency.state(context_id) if context_id in self.frequency else (0.0, 0.0)
        )
        record = replace(record, frequency_value=value, frequency_t_ref_s=t_ref)
        self._records[context_id] = record
        self.store.save(record)
