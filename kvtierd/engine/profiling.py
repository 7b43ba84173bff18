"""The engine's side of profiling (EvicPress §4.1, §4.3): which variants a context can take,
their sizes, and — once the profiler has run — their quality.

Contexts arrive chunk by chunk, so a context is profiled once it has been quiet for
``settle_s`` and no load is queued; the :class:`~kvtierd.profiler.Profiler` runs on one worker
thread (it is not thread-safe; its query store is, and routed prompts' tokens and queries are
recorded on a thread of their own) and its results reach the placer as a new profile. ``snapkv``
variants are scored and built with window queries recomputed from the policy's
``profiling.model_dir`` (``window.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from kvtierd.config import DaemonConfig
from kvtierd.engine import window
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.mover import TierMover
from kvtierd.engine.servable import Servability, ServableForm
from kvtierd.engine.state import ContextRecord, RunningPolicy
from kvtierd.engine.tokens import MAX_PENDING_PROMPTS, MAX_QUERY_TOKENS, TokenBudget, packed
from kvtierd.errors import (
    CapacityError,
    CorruptObjectError,
    InvalidArgumentError,
    KvtierError,
    NotFoundError,
    UnavailableError,
)
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard
from kvtierd.metrics import Metrics
from kvtierd.profiler.prefill_fit import PrefillFit
from kvtierd.profiler.yield_gate import YieldGate
from kvtierd.sizes import DTYPE_BYTES, count_unit, variant_size_bytes
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta, VariantProfile

if TYPE_CHECKING:
    from kvtierd.profiler import (
        DriftSample,
        ProfileLayout,
        Profiler,
        ProfileRecord,
        ProfilingQuery,
        ReprofileLoop,
    )

logger = logging.getLogger(__name__)

UNKNOWN_PREFILL_S = 60.0
"""Recompute cost assumed for a context of unknown length (documented in docs/daemon.md)."""
NO_TOKEN_IDS = (
    "evaluator {name!r} needs the context's token ids, and none were registered for it "
    "(LMCache gives the daemon chunk hashes, never tokens; kvtierd router registers the tokens "
    "of the prompts it forwards through KVStore.SetContextTokens): this context is not "
    "profiled; send its traffic through the router, register its tokens, or use 'attention' "
    "or 'answer' in the policy (docs/profiler.md)"
)


def _ignore(_: ContextRecord) -> None:
    return None


class ProfilingService:
    """Profiles the contexts of ``index`` (their bytes read through ``mover``) under the running
    ``policy``. ``loads_busy`` says whether loads are being served (profiling then waits);
    ``on_profiled(ctx)`` is told when a context's options changed (a new profile, or a
    token-dropped variant became servable): whoever wires the service has the placer place
    it again."""

    def __init__(
        self,
        *,
        config: DaemonConfig,
        index: ContextIndex,
        mover: TierMover,
        policy: RunningPolicy,
        metrics: Metrics,
        model_cards: Mapping[str, ModelCard],
        loads_busy: Callable[[], bool],
        settle_s: float = 0.5,
    ) -> None:
        self._config = config
        self._index = index
        self._mover = mover
        self._policy = policy
        self._metrics = metrics
        self._loads_busy = loads_busy
        self.on_profiled: Callable[[ContextRecord], None] = _ignore
        self.settle_s = settle_s
        self.profiler: Profiler | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-profiler")
        # Tokens and queries of routed prompts: never queued behind a profile, which through
        # the serving stack takes seconds to minutes (the router gave links up after 10 s)
        self._queries = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-queries")
        self._changed: dict[str, float] = {}
        self.prefill_fit = PrefillFit()  # kept across policy reloads: it describes the engine
        self.yield_gate = YieldGate(loads_busy)  # profiling steps wait for serving
        self.tokens = TokenBudget(config.token_bytes_per_tenant)
        self.servable = Servability(model_cards, lambda: policy.current.evaluator_model_dir)
        self._variants: list[str] = []
        self._variants_of: object = None
        self._geometry_cache: dict[
            str, tuple[tuple[str, int, int], tuple[ChunkFormat | None, int, int]]
        ] = {}
        self._task: asyncio.Task[None] | None = None
        self._drift: asyncio.Task[None] | None = None
        self._loop: ReprofileLoop | None = None
        self._running = False
        self.reprofiled = 0
        self.runs: Counter[str] = Counter()
        self.last_error = ""
        # Bumped when a profile appears, goes, or a context changes form (its grid may
        # shrink to the form it has): what derived figures (the write advice's prior) key on.
        self.version = 0

    # -- configuration -----------------------------------------------------------------------

    def configure(self) -> None:
        """(Re)build the profiler for the running policy (at start and on hot reload)."""
        from kvtierd.profiler import Profiler, TtftModel, make_evaluator

        policy = self._policy.current
        options = {
            "answer": {"model_path": policy.evaluator_model_dir},
            "engine": {"router_url": policy.evaluator_router_url,
                       "vllm_url": policy.evaluator_vllm_url,
                       "daemon_socket": self._config.socket_path},
        }.get(policy.evaluator, {})  # fmt: skip
        # Restore and prefill times; the load times are the tiers' own (``tier_models``).
        ttft = TtftModel(prefill_tokens_per_s=self._config.prefill_tokens_per_s,
                         fit=self.prefill_fit)  # fmt: skip
        directory = Path(self._config.data_dir) / "profiler"
        evaluator = make_evaluator(policy.evaluator, options)
        evaluator.yield_gate = self.yield_gate  # its steps wait while requests are served
        self.profiler = Profiler(
            evaluator,
            ttft,
            policy=policy,
            directory=directory,
            is_busy=self._loads_busy,
        )
        self.profiler.load()
        self.version += 1
        if self.profiler.evaluator.needs_token_ids:
            logger.warning(
                "evaluator %r needs the context's token ids: only contexts whose tokens are "
                "registered (KVStore.SetContextTokens; kvtierd router does it) are profiled",
                policy.evaluator,
            )
        self._restart_drift_loop()

    def _restart_drift_loop(self) -> None:
        """Periodic re-profiling on drift (EvicPress §4.3), for the placer that uses quality."""
        if self._drift is not None:
            self._drift.cancel()
            self._drift = None
        if self.profiler is None or self._policy.current.placer != "evicpress" or not self._running:
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
        check = partial(window.check_drift, self.profiler, context_id, keys, values, ctx.variant,
                        model_dir=model_dir, variants=self._profiled_variants(ctx),
                        layout=self.layout_of(ctx))  # fmt: skip
        return await asyncio.get_running_loop().run_in_executor(self._worker, check)

    async def _reprofile(self, context_id: str) -> None:
        ctx = self._index.contexts.get(context_id)
        if ctx is not None:
            self.reprofiled += 1
            await self.profile_context(ctx)

    async def set_tokens(self, context_id: str, tokens: Sequence[int]) -> None:
        """The token ids ``context_id`` was computed from (``KVStore.SetContextTokens``): only
        for a context the daemon holds, at most its own length (only those are ever used),
        within its tenant's budget (tokens.py)."""
        ctx = self._held(context_id)
        if self.profiler is None:
            return
        kept = self._context_part(ctx, tokens)
        self.tokens.reserve(context_id, ctx.tenant, len(kept))
        profiler = self.profiler

        def store() -> None:
            self.servable.agree(context_id, profiler.queries, kept, prompt=False)
            profiler.queries.set_tokens(context_id, kept)

        await asyncio.get_running_loop().run_in_executor(self._queries, store)
        self._tokens_known(ctx)

    def note_prompt(self, tenant: str, request_id: str, tokens: Sequence[int]) -> None:
        """A request's prompt, by the id its writer will name at the put (bounded, in memory:
        the tenant's oldest are forgotten first, tokens.py)."""
        self.tokens.note_prompt(tenant, request_id, packed(tokens))

    async def link_prompt(self, context_id: str, request_id: str) -> None:
        """The prompt of ``request_id`` made (or read) ``context_id``: the context gets its
        tokens, and the tokens past the context's end are a real query of it."""
        from kvtierd.profiler import ProfilingQuery

        tokens = self.tokens.prompt(request_id)
        if tokens is None:
            raise NotFoundError(
                f"no prompt registered for request {request_id!r}: it was never registered, or "
                f"newer ones pushed it out (at most {MAX_PENDING_PROMPTS}, and "
                f"token_bytes_per_tenant of them per tenant)"
            )
        ctx = self._held(context_id)
        if self.profiler is None:
            return
        _, n, _ = self._geometry_of(ctx)
        kept = self._context_part(ctx, tokens)
        self.tokens.reserve(context_id, ctx.tenant, len(kept))
        profiler = self.profiler
        query = tokens[n:] if 0 < n < len(tokens) else ()

        def store() -> None:
            # at most the prompt less its last token: a rewrite keeps one token of suffix
            self.servable.agree(context_id, profiler.queries, tokens[: len(tokens) - 1],
                                prompt=True)  # fmt: skip
            profiler.queries.set_tokens(context_id, kept)
            if 0 < len(query) <= MAX_QUERY_TOKENS:
                # Per routed request: kept in memory, written by flush() (as record_query does)
                q = ProfilingQuery(token_ids=tuple(query))
                profiler.queries.record(context_id, q, persist=False)

        await asyncio.get_running_loop().run_in_executor(self._queries, store)
        self._tokens_known(ctx)
        self._recheck(context_id)

    def _tokens_known(self, ctx: ContextRecord) -> None:
        """Token ids arrived: when they made a token-dropped variant servable, the placer sees
        the context's options again (not on every routed request: most change nothing)."""
        if ctx.context_id not in self._index.contexts or ctx.durable_held:
            return
        before = self.servable.why.get(ctx.context_id)
        self._servable(ctx, self.variants())  # refreshes why
        if before and before != self.servable.why.get(ctx.context_id):
            self.version += 1
            self.on_profiled(ctx)

    def servable_form(self, ctx: ContextRecord, variant: str) -> ServableForm:
        """The servable form of ``variant`` with its digest, or ``InvalidArgumentError`` with
        why the daemon cannot write it (servable.py)."""
        if self.profiler is None:
            raise InvalidArgumentError("the profiler, which keeps token ids, is not configured")
        queries = self.profiler.queries
        return self.servable.form(ctx.context_id, variant, self._sources(ctx), queries)

    def _recheck(self, context_id: str) -> None:
        """A query arrived for a context whose profile is below ``min_queries`` (the
        confidence rule, ``Profiler.trusted``): profile it again once it has enough."""
        p = self.profiler
        if p is None or p.record(context_id) is None or p.trusted(context_id):
            return
        if len(p.queries.profiling_set(context_id)[1]) >= self._policy.current.min_queries:
            self._changed[context_id] = time.monotonic()

    def _held(self, context_id: str) -> ContextRecord:
        ctx = self._index.contexts.get(context_id)
        if ctx is None:
            raise NotFoundError(
                f"context {context_id!r} not found: token ids are kept only for a context the "
                "daemon holds (register them after its put)"
            )
        return ctx

    def _context_part(self, ctx: ContextRecord, tokens: Sequence[int]) -> Sequence[int]:
        """The ids a context can use: its first ``n`` tokens when its length is known."""
        _, n, _ = self._geometry_of(ctx)
        if not n:
            n = sum(self._index.objects[k].meta.token_count for k in ctx.keys)
        return tokens[:n] if 0 < n < len(tokens) else tokens

    async def add_queries(self, context_id: str, texts: list[str], from_traffic: bool) -> int:
        """Profiling queries for a context: a user's set, or samples of real traffic."""
        from kvtierd.profiler import ProfilingQuery

        if self.profiler is None:
            return 0
        queries = [ProfilingQuery(text=t) for t in texts if t]
        profiler = self.profiler

        def store() -> None:
            if from_traffic:
                for q in queries:
                    profiler.record_query(context_id, q)
            else:
                profiler.queries.add_user(context_id, queries)

        await asyncio.get_running_loop().run_in_executor(self._queries, store)
        self._recheck(context_id)
        return len(queries)

    def record(self, context_id: str) -> ProfileRecord | None:
        return None if self.profiler is None else self.profiler.record(context_id)

    def upcoming(self, context_id: str) -> tuple[str, int, int] | None:
        """What the context's next profile would run on: ``(query source, number of queries,
        token ids registered)``; None before the profiler is configured."""
        if self.profiler is None:
            return None
        queries = self.profiler.queries
        source, texts = queries.profiling_set(context_id)
        return source, len(texts), queries.known_tokens(context_id)

    def grid(self, ctx: ContextRecord) -> tuple[VariantProfile, ...]:
        """The context's variants with exact sizes and, once profiled, quality and restore:
        what the executor can make from its sources (``ContextIndex.sources``). The whole grid
        while the original is at hand (stored, or kept as a reference copy). A context kept
        only quantized (int8, no reference copy) is its own source: its form first, then the
        variants quantized the same or coarser (``index.derivable``), never the original,
        which cannot be restored. Its profile measures quality against its dequantized KV, so
        the quantization's own loss is not in it (measured lossless-equivalent for int8 on
        SmolLM2, benchmarks/RESULTS.md). A token-dropped form without a reference copy has
        only itself."""
        variants = self.variants()
        if len(variants) <= 1:  # eviction-only policy: nothing to size (the put path is hot)
            return (VariantProfile(ctx.variant, ctx.size_bytes),)
        fmt, tokens, original_bytes = self._geometry_of(ctx)
        if fmt is None:
            return (VariantProfile(ctx.variant, ctx.size_bytes),)
        profiled = self.profiled(ctx.context_id)
        own = self._index.self_sourced(ctx)
        out = [] if own else [VariantProfile(ORIGINAL_VARIANT, original_bytes)]
        for name in self._servable(ctx, variants):
            layers, heads, dim = fmt.shape[1], fmt.num_kv_heads, fmt.head_dim
            size = variant_size_bytes(
                layers, heads, dim, tokens, _dtype_bytes(fmt.dtype), name,
                chunk_tokens=count_unit(name, fmt.shape[2]),
            )  # fmt: skip
            known = profiled.get(name)
            # Unprofiled: quality 0 keeps a quality-seeking placer away until it is measured;
            # a fixed-variant placer ignores quality. A self-sourced form is what its profile
            # is measured against: 1, as the original of any other context.
            unknown = 1.0 if own and name == ctx.variant else 0.0
            quality, restore = (known.quality, known.restore_s) if known else (unknown, 0.0)
            out.append(VariantProfile(name, size, quality, restore))
        return tuple(out)

    def _servable(self, ctx: ContextRecord, variants: list[str]) -> list[str]:
        """The lossy ``variants`` the context can be stored as (servable.py); for a
        self-sourced context its own form first and those it can make (:meth:`grid`)."""
        lossy = [v for v in variants if v != ORIGINAL_VARIANT]
        if self._index.self_sourced(ctx):
            made = (v for v in lossy if self._index.can_make(ctx, v))
            lossy = list(dict.fromkeys((ctx.variant, *made)))
        if self.profiler is None:
            return lossy
        return self.servable.options(ctx.context_id, ctx.variant, lossy, self._sources(ctx),
                                     self.profiler.queries)  # fmt: skip

    def _sources(self, ctx: ContextRecord) -> list[ObjectMeta]:
        """The chunks the context's variants are made from (``ContextIndex.sources``)."""
        return [obj.meta for obj in self._index.sources(ctx)]

    def variants(self) -> list[str]:
        """The running policy's grid (cached per policy)."""
        policy = self._policy.current
        if self._variants_of is not policy:
            names = dict.fromkeys([*policy.variants, policy.fixed_variant])
            self._variants = [n for n in names if n]
            self._variants_of = policy
        return self._variants

    def _profiled_variants(self, ctx: ContextRecord) -> list[str]:
        """The grid a profile scores: the policy's, and a self-sourced context's own form (an
        option of its, which the policy's grid may not name: its quality and restore cost)."""
        own = [ctx.variant] if self._index.self_sourced(ctx) else []
        return list(dict.fromkeys([*self.variants(), *own]))

    def layout_of(self, ctx: ContextRecord) -> ProfileLayout:
        """How the context's variants are stored: in chunks of its objects' size, so the
        quality the profiler measures is that of the variant the executor will write."""
        from kvtierd.profiler import ProfileLayout

        fmt, _, _ = self._geometry_of(ctx)
        return ProfileLayout(chunk_tokens=fmt.shape[2]) if fmt is not None else ProfileLayout()

    def _geometry_of(self, ctx: ContextRecord) -> tuple[ChunkFormat | None, int, int]:
        """Chunk format, token count and bytes of the context's original (of its sources:
        quantized chunks count as the original they dequantize to); cached until the
        context gains objects or changes form (a put of chunk k would otherwise re-parse the
        k layouts before it). The stamp is read off the record, not off :meth:`_sources`:
        listing the sources to check the cache is itself a pass over the context's keys."""
        stamp = (ctx.variant, len(ctx.keys), len(ctx.reference or ()))
        cached = self._geometry_cache.get(ctx.context_id)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        value = self._geometry(self._sources(ctx))
        self._geometry_cache[ctx.context_id] = (stamp, value)
        return value

    def _geometry(self, metas: list[ObjectMeta]) -> tuple[ChunkFormat | None, int, int]:
        """Chunk format, tokens and original bytes; a chunk stored quantized counts with the
        bytes its original would have."""
        tokens, nbytes, fmt = 0, 0, None
        for meta in metas:
            try:
                fmt = ChunkFormat.parse(meta.layout)
            except CorruptObjectError:
                return None, 0, 0
            tokens += fmt.shape[2]
            dense = math.prod(fmt.shape) * _dtype_bytes(fmt.dtype)
            nbytes += dense if fmt.quant else meta.size_bytes
        return fmt, tokens, nbytes

    def profiled(self, context_id: str) -> dict[str, VariantProfile]:
        """The context's profiled variants, as far as they may move it: none while its profile
        is below ``min_queries`` (it then keeps the original, as an unprofiled context)."""
        if self.profiler is None or not self.profiler.trusted(context_id):
            return {}
        try:
            profile = self.profiler.profile_of(context_id)
        except KeyError:
            return {}
        return {v.variant: v for v in profile.variants}

    def prefill_s(self, ctx: ContextRecord) -> float:
        """Seconds to recompute the context when dropped: profiled; else from its token count
        (chunk layouts, or the objects' ``token_count``); else :data:`UNKNOWN_PREFILL_S` — an
        object whose tokens nobody told us cannot be assumed cheap to recompute (with 0, a
        quality-seeking placer would rate dropping it as good as storing it)."""
        if self.profiler is None:
            return UNKNOWN_PREFILL_S
        _, tokens, _ = self._geometry_of(ctx)
        if not tokens:
            tokens = sum(self._index.objects[k].meta.token_count for k in ctx.keys)
        if tokens:  # at today's prefill speed, which served requests may have taught since
            return self.profiler.ttft.prefill_s(tokens)
        with contextlib.suppress(KeyError):
            return self.profiler.profile_of(ctx.context_id).prefill_s
        return UNKNOWN_PREFILL_S

    def observe_served(self, prompt_tokens: int, cached_tokens: int, ttft_s: float) -> bool:
        """A served request's timing (the router's ``KVStore.ReportServed``): a prefill sample
        when vLLM computed most of its prompt (``prefill_fit.py``)."""
        return self.prefill_fit.observe(prompt_tokens, cached_tokens, ttft_s)

    def prefill_tokens_per_s(self) -> float:
        """The prefill speed recomputes are priced at: learned, else configured."""
        learned = self.prefill_fit.estimate()
        return learned.tokens_per_s if learned else self._config.prefill_tokens_per_s

    def prefill_tokens_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens (:data:`UNKNOWN_PREFILL_S` when not known)."""
        if self.profiler is None or tokens <= 0:
            return UNKNOWN_PREFILL_S
        return self.profiler.ttft.prefill_s(tokens)

    def frequency(self, context_id: str) -> float | None:
        if self.profiler is None:
            return None
        f = self.profiler.frequency.frequency(context_id, time.time())
        return f if f > 0 else None

    # -- work --------------------------------------------------------------------------------

    def note_change(self, ctx: ContextRecord) -> None:
        """A put changed the context: profile it once it settles, unless a trusted profile of
        it at this length is kept from before it was dropped (``Profiler.set_aside``)."""
        p = self.profiler
        if p is not None and self._running and p.is_set_aside(ctx.context_id):
            self._worker.submit(p.returned, ctx.context_id)  # not per put: a put is hot
        # (the original is not asked _unchoosable here: that parses its layouts, on every put)
        sourced = ctx.variant == ORIGINAL_VARIANT or (
            self._index.self_sourced(ctx) and not self._unchoosable(ctx)
        )
        if sourced and not self._kept_profile(ctx):
            self._changed[ctx.context_id] = time.monotonic()

    def _unchoosable(self, ctx: ContextRecord) -> str:
        """Why a profile of the context would have nothing to choose between (``""``: it
        would). A self-sourced form (int8 only) is profiled against its dequantized KV
        (:meth:`grid`) when the policy names a variant that can be made from it."""
        if self._geometry_of(ctx)[0] is None:  # a token-dropped form, no reference copy
            return "its original is not kept"
        own = self._index.self_sourced(ctx)
        if own and not any(v != ctx.variant and self._index.can_make(ctx, v)
                           for v in self.variants()):  # fmt: skip
            return "its original is not kept, and the policy names no variant made from it"
        return ""

    def _kept_profile(self, ctx: ContextRecord) -> bool:
        p = self.profiler
        record = None if p is None else p.record(ctx.context_id)
        if p is None or record is None or not p.trusted(ctx.context_id):
            return False
        return record.num_tokens == self._geometry_of(ctx)[1]

    def note_form(self) -> None:
        """A context was compressed or restored."""
        self.version += 1

    def forget(self, context_id: str) -> None:
        """A context's bytes are gone: drop its token ids; its profile, frequency and queries
        are set aside for when its prompt is computed and stored again (Profiler.set_aside)."""
        self.version += 1
        self.tokens.forget(context_id)
        self.servable.forget(context_id)
        self._geometry_cache.pop(context_id, None)
        self._changed.pop(context_id, None)
        if self.profiler is not None and self._running:
            # ids on the thread that registers them, so that a returning prompt's stay
            self._queries.submit(self.profiler.queries.drop_tokens, context_id)
            self._worker.submit(self.profiler.set_aside, context_id)

    def note_access(self, context_id: str) -> None:
        if self.profiler is not None:
            self.profiler.record_access(context_id)

    def start(self) -> None:
        if self.profiler is not None:  # ids an earlier run kept count against their tenant
            for ctx in self._index.contexts.values():
                count = self.profiler.queries.known_tokens(ctx.context_id)
                self.tokens.known(ctx.context_id, ctx.tenant, count)
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
        if self.profiler is not None:
            self.profiler.flush()
        self._worker.shutdown(wait=True)
        self._queries.shutdown(wait=True)

    @property
    def healthy(self) -> bool:
        return all(t is None or not t.done() for t in (self._task, self._drift))

    async def _run_forever(self, period_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            ready = [c for c, t in self._changed.items() if now - t >= self.settle_s]
            if self._policy.current.placer != "evicpress":
                self._changed.clear()  # only EvicPress weighs quality; sizes need no profile
                continue
            for cid in ready:
                if self._loads_busy():
                    break  # profiling yields to loads (EvicPress §4.3: only when idle)
                self._changed.pop(cid, None)
                ctx = self._index.contexts.get(cid)
                if ctx is not None:
                    await self.profile_context(ctx)

    async def profile_context(
        self, ctx: ContextRecord, queries: tuple[ProfilingQuery, ...] = ()
    ) -> bool:
        """Profile now; a failure is counted, logged and reported, never raised to the loop."""
        if self.profiler is None:
            raise UnavailableError("the profiler is not configured (the daemon is starting)")
        why = self._unchoosable(ctx)
        if why:
            logger.info("context %s: not profiled: it is stored only as %r, %s", ctx.context_id,
                        ctx.variant, why)  # fmt: skip
            return False
        started = time.perf_counter()
        waited_before = self.yield_gate.waited_s
        evaluator = self.profiler.evaluator
        try:
            keys, values = await self._mover.context_tensors(ctx)
            n = int(keys.shape[2])
            if evaluator.needs_token_ids and not self.profiler.queries.tokens(ctx.context_id, n):
                return self._failed(ctx, started, NO_TOKEN_IDS.format(name=evaluator.name))
            run = partial(window.profile, self.profiler, self._policy.current.evaluator_model_dir,
                          ctx.context_id, keys, values, queries=queries,
                          variants=self._profiled_variants(ctx),
                          layout=self.layout_of(ctx))  # fmt: skip
            await asyncio.get_running_loop().run_in_executor(self._worker, run)
        except KvtierError as e:
            return self._failed(ctx, started, str(e))
        self.runs["ok"] += 1
        self.version += 1
        elapsed = time.perf_counter() - started
        self._metrics.observe_profile_run(elapsed, ok=True)
        waited = self.yield_gate.waited_s - waited_before
        logger.info("context %s: profiled in %.1f s, of which %.1f s waiting for requests to "
                    "be served", ctx.context_id, elapsed, waited)  # fmt: skip
        if ctx.context_id in self._index.contexts and not ctx.durable_held:
            # (a context held for its unread durable objects is placed again once read)
            try:
                self.on_profiled(ctx)
            except CapacityError as e:  # its best place is full of pinned or held contexts
                logger.warning("context %s: profiled, and stays where it is: %s",
                               ctx.context_id, e)  # fmt: skip
        return True

    def _failed(self, ctx: ContextRecord, started: float, reason: str) -> bool:
        self.runs["failed"] += 1
        self.last_error = f"{ctx.context_id}: {reason}"
        self._metrics.observe_profile_run(time.perf_counter() - started, ok=False)
        logger.error("profiling %r failed: %s", ctx.context_id, reason)
        return False


def _dtype_bytes(name: str) -> int:
    return int(DTYPE_BYTES.get(name, 2))  # a layout's dtype is not validated: 16-bit if unknown
