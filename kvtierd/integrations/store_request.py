"""A ``kvtierd router`` store request as the LMCache plugin sees it, and its context's chunks.

The router asks for a request's first ``N`` tokens to be stored as a token-dropped variant by
tagging it (``lmcache.tag.kvtierd_context``, ``kvtierd_context_tokens``, ``kvtierd_variant``).
LMCache hands the plugin's put only the chunks it does not hold: when the daemon already holds
the context's first ``k`` chunks the put starts at chunk ``k``, and when it holds all of them
there may be no put at all. So the plugin

1. at the request's lookup, which always covers the prompt from token 0, remembers the chunk
   keys of the context (:class:`ContextChunks`) and reports at most ``N / chunk - 1`` of them
   as stored (:meth:`ContextChunks.looked_up`): vLLM recomputes the context's last chunk and
   LMCache puts it, so every store request has a put, carrying the tags;
2. at the put, finds where the put starts among the context's chunks and builds the variant from
   the chunks before it, read back from the daemon, followed by the put's own
   (``placeholder_store.context_kv``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.integrations.plugin_settings import is_rewritten, salt_prefix, tag
from kvtierd.variants import parse_variant


@dataclass(frozen=True, slots=True)
class StoreRequest:
    """Store the first ``num_tokens`` tokens of the request as ``variant`` under the context
    identity ``digest`` (``kvtierd.router_protocol.context_digest``, which folds ``scope`` in;
    ``""``: production). ``key_prefix``: the request's salt (``plugin_settings.salt_prefix``),
    which every key and context id of the variant begins with."""

    digest: str
    variant: str
    num_tokens: int
    scope: str = ""
    window_ids: tuple[int, ...] = ()  # snapkv: the context's last window of token ids
    key_prefix: str = ""

    @property
    def context_id(self) -> str:
        """The daemon context of the context's original chunks: its digest, within its salt
        (two salts' stores of the same tokens are two contexts, as their chunks are)."""
        return self.key_prefix + self.digest

    @property
    def manifest_variant(self) -> str:
        """The variant the manifest key names: none in production (one manifest per context),
        the variant in a scope (one per (context, variant), ``placeholder.manifest_key``)."""
        return self.variant if self.scope else ""

    @classmethod
    def of(cls, key: Any) -> StoreRequest | None:
        """The store request a key's tags make, or ``None`` for any other request (also a
        rewritten placeholder request, which names its context and variant too). A variant that
        does not parse is left to the put, which reports it."""
        digest = tag(key, "kvtierd_context")
        tokens = tag(key, "kvtierd_context_tokens")
        variant = tag(key, "kvtierd_variant")
        if not (digest and tokens and variant) or is_rewritten(key):
            return None
        try:
            if not parse_variant(variant).drops_tokens:
                return None
            count = int(tokens)
            window = tuple(int(t) for t in tag(key, "kvtierd_window").split())
            prefix = salt_prefix(key)  # a forged salt: refused (InvalidArgumentError)
        except ValueError:
            return None
        return cls(digest, variant, count, tag(key, "kvtierd_scope"), window, prefix)


class ContextChunks:
    """The chunk keys of the contexts of recent store requests, from their lookups (module
    docstring), by the request's ``context_id``. Bounded (least recently looked up first out)
    and thread-safe: lookups and puts run on different LMCache threads. Requests for the same
    context id have the same chunk keys."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._chunks: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def looked_up(
        self, request: StoreRequest, names: Sequence[str], hits: int, chunk_tokens: int
    ) -> int:
        """Remember the context's chunk keys among a lookup's ``names`` and return the prefix
        hits to report: fewer than the context's chunks, so that a put carries its last one."""
        count = request.num_tokens // chunk_tokens
        if request.num_tokens % chunk_tokens or not 0 < count <= len(names):
            return hits  # not a whole-chunk context within the prompt: the put refuses it
        with self._lock:
            self._chunks[request.context_id] = tuple(names[:count])
            self._chunks.move_to_end(request.context_id)
            while len(self._chunks) > self.capacity:
                self._chunks.popitem(last=False)
        return min(hits, count - 1)

    def get(self, context_id: str) -> tuple[str, ...] | None:
        with self._lock:
            return self._chunks.get(context_id)
