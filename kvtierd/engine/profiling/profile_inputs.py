"""What profiles are made from, as it reaches the daemon: the token ids a context was computed
from (``KVStore.SetContextTokens``), the prompts kvtierd router registers and the plugin links
to the context they stored or read (their tokens past the context are real queries of it),
and profiling queries (``KVStore.AddQueries``). They are recorded on a thread of their own,
never queued behind a profile, which through the serving stack takes seconds to minutes (the
router gave links up after 10 s).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.servable import Servability
from kvtierd.engine.state import ContextRecord, RunningPolicy
from kvtierd.engine.tokens import MAX_PENDING_PROMPTS, MAX_QUERY_TOKENS, TokenBudget, packed
from kvtierd.errors import NotFoundError

if TYPE_CHECKING:
    from kvtierd.profiler import Profiler


class ProfileInputs:
    """Token ids and queries of the contexts of ``index``, kept by the current ``profiler()``
    (``None`` before it is configured) within ``tokens``' per-tenant budgets. A context whose
    new token ids made a token-dropped variant servable goes to ``place_again``; one whose
    profile is below ``min_queries`` and now has enough queries, to ``profile_again``."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        options: ContextOptions,
        servable: Servability,
        tokens: TokenBudget,
        policy: RunningPolicy,
        profiler: Callable[[], Profiler | None],
        place_again: Callable[[ContextRecord], None],
        profile_again: Callable[[str], None],
    ) -> None:
        self._index = index
        self._options = options
        self._servable = servable
        self._tokens = tokens
        self._policy = policy
        self._profiler = profiler
        self._place_again = place_again
        self._profile_again = profile_again
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-queries")
        self._gone: OrderedDict[str, int] = OrderedDict()  # set-aside contexts' token counts

    async def set_tokens(self, context_id: str, tokens: Sequence[int]) -> None:
        """The token ids ``context_id`` was computed from (``KVStore.SetContextTokens``): only
        for a context the daemon holds, at most its own length (only those are ever used),
        within its tenant's budget (tokens.py)."""
        ctx = self._held(context_id)
        profiler = self._profiler()
        if profiler is None:
            return
        kept = self._context_part(ctx, tokens)
        self._tokens.reserve(context_id, ctx.tenant, len(kept))

        def store() -> None:
            self._servable.agree(context_id, profiler.queries, kept, prompt=False)
            profiler.queries.set_tokens(context_id, kept)

        await asyncio.get_running_loop().run_in_executor(self._thread, store)
        self._tokens_known(ctx)

    def note_prompt(self, tenant: str, request_id: str, tokens: Sequence[int]) -> None:
        """A request's prompt, by the id its writer will name at the put (bounded, in memory:
        the tenant's oldest are forgotten first, tokens.py)."""
        self._tokens.note_prompt(tenant, request_id, packed(tokens))

    async def link_prompt(self, context_id: str, request_id: str) -> None:
        """The prompt of ``request_id`` made (or read) ``context_id``: the context gets its
        tokens, and the tokens past the context's end are a real query of it."""
        from kvtierd.profiler import ProfilingQuery

        tokens = self._tokens.prompt(request_id)
        if tokens is None:
            raise NotFoundError(
                f"no prompt registered for request {request_id!r}: it was never registered, or "
                f"newer ones pushed it out (at most {MAX_PENDING_PROMPTS} per tenant, and "
                f"token_bytes_per_tenant of them)"
            )
        if self.set_aside_tokens(context_id):
            await self._link_set_aside(context_id, tokens)
            return
        ctx = self._held(context_id)
        profiler = self._profiler()
        if profiler is None:
            return
        # A prompt starts at token 0; a child context's own tokens start after its
        # ancestors' (issue 29), and its query after its own end.
        above = self._ancestor_tokens(ctx)
        _, n, _ = self._options.geometry_of(ctx)
        kept = self._context_part(ctx, tokens[above:])
        self._tokens.reserve(context_id, ctx.tenant, len(kept))
        query = tokens[above + n :] if n > 0 and above + n < len(tokens) else ()

        def store() -> None:
            # at most the prompt less its last token: a rewrite keeps one token of suffix
            self._servable.agree(context_id, profiler.queries, tokens[: len(tokens) - 1],
                                 prompt=True)  # fmt: skip
            profiler.queries.set_tokens(context_id, kept)
            if 0 < len(query) <= MAX_QUERY_TOKENS:
                # Per routed request: kept in memory, written by flush() (as record_query does)
                q = ProfilingQuery(token_ids=tuple(query))
                profiler.queries.record(context_id, q, persist=False)

        await asyncio.get_running_loop().run_in_executor(self._thread, store)
        self._tokens_known(ctx)
        self.recheck(context_id)

    async def _link_set_aside(self, context_id: str, tokens: Sequence[int]) -> None:
        """A prompt linked to a context dropped since its put (the placer may drop a context as
        it arrives, before the plugin links the request that stored it): the tokens past the
        context are a query of it, kept with its profile and frequency for when it returns.
        Without this a context the placer keeps dropping is profiled, each time it returns, on
        too few queries to be trusted. Its token ids are not kept: they come back with it."""
        from kvtierd.profiler import ProfilingQuery

        profiler = self._profiler()
        query = tokens[self._gone[context_id] :]
        if profiler is None or not 0 < len(query) <= MAX_QUERY_TOKENS:
            return
        q = ProfilingQuery(token_ids=tuple(query))
        record = partial(profiler.queries.record, context_id, q, persist=False)
        await asyncio.get_running_loop().run_in_executor(self._thread, record)

    def _tokens_known(self, ctx: ContextRecord) -> None:
        """Token ids arrived: when they made a token-dropped variant servable, the placer sees
        the context's options again (not on every routed request: most change nothing)."""
        if ctx.context_id not in self._index.contexts or ctx.durable_held:
            return
        before = self._servable.why.get(ctx.context_id)
        self._options.servable_variants(ctx, self._options.variants())  # refreshes why
        if before and before != self._servable.why.get(ctx.context_id):
            self._options.changed()
            self._place_again(ctx)

    def recheck(self, context_id: str) -> None:
        """A query arrived for a context whose profile is below ``min_queries`` (the
        confidence rule, ``Profiler.trusted``), or such a profile just finished while queries
        arrived: profile it again once it has enough."""
        p = self._profiler()
        if p is None or p.record(context_id) is None or p.trusted(context_id):
            return
        if p.enough_queries(context_id):
            self._profile_again(context_id)

    def _ancestor_tokens(self, ctx: ContextRecord) -> int:
        """The tokens of the contexts above ``ctx`` in a tree: where its own begin in a
        prompt (0 for a root)."""
        total = 0
        for cid in self._index.ancestors(ctx):
            above = self._index.contexts.get(cid)
            if above is not None:
                total += self._options.geometry_of(above)[1] or sum(
                    self._index.objects[k].meta.token_count for k in above.keys
                )
        return total

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
        _, n, _ = self._options.geometry_of(ctx)
        if not n:
            n = sum(self._index.objects[k].meta.token_count for k in ctx.keys)
        return tokens[:n] if 0 < n < len(tokens) else tokens

    def charge_queries(self, context_id: str, tenant: str, nbytes: int) -> None:
        """Count a request's query text in the tenant's budget (tokens.py) before it is kept."""
        self._tokens.charge_queries(context_id, tenant, nbytes)

    async def add_queries(self, context_id: str, texts: list[str], from_traffic: bool) -> int:
        """Profiling queries for a context: a user's set, or samples of real traffic."""
        from kvtierd.profiler import ProfilingQuery

        profiler = self._profiler()
        if profiler is None:
            return 0
        queries = [ProfilingQuery(text=t) for t in texts if t]

        def store() -> None:
            if from_traffic:
                for q in queries:
                    profiler.record_query(context_id, q)
            else:
                profiler.queries.add_user(context_id, queries)

        await asyncio.get_running_loop().run_in_executor(self._thread, store)
        self.recheck(context_id)
        return len(queries)

    def upcoming(self, context_id: str) -> tuple[str, int, int] | None:
        """What the context's next profile would run on: ``(query source, number of queries,
        token ids registered)``; None before the profiler is configured."""
        profiler = self._profiler()
        if profiler is None:
            return None
        queries = profiler.queries
        source, texts = queries.profiling_set(context_id)
        return source, len(texts), queries.known_tokens(context_id)

    # -- lifecycle -----------------------------------------------------------------------------

    def set_aside(self, context_id: str, num_tokens: int) -> None:
        """The context is gone: its ids go, on the thread that registers them, so that those
        of a prompt that brings it back stay. Its length (``num_tokens``, 0 when unknown) is
        kept for the newest ``gone_kept`` such contexts, as the profiler keeps their queries:
        a prompt linked after the context went still counts as a query of it."""
        profiler = self._profiler()
        if profiler is None:
            return
        self._thread.submit(profiler.queries.drop_tokens, context_id)
        if num_tokens:
            self._gone[context_id] = num_tokens
            self._gone.move_to_end(context_id)
            while len(self._gone) > profiler.gone_kept:
                self._gone.popitem(last=False)

    def set_aside_tokens(self, context_id: str) -> int:
        """The token count of a context set aside (:meth:`set_aside`); 0 for any other."""
        return 0 if context_id in self._index.contexts else self._gone.get(context_id, 0)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
