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
"""Prompts registered by request id (kvtierd router) and not yet linked to a context: the
oldest are forgotten beyond this many (a link then fails with NOT_FOUND)."""
TOKEN_BYTES = 4  # a token id as kept: uint32


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
        self._prompts: OrderedDict[str, tuple[str, array[int]]] = OrderedDict()
        self._prompt_bytes: Counter[str] = Counter()
        self._contexts: dict[str, tuple[str, int]] = {}  # context id -> (tenant, ids kept)
        self._context_bytes: Counter[str] = Counter()

    # -- prompts by request id ---------------------------------------------------------------

    def note_prompt(self, tenant: str, request_id: str, tokens: array[int]) -> None:
        """Keep a prompt until linked; the tenant's oldest go first beyond its budget."""
        nbytes = len(tokens) * TOKEN_BYTES
        if nbytes > self.bytes_per_tenant:
            raise CapacityError(
                f"a prompt of {len(tokens)} token ids ({nbytes} bytes) is larger than the "
                f"{self.bytes_per_tenant} bytes of prompts a tenant may register"
            )
        self._drop_prompt(request_id)
        self._prompts[request_id] = (tenant, tokens)
        self._prompt_bytes[tenant] += nbytes
        while self._prompt_bytes[tenant] > self.bytes_per_tenant:
            oldest = next(r for r, (t, _) in self._prompts.items() if t == tenant)
            self._drop_prompt(oldest)
        while len(self._prompts) > MAX_PENDING_PROMPTS:
            self._drop_prompt(next(iter(self._prompts)))

    def prompt(self, request_id: str) -> array[int] | None:
        entry = self._prompts.get(request_id)
        return None if entry is None else entry[1]

    def _drop_prompt(self, request_id: str) -> None:
        entry = self._prompts.pop(request_id, None)
        if entry is not None:
            self._prompt_bytes[entry[0]] -= len(entry[1]) * TOKEN_BYTES

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
