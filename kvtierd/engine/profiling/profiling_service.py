# Long because scheduling (settle, drift, refine) and running a profile share one worker.
"""The engine's profiling service (EvicPress §4.1, §4.3): it keeps the profiler of the running
policy and runs it on the contexts that need a profile.

Contexts arrive chunk by chunk, so a context is profiled — by the policy's cheap estimator,
trusted from the start — once it has been quiet for ``settle_s`` and vLLM is idle (no load
queued, no request in flight at a router, ``in_flight_reports.py``), after its put was answered.
Where the placer's decision on a context is within the estimator's error (``margin.py``), the
policy's refining evaluator (``answer``, ``served``) profiles it again while vLLM is idle
(``refinement.py``). The :class:`~kvtierd.profiler.Profiler` runs on one worker thread (it is
not thread-safe; its query store is, and routed prompts' tokens and queries are recorded on a
thread of their own, ``profile_inputs.py``) and its results reach the placer as a new profile:
the options of the context (``context_options.py``). ``snapkv`` variants are scored and built
with window queries recomputed from the policy's ``profiling.model_dir``
(``observation_window.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from kvtierd.config import DaemonConfig
from kvtierd.engine.context_options import NO_LAYOUT
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.profiling import observation_window as window
from kvtierd.engine.profiling.decision_log import DecisionLog
from kvtierd.engine.profiling.profile_runs import ProfileRun, RunKind
from kvtierd.engine.profiling.profiling_model import QualityProfiling
from kvtierd.engine.profiling.profiling_parts import ProfilingParts
from kvtierd.engine.state import ContextRecord, RunningPolicy
from kvtierd.errors import CapacityError, KvtierError, UnavailableError
from kvtierd.metrics import Metrics
from kvtierd.model_fetch import SMOLLM2, model_cache_dir
from kvtierd.policies import placer_class
from kvtierd.policy_config import PolicyConfig
from kvtierd.profiler.store import ProfileReading
from kvtierd.types import ORIGINAL_VARIANT

if TYPE_CHECKING:
    from kvtierd.profiler import DriftSample, Profiler, ProfileRecord, ProfilingQuery, ReprofileLoop

logger = logging.getLogger(__name__)

ROOM_RETRY_S = 1.0  # how long first profiles wait after the arena had no room for one
FEW_OBJECTS = 8  # a put asks at once whether a context this small has a chunk layout
FIRST_BATCH = 4096  # settled contexts a round of first profiles takes at most (5 rounds a s)

NO_TOKEN_IDS = (
    "evaluator {name!r} needs the context's token ids, and none were registered for it "
    "(LMCache gives the daemon chunk hashes, never tokens; kvtierd router registers the tokens "
    "of the prompts it forwards through KVStore.SetContextTokens): this context is not "
    "profiled; send its traffic through the router, register its tokens, or use 'attention' "
    "or 'answer' in the policy (docs/profiler.md)"
)


def _uses_quality(policy: PolicyConfig) -> bool:
    return placer_class(policy.placer).uses_quality


class ProfilingService:
    """Profiles the contexts of ``index`` (their bytes read through ``mover``) under the running
    ``policy``. ``loads_busy`` says whether loads are being served (profiling then waits);
    ``on_profiled(ctx)`` is told when a context's options changed (a new profile, or a
    token-dropped variant became servable): the engine has the placer place it again.
    ``make_profiler(policy)`` builds the profiler of a policy (at start and on each reload).
    Every collaborator is built by the engine and handed in (``parts``): ``options`` prices
    the contexts for the placer; ``inputs`` takes their token ids and queries."""

    def __init__(
        self,
        *,
        config: DaemonConfig,
        index: ContextIndex,
        mover: TierMover,
        policy: RunningPolicy,
        metrics: Metrics,
        parts: ProfilingParts,
        make_profiler: Callable[[PolicyConfig], Profiler],
        loads_busy: Callable[[], bool],
        on_profiled: Callable[[ContextRecord], None],
        settle_s: float = 0.5,
    ) -> None:
        self._config = config
        self._index = index
        self._mover = mover
        self._policy = policy
        self._metrics = metrics
        self._make_profiler = make_profiler
        self._loads_busy = loads_busy
        self.on_profiled = on_profiled
        self.settle_s = settle_s
        self.profiler: Profiler | None = None
        self._worker = parts.worker
        self._changed: dict[str, float] = {}
        self.resume_at = 0.0  # monotonic: the next profile of its own starts no earlier
        self.prefill_fit = parts.prefill_fit  # kept across policy reloads: it describes vLLM
        self.served = parts.served  # reports by tenant, rate-limited
        self.yield_gate = parts.yield_gate  # profiling steps wait for serving
        self.run_log = parts.run_log
        self.tokens = parts.tokens
        self.servable = parts.servable
        self.options = parts.options
        self.inputs = parts.inputs
        self.ancestors = parts.ancestors
        self.refinement = parts.refinement
        self.model = parts.model  # which checkpoint profiles read (profiling_model.py)
        self._task: asyncio.Task[None] | None = None
        self._drift: asyncio.Task[None] | None = None
        self._loop: ReprofileLoop | None = None
        self._running = False
        self.reprofiled = 0
        self.runs: Counter[str] = Counter()
        self._room_wait_until = 0.0  # first profiles wait until then (:meth:`_short_of_room`)
        self._room_logged_at = -60.0
        self.last_error = ""
        self.failed_why: dict[str, str] = {}  # contexts whose last profile failed, and why
        self._prior_to_redo: set[str] = set()  # prior-only profiles a model found since redoes
        # contexts with nothing to profile: DEBUG each, an INFO summary per interval
        self.not_profiled = DecisionLog("contexts not profiled")
        self.profiled_log = DecisionLog("contexts profiled")

    # -- configuration -----------------------------------------------------------------------

    def configure(self) -> None:
        """(Re)build the profiler for the running policy (at start, on hot reload, and when a
        model card lets the model cache's checkpoint stand for the served model)."""
        policy = self._policy.current = self.model.resolve(self._policy.current)
        self.profiler = self._make_profiler(policy)
        self.profiler.load()
        self.options.changed()
        for evaluator in (self.profiler.evaluator, self.profiler.refiner):
            if evaluator is not None and evaluator.needs_token_ids:
                logger.warning(
                    "evaluator %r needs the context's token ids: only contexts whose tokens "
                    "are registered (KVStore.SetContextTokens; kvtierd router does it) are "
                    "profiled by it", evaluator.name,
                )  # fmt: skip
        self._say_what_profiles_read(policy)
        self._restart_drift_loop()

    def _say_what_profiles_read(self, policy: PolicyConfig) -> None:
        quality = self.model.describe(policy)
        if quality.prior_only:
            # INFO, not WARNING: without a model the token-dropping variants still read each
            # context (coverage, from its token ids); only quantizations get the prior alone
            logger.info(
                "quality profiles: no model (set profiling.model_dir): estimator %r scores a "
                "context's token-dropping variants by their coverage where its token ids are "
                "registered (kvtierd router and the plugin register them), and everything else "
                "— quantizations, contexts without token ids — by the labels' per-variant "
                "share, the same for every context. Name the served model's checkpoint in the "
                "policy's profiling.model_dir; "
                "or fetch SmolLM2 into %s (kvtierd model fetch), which the daemon uses by "
                "itself once the served model's card matches it (docs/profiler.md, "
                "\"Readings\")", quality.estimator, model_cache_dir() / SMOLLM2.name,
            )  # fmt: skip
        elif quality.model_from == "model cache":
            logger.info(
                "quality profiles read %s (kvtierd's model cache): the policy names no "
                "profiling.model_dir, and the checkpoint's geometry is the served model's "
                "(its model card)", quality.model_dir,
            )  # fmt: skip

    def card_learned(self) -> None:
        """A model card arrived: where the policy names no model, the model cache's
        checkpoint may now stand for the served model (``profiling_model.py``); if so the
        profiler is rebuilt with it, and contexts profiled from the prior alone are profiled
        again."""
        policy = self._policy.current
        if policy.evaluator_model_dir or not self.model.resolve(policy).evaluator_model_dir:
            return
        self.configure()
        profiler = self.profiler
        for cid in self._index.contexts:
            record = None if profiler is None else profiler.record(cid)
            if record is not None and record.reading is ProfileReading.PRIOR:
                self._prior_to_redo.add(cid)
                self.schedule(cid)

    def quality(self) -> QualityProfiling:
        """How the running policy's profiles are made (``Admin.Status``)."""
        return self.model.describe(self._policy.current)

    def _restart_drift_loop(self) -> None:
        """Periodic re-profiling on drift (EvicPress §4.3), for the placer that uses quality."""
        if self._drift is not None:
            self._drift.cancel()
            self._drift = None
        policy = self._policy.current
        if self.profiler is None or not _uses_quality(policy) or not self._running:
            return
        if policy.refines:  # the refining evaluator re-profiles where it matters (refinement.py)
            return
        self._loop = self.profiler.reprofile_loop(self._measure, self._reprofile)
        self._drift = asyncio.create_task(self._loop.run_forever(), name="kvtierd-reprofile")

    async def _measure(self, context_id: str) -> DriftSample | None:
        ctx = self._index.contexts.get(context_id)
        if ctx is None or self.profiler is None:
            return None
        try:
            keys, values = await self._mover.context_tensors(ctx)
        except KvtierError:
            return None  # the original is not kept: drift cannot be measured
        model_dir = self._policy.current.evaluator_model_dir
        options = self.options
        check = partial(window.check_drift, self.profiler, context_id, keys, values, ctx.variant,
                        model_dir=model_dir, variants=options.profiled_variants(ctx),
                        form=options.stored_form_of(ctx))  # fmt: skip
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, check)
        except Exception as e:  # one context's bytes must not stop the drift loop
            if self.failed_why.get(context_id) != f"drift: {e}":  # logged once per reason
                logger.exception("context %s: drift not measured", context_id)
            self.failed_why[context_id] = f"drift: {e}"
            return None

    async def _reprofile(self, context_id: str) -> None:
        ctx = self._index.contexts.get(context_id)
        if ctx is not None:
            self.reprofiled += 1
            await self.profile_context(ctx, kind=RunKind.DRIFT)

    # -- prefill speed and records ---------------------------------------------------------------

    def observe_served(
        self, prompt_tokens: int, cached_tokens: int, ttft_s: float, tenant: str = ""
    ) -> bool:
        """A served request's timing (the router's ``KVStore.ReportServed``): a prefill sample
        when vLLM computed most of its prompt; only the default tenant's price every context
        (``prefill_fit.py``, ``ServedReports``)."""
        return self.served.observe(tenant, prompt_tokens, cached_tokens, ttft_s)

    def prefill_tokens_per_s(self, tenant: str = "") -> float:
        """The prefill speed recomputes are priced at (``tenant``: as its own reports say):
        learned, else configured."""
        learned = self.served.fit(tenant).estimate()
        return learned.tokens_per_s if learned else self._config.prefill_tokens_per_s

    def record(self, context_id: str) -> ProfileRecord | None:
        return None if self.profiler is None else self.profiler.record(context_id)

    # -- work --------------------------------------------------------------------------------

    def note_change(self, ctx: ContextRecord) -> None:
        """A put changed the context: profile it once it settles, unless a trusted profile of
        it at this length is kept from before it was dropped (``Profiler.set_aside``)."""
        p = self.profiler
        if p is not None and self._running and p.is_set_aside(ctx.context_id):
            self._worker.submit(p.returned, ctx.context_id)  # not per put: a put is hot
        # (the original is not asked unchoosable here: that parses its layouts, on every put)
        sourced = ctx.variant == ORIGINAL_VARIANT or (
            self._index.self_sourced(ctx) and not self.options.unchoosable(ctx)
        )
        if not sourced or self._kept_profile(ctx):
            return
        if len(ctx.keys) <= FEW_OBJECTS and self.options.opaque(ctx):
            # Nothing to profile, and said at once, not after a turn in the backlog: 9 in 10
            # of issue 42's contexts, which waited there behind every profiled one (~60 bytes
            # a context at 1M puts). Said at its first object (a context counted once).
            if len(ctx.keys) == 1:
                self.not_profiled.note(ctx.context_id, NO_LAYOUT)
            return
        self.schedule(ctx.context_id)

    def schedule(self, context_id: str) -> None:
        """Profile the context once it has settled (:attr:`settle_s`)."""
        self._changed[context_id] = time.monotonic()

    def _kept_profile(self, ctx: ContextRecord) -> bool:
        """A profile of the context at its length is kept from before: a trusted one, or one
        that a new profile could not make trusted (it would move nothing either: a context
        the placer keeps dropping was profiled again on each return, on the same queries)."""
        p = self.profiler
        record = None if p is None else p.record(ctx.context_id)
        if p is None or record is None or record.num_tokens != self.options.geometry_of(ctx)[1]:
            return False
        if ctx.context_id in self._prior_to_redo:
            return False  # profiled from the prior alone; a model can tell it apart now
        return p.trusted(ctx.context_id) or not p.enough_queries(ctx.context_id)

    def forget(self, context_id: str) -> None:
        """A context's bytes are gone: drop its token ids; its profile, frequency and queries
        are set aside for when its prompt is computed and stored again (Profiler.set_aside)."""
        num_tokens = self.options.forget(context_id)
        self.tokens.forget(context_id)
        self.servable.forget(context_id)
        self.failed_why.pop(context_id, None)
        self._changed.pop(context_id, None)
        self._prior_to_redo.discard(context_id)
        self.refinement.forget(context_id)
        if self.profiler is not None and self._running:
            if not num_tokens:
                record = self.profiler.record(context_id)
                num_tokens = 0 if record is None else record.num_tokens
            self.inputs.set_aside(context_id, num_tokens)
            self._worker.submit(self.profiler.set_aside, context_id)

    def note_access(self, context_id: str) -> None:
        if self.profiler is not None:
            self.profiler.record_access(context_id)

    def start(self) -> None:
        if self.profiler is not None:  # ids an earlier run kept count against their tenant
            contexts = self._index.contexts
            for cid, count in self.profiler.queries.token_counts().items():
                ctx = contexts.get(cid)
                if ctx is not None:
                    self.tokens.known(cid, ctx.tenant, count)
            for cid in self.profiler.profiled_ids():  # kept from contexts dropped before
                if cid not in self._index.contexts:
                    self.profiler.set_aside(cid)
        self._running = True
        self._task = asyncio.create_task(self._run_forever(), name="kvtierd-profiling")
        self._restart_drift_loop()

    async def close(self) -> None:
        self._running = False
        for task in (self._task, self._drift):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._worker.shutdown(wait=True)  # first: a profile running there writes its files too
        self.not_profiled.summarize()
        self.profiled_log.summarize()
        if self.profiler is not None:
            self.profiler.flush()
        self.inputs.close()

    @property
    def healthy(self) -> bool:
        return all(t is None or not t.done() for t in (self._task, self._drift))

    async def _run_forever(self, period_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(period_s)
            if not _uses_quality(self._policy.current):
                self._changed.clear()  # a placer that decides on sizes needs no profile
                continue
            await self._first_profiles()
            if not self._changed:  # every context has its first profile: refine one
                await self._refine_one()

    async def _first_profiles(self) -> None:
        """The estimator's profile of every context that settled since its put, while vLLM is
        idle (EvicPress §4.3: with free cycles). It is cheap, and every context should have it
        before its next request: under traffic with no gap one starts after
        ``yield_gate.max_wait_s`` anyway (its steps still wait at the gate). At most
        :data:`FIRST_BATCH` contexts a round: a list of every settled one, made five times a
        second, was a pass over the whole backlog while puts outran profiling (issue 42: half
        a million contexts at 1M puts), to profile the first few."""
        now = time.monotonic()
        if now < self._room_wait_until:
            return  # the arena had no room to read a context in (:meth:`_short_of_room`)
        settled = ((c, t) for c, t in self._changed.items() if now - t >= self.settle_s)
        ready = list(itertools.islice(settled, FIRST_BATCH))
        for cid, since in ready:
            await asyncio.sleep(0)  # contexts with nothing to profile take no await at all
            if time.monotonic() < self._room_wait_until:
                break  # the arena had no room to read a context in (:meth:`_short_of_room`)
            overdue = time.monotonic() - since >= self.settle_s + self.yield_gate.max_wait_s
            if self._loads_busy() and not overdue:
                break
            self._changed.pop(cid, None)
            ctx = self._index.contexts.get(cid)
            # (asked again: a context that returns in several puts is short of its kept
            # profile's length at the first)
            if ctx is not None and not self._kept_profile(ctx):
                await self.profile_context(ctx, kind=RunKind.FIRST)
            self._prior_to_redo.discard(cid)

    async def _refine_one(self) -> None:
        """One refinement by the policy's refining evaluator, only while vLLM is idle and
        the daemon's own profiling is within ``max_share`` (``refinement.py``)."""
        p = self.profiler
        if p is None or p.refiner is None or not self._running:
            return
        if self._loads_busy() or time.monotonic() < self.resume_at:
            return
        ctx = self.refinement.next()
        if ctx is None:
            return
        started = time.monotonic()
        await self.profile_context(ctx, kind=RunKind.REFINE)
        self.rest_after(time.monotonic() - started)

    def rest_after(self, elapsed_s: float) -> None:
        """A refinement of the daemon's own took ``elapsed_s``: the next starts after a rest
        that keeps refining to ``profiling.max_share`` of the time (an expensive profile takes
        compute from the requests being served: docs/profiler.md)."""
        share = self._policy.current.profiling_share
        self.resume_at = time.monotonic() + elapsed_s * (1.0 / share - 1.0)

    async def profile_context(
        self,
        ctx: ContextRecord,
        queries: tuple[ProfilingQuery, ...] = (),
        *,
        kind: RunKind = RunKind.ASKED,
    ) -> bool:
        """Profile now — with the estimator for a first profile or a drift, else with the
        refiner when the policy has one; a failure is counted, logged and reported, never
        raised to the loop."""
        if self.profiler is None:
            raise UnavailableError("the profiler is not configured (the daemon is starting)")
        why = self.options.unchoosable(ctx)
        if why:
            self.not_profiled.note(ctx.context_id, why)  # DEBUG, counted (issue 42)
            return False
        refine = kind in (RunKind.REFINE, RunKind.ASKED)
        evaluator = self.profiler.evaluator_for(refine)
        started_unix_s = time.time()
        waited_before = self.yield_gate.waited_s
        if refine:
            self.refinement.tried(ctx.context_id)
        ok = await self._run(self.profiler, ctx, queries, refine)
        self.run_log.add(ProfileRun(ctx.context_id, evaluator.name, kind, started_unix_s,
                                    time.time(), self.yield_gate.waited_s - waited_before,
                                    ok))  # fmt: skip
        return ok

    async def _run(
        self,
        profiler: Profiler,
        ctx: ContextRecord,
        queries: tuple[ProfilingQuery, ...],
        refine: bool,
    ) -> bool:
        started = time.perf_counter()
        waited_before = self.yield_gate.waited_s
        evaluator = profiler.evaluator_for(refine)
        try:
            keys, values = await self._mover.context_tensors(ctx)
            n = int(keys.shape[2])
            if evaluator.needs_token_ids and not profiler.queries.tokens(ctx.context_id, n):
                return self._failed(ctx, started, NO_TOKEN_IDS.format(name=evaluator.name))
            # a child is scored after its ancestors' KV, as a request reads it (issue 29)
            prefix = await self.ancestors.prefix_of(ctx)
            if prefix is not None and prefix[0].shape[:2] + prefix[0].shape[3:] != (
                keys.shape[:2] + keys.shape[3:]
            ):
                prefix = None  # another model's KV above it: scored alone
            run = partial(window.profile, profiler, self._policy.current.evaluator_model_dir,
                          ctx.context_id, keys, values, queries=queries,
                          variants=self.options.profiled_variants(ctx),
                          form=self.options.stored_form_of(ctx), refine=refine,
                          prefix=prefix)  # fmt: skip
            await asyncio.get_running_loop().run_in_executor(self._worker, run)
        except CapacityError as e:
            if refine:
                return self._failed(ctx, started, str(e))
            return self._short_of_room(ctx, started, e)
        except KvtierError as e:
            return self._failed(ctx, started, str(e))
        except Exception as e:
            # What a client stored may break a profile in ways no check foresaw: that context
            # is set aside (its reason in DescribeContext), the loop and health go on; an
            # escaped error stopped the loop and marked the daemon NOT_SERVING (issue 27.4).
            logger.exception("profiling %r failed unexpectedly", ctx.context_id)
            return self._failed(ctx, started, f"{type(e).__name__}: {e}")
        self.failed_why.pop(ctx.context_id, None)
        self.runs["ok"] += 1
        self.options.changed()
        elapsed = time.perf_counter() - started
        self._metrics.observe_profile_run(elapsed, ok=True)
        waited = self.yield_gate.waited_s - waited_before
        # DEBUG each, an INFO count per interval: at 100k objects one line per profiled
        # context was most of the INFO log (issue 42's quiet logs); times are in the metrics
        self.profiled_log.note(ctx.context_id, f"profiled by {evaluator.name}",
                               f" in {elapsed:.1f} s, of which {waited:.1f} s waiting for "
                               "requests to be served")  # fmt: skip
        if ctx.context_id in self._index.contexts and not ctx.durable_held:
            # (a context held for its unread durable objects is placed again once read)
            try:
                self.on_profiled(ctx)
            except CapacityError as e:  # its best place is full of pinned or held contexts
                logger.warning("context %s: profiled, and stays where it is: %s",
                               ctx.context_id, e)  # fmt: skip
            except Exception as e:  # the placer refused its profile: it stays where it is
                logger.exception("context %s: profiled, and the placer failed on it",
                                 ctx.context_id)  # fmt: skip
                self.failed_why[ctx.context_id] = f"the placer failed on its profile: {e}"
        # queries that arrived while it ran found no finished profile to compare against
        self.inputs.recheck(ctx.context_id)
        return True

    def _short_of_room(self, ctx: ContextRecord, started: float, error: CapacityError) -> bool:
        """No room in the arena to read the context in: puts are outrunning the moves down.
        Nothing is wrong with the context: it is profiled again once it has settled again, and
        first profiles wait :data:`ROOM_RETRY_S` (the next would find the arena as full). Each
        used to fail at once with an ERROR, one after another without a pause, each after a
        pass over the arena's objects: at issue 42's 1M puts they held the event loop for
        seconds at a time."""
        self.runs["no room"] += 1
        self._metrics.observe_profile_run(time.perf_counter() - started, ok=False)
        now = time.monotonic()
        self._room_wait_until = now + ROOM_RETRY_S
        self._changed[ctx.context_id] = now
        log = logger.debug
        if now - self._room_logged_at >= 60.0:  # one line a minute at most
            self._room_logged_at, log = now, logger.warning
        log("profiling waits for room in the arena (%d contexts so far): %s",
            self.runs["no room"], error)  # fmt: skip
        return False

    def _failed(self, ctx: ContextRecord, started: float, reason: str) -> bool:
        self.runs["failed"] += 1
        self.last_error = f"{ctx.context_id}: {reason}"
        self.failed_why[ctx.context_id] = reason
        self._metrics.observe_profile_run(time.perf_counter() - started, ok=False)
        logger.error("profiling %r failed: %s", ctx.context_id, reason)
        return False
