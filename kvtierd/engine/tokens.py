"""Bounds on the token ids clients register (``KVStore.SetContextTokens``, docs/daemon.md).

Token ids cost memory for as long as they are kept, and any tenant may send them (over TCP
too), so every registration is bounded: per request (:data:`MAX_TOKENS_PER_REQUEST`), and per
tenant in bytes (``token_bytes_per_tenant`` in the daemon config, counted at 4 bytes an id, as
they are kept): once for the prompts registered by request id and not linked yet — a cache of
recent prompts, so the tenant's oldest are forgotten to make room — and once for the token ids
kept for its contexts, where a registration beyond the budget is refused (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvtierd.errors import CapacityError, InvalidArgumentError

MAX_TOKENS_PER_REQUEST = 1 << 20
"""Token ids in one SetContextTokens request: longer than the context of any model served."""
MAX_QUERY_TOKENS = 8192
"""A prompt's tokens past its context longer than this are not kept as a profiling query."""
MAX_PENDING_PROMPTS = 4096
"""Prompts a tenant registered by request id (kvtierd router) and not yet linked to a context:
its oldest are forgotten beyond this many (a link then fails with NOT_FOUND). Per tenant: one
shared cap let one tenant push out every other's prompts (issue 27.7)."""
TOKEN_BYTES = 4  # a token id as kept: uint32
MAX_QUERY_BYTES_PER_CONTEXT = 4 << 20
"""Profiling query text (``KVStore.AddQueries``) counted for one context at most: the query
store keeps its newest (``max_user`` of them, 16 KiB each at most)."""


def check_request_tokens(n: int) -> None:
    if n > MAX_TOKENS_PER_REQUEST:
        raise InvalidArgumentError(
            f"SetContextTokens: at most {MAX_TOKENS_PER_REQUEST} token ids per request, got {n}"
        )


def packed(tokens: Sequence[int]) -> array[int]:
    """Token ids as kept in memory: 4 bytes each (a tuple of Python ints takes ~10x that)."""
    try:
        return array("I", tokens)
    except OverflowError as e:
        raise InvalidArgumentError(f"token ids are unsigned 32-bit integers: {e}") from e


class TokenBudget:
    """Per tenant: the prompts pending a link, and the token ids kept for its contexts."""

    def __init__(self, bytes_per_tenant: int) -> None:
        self.bytes_per_tenant = bytes_per_tenant
        # tenant -> request id -> ids, oldest first (request ids are scoped by their tenant)
        self._prompts: dict[str, OrderedDict[str, array[int]]] = {}
        self._prompt_bytes: Counter[str] = Counter()
        self._contexts: dict[str, tuple[str, int]] = {}  # context id -> (tenant, ids kept)
        self._context_bytes: Counter[str] = Counter()
        self._queries: dict[str, tuple[str, int]] = {}  # context id -> (tenant, query bytes)

    # -- prompts by request id ---------------------------------------------------------------

    def note_prompt(self, tenant: str, request_id: str, tokens: array[int]) -> None:
        """Keep a prompt until linked; the tenant's oldest go first beyond its budget or
        :data:`MAX_PENDING_PROMPTS` (its request id counts too: 8 MiB ids of 1-token prompts
        cost 431 MiB uncounted, issue 27.6)."""
        nbytes = _prompt_bytes(request_id, tokens)
        if nbytes > self.bytes_per_tenant:
            raise CapacityError(
                f"a prompt of {len(tokens)} token ids ({nbytes} bytes) is larger than the "
                f"{self.bytes_per_tenant} bytes of prompts a tenant may register"
            )
        self._drop_prompt(request_id)
        mine = self._prompts.setdefault(tenant, OrderedDict())
        mine[request_id] = tokens
        self._prompt_bytes[tenant] += nbytes
        while self._prompt_bytes[tenant] > self.bytes_per_tenant or len(mine) > MAX_PENDING_PROMPTS:
            self._drop_prompt(next(iter(mine)))

    def prompt(self, request_id: str) -> array[int] | None:
        for mine in self._prompts.values():
            if request_id in mine:
                return mine[request_id]
        return None

    def pending_prompts(self, tenant: str) -> int:
        return len(self._prompts.get(tenant, ()))

    def _drop_prompt(self, request_id: str) -> None:
        for tenant, mine in self._prompts.items():
            tokens = mine.pop(request_id, None)
            if tokens is not None:
                self._prompt_bytes[tenant] -= _prompt_bytes(request_id, tokens)
                return

    # -- profiling query text --------------------------------------------------------------------

    def charge_queries(self, context_id: str, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` more query text for a context (at most
        :data:`MAX_QUERY_BYTES_PER_CONTEXT` each) in its tenant's budget, or ``CapacityError``."""
        _, kept = self._queries.get(context_id, (tenant, 0))
        grow = min(kept + nbytes, MAX_QUERY_BYTES_PER_CONTEXT) - kept
        held = self._context_bytes[tenant]
        if held + grow > self.bytes_per_tenant:
            raise CapacityError(
                f"tenant {tenant!r} keeps {held} bytes of token ids and queries; {nbytes} more "
                f"bytes of queries would exceed token_bytes_per_tenant ({self.bytes_per_tenant})"
            )
        self._queries[context_id] = (tenant, kept + grow)
        self._context_bytes[tenant] += grow

    # -- token ids kept for contexts -----------------------------------------------------------

    def known(self, context_id: str, tenant: str, count: int) -> None:
        """Account ids a context already has (persisted by an earlier run)."""
        if count and context_id not in self._contexts:
            self._contexts[context_id] = (tenant, count)
            self._context_bytes[tenant] += count * TOKEN_BYTES

    def reserve(self, context_id: str, tenant: str, count: int) -> None:
        """Room for ``count`` ids of a context (the longest registration is kept), or
        ``CapacityError`` when the tenant's contexts would hold more than its budget."""
        _, kept = self._contexts.get(context_id, (tenant, 0))
        grow = max(0, count - kept) * TOKEN_BYTES
        if not grow:
            return
        held = self._context_bytes[tenant]
        if held + grow > self.bytes_per_tenant:
            raise CapacityError(
                f"tenant {tenant!r} keeps {held} bytes of context token ids; {count} more ids "
                f"for this context would exceed token_bytes_per_tenant "
                f"({self.bytes_per_tenant} bytes); contexts that go free theirs"
            )
        self._contexts[context_id] = (tenant, count)
        self._context_bytes[tenant] += grow

    def forget(self, context_id: str) -> None:
        entry = self._contexts.pop(context_id, None)
        if entry is not None:
            self._context_bytes[entry[0]] -= entry[1] * TOKEN_BYTES
        queries = self._queries.pop(context_id, None)
        if queries is not None:
            self._context_bytes[queries[0]] -= queries[1]


def _prompt_bytes(request_id: str, tokens: array[int]) -> int:
    return len(tokens) * TOKEN_BYTES + len(request_id)
