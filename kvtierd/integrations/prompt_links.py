"""Tell the daemon which context a registered prompt made or read (``link_prompt``).

``kvtierd router`` registers each real-traffic prompt with the daemon under a request id and
tags the request with it (``lmcache.tag.kvtierd_request``, ``router/prompts.py``). The daemon
then needs the context the prompt's chunks belong to: it keeps the prompt's tokens as the
context's (the ``served`` evaluator profiles with them) and records the tokens past the
context's end as a real query of it (drift detection, profiling queries).

**Which context.** The daemon splits the prompt at the context's length, so the context must
start at the prompt's first token. The one that does is the context holding the prompt's first
chunk (a chunk key hashes its whole prefix: the first chunk of a prompt is the first chunk of
any context holding it). The request's lookup, which always covers the prompt from token 0,
gives that chunk's key; its context is known once the plugin has stored or loaded it
(``ContextLinks``). So a request is linked at its lookup when that context is already known
(the usual case for a hot context, whose KV vLLM serves from its own prefix cache: there is
no load and often no put), else at its load, else at its put — once per request and context.

Links run on a thread of their own: a link never holds up a lookup, load or put, and a daemon
that is busy profiling (its profiler thread also records links) cannot starve LMCache's calls
of the plugin's threads — the profiler's own requests go through this vLLM. A failed link is
logged and counted (``PluginStats.prompt_link_errors``), never raised (``lmcache_plugin``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtierd.integrations.plugin_settings import PROMPT_TAG, is_rewritten, tag

if TYPE_CHECKING:
    from kvtierd.client import KVClient
    from kvtierd.integrations.plugin_settings import PluginStats
    from kvtierd.integrations.put_decision import ContextLinks

logger = logging.getLogger(__name__)


class PromptLinks:
    """Per tagged request: its first chunk key (from its lookup) and the contexts it was
    linked to. Bounded (oldest requests first out) and thread-safe."""

    def __init__(
        self,
        client: KVClient,
        contexts: ContextLinks,
        stats: PluginStats,
        lock: threading.Lock,
        capacity: int = 4096,
    ) -> None:
        self.client = client
        self.contexts = contexts
        self.stats = stats
        self.capacity = capacity
        self._stats_lock = lock
        self._first: OrderedDict[str, str] = OrderedDict()  # request id -> its first chunk key
        self._linked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-prompt-links")

    @staticmethod
    def request_of(key: Any) -> str:
        """The registered request id a key's request carries, ``""`` for none. A rewritten
        request (placeholder ids) and a profiling one (a scope) are never linked: neither is a
        real prompt of the context it reads (the router links a rewritten request's real
        prompt to the variant's source context itself)."""
        if is_rewritten(key) or tag(key, "kvtierd_scope"):
            return ""
        return tag(key, PROMPT_TAG)

    def looked_up(self, key: Any, first_chunk: str) -> None:
        """A lookup of the request's prompt, whose first chunk key is ``first_chunk``."""
        request = self.request_of(key)
        if request:
            with self._lock:
                self._first[request] = first_chunk
                self._first.move_to_end(request)
                while len(self._first) > self.capacity:
                    self._first.popitem(last=False)
            self.report(key)

    def report(self, key: Any) -> None:
        """Link the request of ``key`` to the context of its first chunk, if known and not
        linked yet (after its lookup, load and put)."""
        request = self.request_of(key)
        if not request:
            return
        with self._lock:
            first = self._first.get(request)
        context = self.contexts.context_of(first) if first is not None else ""
        if not context:
            return
        with self._lock:
            if (request, context) in self._linked:
                return
            self._linked[(request, context)] = None
            while len(self._linked) > self.capacity:
                self._linked.popitem(last=False)
        self._worker.submit(self._link, context, request)

    def _link(self, context: str, request: str) -> None:
        try:
            self.client.link_prompt(context, request)
        except Exception as e:  # never raised into LMCache (lmcache_plugin)
            with self._stats_lock:
                self.stats.prompt_link_errors += 1
                self.stats.last_error = f"link_prompt: {type(e).__name__}: {e}"
            logger.warning(
                "kvtierd plugin: could not tell the daemon that request %s read context %s "
                "(%s: %s); the request is unaffected", request, context, type(e).__name__, e,
            )  # fmt: skip
            return
        with self._stats_lock:
            self.stats.prompt_links += 1

    def close(self, wait: bool = False) -> None:
        self._worker.shutdown(wait=wait)
