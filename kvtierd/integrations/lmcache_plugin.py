# Long because LMCache's storage-backend interface is wide; each method is a thin call.
"""LMCache storage plugin that keeps LMCache's chunks in kvtierd.

Enable it in the LMCache YAML (``configs/lmcache/kvtierd.yaml``)::

    local_cpu: false
    pre_caching_hash_algorithm: sha256_cbor
    storage_plugins: [kvtierd]
    extra_config:
      storage_plugin.kvtierd.module_path: kvtierd.integrations.lmcache_plugin
      storage_plugin.kvtierd.class_name: KvtierdStoragePlugin
      kvtierd.socket_path: /run/kvtierd/kvtierd.sock

Chunks go through the daemon's shared-memory arena. Lookups with ``pin`` hold the objects in
the daemon (``kvtierd.hold_s``) until the load. Each put (the chunks one request stores) asks
the daemon's write advice which form to store them in, unless the request's
``lmcache.tag.kvtierd_variant`` or a fixed ``kvtierd.variant`` forces one; the context the
chunks join and the form follow ``put_decision.py``. Quantized forms (int8/int4) are encoded chunk
by chunk on :attr:`KvtierdStoragePlugin.codec_device`. A ``kvtierd router`` store request of a
token-dropping variant also builds the placeholder variant of the request's context, from its
chunks whether LMCache held them (read back from the daemon) or put them: its lookup reports
the context's last chunk missing so that a put always comes (``store_request``,
``placeholder_store``). Loads decode every chunk by the layout it was stored with, whoever
compressed it (plugin or daemon). A request whose prompt ``kvtierd router`` registered with the
daemon (``lmcache.tag.kvtierd_request``) is linked to the context it stored or read, so that
the daemon learns the context's tokens and records the prompt as a real query of it
(``prompt_links``). vLLM's lookup of a prompt reports only the chunks whose load the daemon
predicts faster than prefilling them (``Lookup.decide``: load, recompute or split, logged at
DEBUG with the predicted seconds; docs/daemon.md, "Load or recompute").

**Failures never reach LMCache as exceptions.** LMCache 0.5.6 does not catch a plugin's
exceptions on the load path: one raised from a get reaches vLLM's worker and kills vLLM's
engine core (seen with a corrupt chunk). So every failure is logged here at ERROR with its
traceback, counted in ``stats`` (``errors``, ``last_error``), and answered the way LMCache expects a
failure: a lookup as a miss, a load as ``None`` for the chunk that failed and every chunk after
it (LMCache reports those blocks and vLLM's ``kv_load_failure_policy`` decides: ``fail`` fails
the request), a put as not stored. A lookup of a rewritten placeholder request
(``lmcache.tag.kvtierd_placeholder_tokens``) never reports fewer than its placeholder chunks:
a missing one then fails the load, and with it the request, instead of vLLM prefilling
placeholder ids (the router then sends the real prompt). Tests assert hits, never just
generation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvtierd.client import KVClient
from kvtierd.errors import CorruptObjectError, InvalidArgumentError, KvtierError, UnavailableError
from kvtierd.integrations.daemon_io import PutItem, lease_many, put_many
from kvtierd.integrations.daemon_link import DaemonLink
from kvtierd.integrations.placeholder_serve import PlaceholderKeys, register_model_card
from kvtierd.integrations.plugin_log import ensure_plugin_log
from kvtierd.integrations.plugin_settings import (
    ADVISED,
    PluginSettings,
    PluginStats,
    is_rewritten,
    key_string,
    placeholder_chunks,
    salt_prefix,
    tag,
)
from kvtierd.integrations.prompt_links import PromptLinks
from kvtierd.integrations.put_decision import ContextLinks, PutDecision, decide
from kvtierd.integrations.store_request import ContextChunks, StoreRequest
from kvtierd.kernels.chunk_codec import ChunkFormat, chunk_format, decode_chunk, encode_chunk
from kvtierd.variants import parse_variant

logger = logging.getLogger(__name__)
NOTED_CONTEXTS = 4096


class KvtierdStoragePlugin(StoragePluginInterface):  # type: ignore[misc]
    """LMCache ``StoragePluginInterface`` backed by a kvtierd daemon (module docstring)."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(dst_device, config, metadata, local_cpu_backend, loop)
        self.settings = PluginSettings.from_extra_config(dict(config.extra_config or {}))
        self.num_kv_heads = int(metadata.kv_shape[3])
        self.chunk_tokens = int(metadata.kv_shape[2])
        # LMCache's chunk [2, L, T, H*D] (kv_shape is (L, 2, T, H, D)); it stores full chunks only
        layers, _, tokens, heads, head_dim = (int(x) for x in metadata.kv_shape)
        self.chunk_shape = (2, layers, tokens, heads * head_dim)
        self.stats = PluginStats()
        self.links = ContextLinks()
        self.context_chunks = ContextChunks()
        self.codec_device = codec_device()
        # Contexts whose write advice was only partly applied, logged once each (the most recent).
        self._noted: OrderedDict[str, None] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtierd-plugin")
        self._lock = threading.Lock()
        self.client = KVClient(self.settings.socket_path, timeout_s=self.settings.timeout_s)
        self.prompts = PromptLinks(self.client, self.links, self.stats, self._lock)
        self.placeholders = PlaceholderKeys(self)
        self._model_name = str(metadata.model_name)
        ensure_plugin_log()  # its INFO lines in vLLM's log (plugin_log)
        # The daemon may start after vLLM, or restart under it: never required (daemon_link).
        self.link = DaemonLink(self.client, self._connected)
        self.link.connect()
        logger.info(
            "kvtierd plugin: daemon %s at %s (variant %s; int8/int4 chunks are encoded and "
            "decoded on %s with the %s kernels)",
            self.link.version or "(not reachable yet)",
            self.settings.socket_path,
            self.settings.variant,
            self.codec_device,
            "Triton" if self.codec_device.type == "cuda" else "torch reference",
        )

    def _connected(self) -> None:
        """Run on every (re)connection: a new daemon does not know the model card yet."""
        try:  # the daemon's own token-dropped variants need it; serving does not
            register_model_card(self.client, self._model_name)
        except Exception as e:
            self._failed("model card", e)

    # -- failures are loud, and answered, never raised (module docstring) ----------------------

    def _failed(self, op: str, e: BaseException) -> None:
        if isinstance(e, UnavailableError):  # the daemon is gone: one WARNING per outage
            with self._lock:
                self.stats.unreachable += 1
            self.link.lost(e)
            return
        with self._lock:
            self.stats.errors += 1
            self.stats.last_error = f"{op}: {type(e).__name__}: {e}"
        logger.error("kvtierd plugin: %s failed", op, exc_info=e)

    def _offline(self, what: str) -> bool:
        """Whether the daemon is unreachable now (counted per ``what``: a probe brings it
        back, ``daemon_link``): the call is answered as without a cache."""
        if self.link.up:
            return False
        with self._lock:
            self.stats.offline[what] = self.stats.offline.get(what, 0) + 1
        return True

    def _report_prompt(self, key: Any, looked_up: bool = False) -> None:
        """Link a registered prompt to its context (``prompt_links``); ``looked_up``: at its
        lookup (``key``: the prompt's first chunk's)."""
        try:
            if looked_up:
                self.prompts.looked_up(key, key_string(key))
            else:
                self.prompts.report(key)
        except Exception as e:
            self._failed("prompt link", e)

    # -- lookups ------------------------------------------------------------------------------

    def _prefix_hits(self, keys: Sequence[Any], pin: bool, prompt: bool = False) -> int:
        """Stored chunks from the first key on; a placeholder request's placeholder chunks
        count as stored even when they are not, so that their load fails closed. ``prompt``:
        a lookup of a whole prompt (LMCache's, from token 0), not of one chunk."""
        claimed = min(len(keys), placeholder_chunks(keys[0], self.chunk_tokens)) if keys else 0
        try:
            if self._offline("lookups"):
                return claimed  # a placeholder request's load then fails, as documented
            hold = self.settings.hold_s if pin else 0.0
            names = self.placeholders.translate(keys, [key_string(k) for k in keys])
            store = StoreRequest.of(keys[0]) if keys else None
            # vLLM's lookup (pinned, the whole prompt) asks whether to load or recompute; a
            # placeholder or store request must load what it finds (module docstring).
            decide = pin and prompt and not claimed and store is None
            found = self.client.lookup(names, hold_s=hold, decide=decide, request=prompt)
            hits = found.prefix_hits
            if store is not None:  # its put must carry the context's last chunk
                hits = self.context_chunks.looked_up(store, names, hits, self.chunk_tokens)
            self.links.looked_up(names, hits)
            if decide and found.decision:
                logger.debug("kvtierd plugin: lookup %s: %s", found.decision, found.reason)
                hits = found.load_chunks
        except Exception as e:
            self._failed("lookup", e)
            hits = 0
        if prompt and keys:
            self._report_prompt(keys[0], looked_up=True)
        with self._lock:
            self.stats.lookups += 1
            self.stats.hit_chunks += hits
        if hits < claimed:
            logger.error(
                "kvtierd plugin: %d of %d placeholder chunks found; reporting all so that the "
                "load fails and vLLM fails the request instead of prefilling placeholder ids",
                hits, claimed,
            )  # fmt: skip
            with self._lock:
                self.stats.claimed_chunks += claimed - hits
            return claimed
        return hits

    def contains(self, key: Any, pin: bool = False) -> bool:
        return self._prefix_hits([key], pin) == 1

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        return self._prefix_hits(keys, pin, prompt=True)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: Any) -> bool:
        return False  # puts complete before batched_submit_put_task returns

    def pin(self, key: Any) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: Any) -> bool:
        return True  # the daemon's hold expires on its own (kvtierd.hold_s)

    # -- puts ---------------------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> None:
        # LMCache drops its reference to ``objs`` when this returns: store synchronously.
        # A chunk not stored is logged: LMCache's own "Stored N out of total M tokens" line,
        # which follows, counts it anyway.
        try:
            if self._offline("puts"):
                self._not_stored(len(keys))
            else:
                self._put(keys, objs)
        except UnavailableError as e:  # the put that found the outage: dropped like the rest
            self._failed("put", e)
            self._not_stored(len(keys))
        except Exception as e:
            # not stored: a later request recomputes these chunks
            self._failed(f"put of {len(keys)} chunks (NOT stored; LMCache's 'Stored' line "
                         "counts them anyway)", e)  # fmt: skip
        if keys:
            self._report_prompt(keys[0])
        if on_complete_callback is not None:
            for key in keys:
                on_complete_callback(key)

    def _not_stored(self, chunks: int) -> None:
        """A put dropped while the daemon does not answer: one INFO line, and counted for the
        outage's end (``daemon_link``)."""
        logger.info("kvtierd plugin: %d chunks NOT stored: kvtierd is unreachable (LMCache's "
                    "'Stored' line counts them anyway)", chunks)  # fmt: skip
        self.link.dropped(chunks)

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    def _put(self, keys: Sequence[Any], objs: list[Any]) -> None:
        if not keys:
            return
        names = self.placeholders.translate(keys, [key_string(k) for k in keys])
        # LMCache re-puts chunks it already stored (e.g. when a request finishes): skip them.
        present = self.client.lookup(names).found
        todo = [(n, o.tensor) for n, o, found in zip(names, objs, present, strict=True)
                if not found]  # fmt: skip
        forced = tag(keys[0], "kvtierd_variant") or (
            "" if self.settings.variant == ADVISED else self.settings.variant
        )
        rewritten = is_rewritten(keys[0])
        # A scoped store (profiling) writes only its variant: the put's chunks keep their
        # LMCache keys, which production prompts load (router_protocol: scopes).
        if todo and not tag(keys[0], "kvtierd_scope"):
            decision = self._decide(keys[0], names, present.index(False), forced, todo)
            self._store(todo, decision)
        if forced and parse_variant(forced).drops_tokens and not rewritten:
            from kvtierd.integrations.placeholder_store import store_placeholder_variant

            request = StoreRequest.of(keys[0])
            if request is None:
                raise InvalidArgumentError(
                    f"variant {forced!r} drops tokens but the request is not a store request "
                    "of `kvtierd router` (lmcache.tag.kvtierd_context, kvtierd_context_tokens "
                    "and kvtierd_variant)"
                )
            store_placeholder_variant(self, request, names, objs)

    def _decide(
        self,
        key: Any,
        names: list[str],
        start: int,
        forced: str,
        chunks: list[tuple[str, torch.Tensor]],
    ) -> PutDecision:
        """One write advice (a ``KVStore.Advise`` call) per put: the context and form of its
        chunks (``put_decision.py``); ``names[start]`` is the first chunk not stored yet."""
        # A rewritten request's new chunks follow its placeholder chunks: they continue the
        # placeholder variant's context, not the original one the tag names.
        rewritten = is_rewritten(key)
        named = "" if rewritten else tag(key, "kvtierd_context")
        if named:  # a router store request's context, within the request's salt
            named = salt_prefix(key) + named
        continued = self.links.continued(names, start) if rewritten else ""
        proposed = named or continued or names[start]
        # The daemon says which context the put joins, from the chunk before it (issue 29).
        after = "" if named or continued else self.links.previous(names, start)
        tokens = sum(int(kv.shape[2]) for _, kv in chunks)
        size = sum(kv.numel() * kv.element_size() for _, kv in chunks)
        answer = self.client.advise(proposed, tokens, size, after_key=after)
        base = answer.context_id or proposed
        decision = decide(base, forced, answer, rewritten=rewritten)
        with self._lock:
            self.stats.continued_puts += bool(continued) or base != proposed
            self.stats.branched_puts += bool(decision.parent) and base == proposed
            self.stats.advised_puts += decision.advised
            first_note = decision.note and base not in self._noted
            if first_note:
                self._noted[base] = None
                if len(self._noted) > NOTED_CONTEXTS:
                    self._noted.popitem(last=False)
        if first_note:
            logger.warning("kvtierd plugin: context %s: %s", base, decision.note)
        return decision

    def _store(self, chunks: list[tuple[str, torch.Tensor]], decision: PutDecision) -> None:
        items = []
        for name, kv in chunks:
            fmt = chunk_format(kv, self.num_kv_heads, decision.quant or "none")
            data = encode_chunk(kv.to(self.codec_device) if fmt.quant else kv, fmt)
            items.append(
                PutItem(
                    key=name,
                    data=data,
                    context_id=decision.context_id,
                    variant=decision.variant,
                    layout=fmt.layout(),
                    token_count=fmt.shape[2],
                    shape=tuple(data.shape) if not fmt.quant else (),
                    parent_context_id=decision.parent,
                )
            )
        stored = put_many(self.client, items, durable=self.settings.durable)
        self.links.touched(chunks[0][0], decision.context_id)  # a prompt's first chunk: its context
        self.links.touched(chunks[-1][0], decision.context_id)
        with self._lock:
            self.stats.put_chunks += len(items)
            self.stats.put_bytes += stored
            if decision.advised and decision.quant:
                self.stats.advised_chunks += len(items)

    # -- gets ---------------------------------------------------------------------------------

    def batched_get_blocking(self, keys: list[Any]) -> list[Any]:
        """The chunks of ``keys`` in order, ``None`` from the first that cannot be loaded on."""
        out: list[Any] = []
        leased = False
        names: list[str] = []
        if self._offline("gets"):
            return [None] * len(keys)
        try:
            names = self.placeholders.translate(keys, [key_string(k) for k in keys])
            with lease_many(self.client, names) as views:
                leased = True
                for name, (info, view) in zip(names, views, strict=True):
                    out.append(self._decode(name, info, view))
        except Exception as e:
            self._failed("get", e)
            if not leased and self.link.up:  # the batch was refused: load what is left, in order
                out = self._get_each(names)
        with self._lock:
            self.stats.get_chunks += len(out)
        if out:
            self._report_prompt(keys[0])
        return out + [None] * (len(keys) - len(out))

    def _get_each(self, names: list[str]) -> list[Any]:
        out: list[Any] = []
        for name in names:
            try:
                with lease_many(self.client, [name]) as ((info, view),):
                    out.append(self._decode(name, info, view))
            except Exception as e:
                self._failed("get", e)
                break
        return out

    def _decode(self, name: str, info: Any, view: memoryview) -> Any:
        self.links.touched(name, info.spec.context_id)
        fmt = ChunkFormat.parse(info.spec.layout)
        if fmt.shape != self.chunk_shape:
            # a chunk of another shape handed to LMCache failed vLLM's request with a 500
            raise CorruptObjectError(
                f"chunk {name!r}: its layout says {fmt.shape}, LMCache's chunk is "
                f"{self.chunk_shape}"
            )
        obj = self.local_cpu_backend.allocate(
            torch.Size(fmt.shape), getattr(torch, fmt.dtype), MemoryFormat.KV_2LTD
        )
        if obj is None:
            raise KvtierError(f"LMCache could not allocate a {fmt.shape} chunk buffer")
        try:
            decode_chunk(torch.frombuffer(view, dtype=torch.uint8), fmt, obj.tensor)
        except BaseException:
            obj.ref_count_down()  # LMCache frees only what it is given back
            raise
        return obj

    def get_blocking(self, key: Any) -> Any:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(self, key: Any, location: str | None = None) -> Future[Any]:
        return self._pool.submit(self.get_blocking, key)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[Any], transfer_spec: Any = None
    ) -> list[Any]:
        loop = asyncio.get_running_loop()
        objs = await loop.run_in_executor(self._pool, self.batched_get_blocking, keys)
        return list(itertools.takewhile(lambda o: o is not None, objs))

    # -- the rest -----------------------------------------------------------------------------

    def remove(self, key: Any, force: bool = True) -> bool:
        try:
            return self.client.delete([key_string(key)]) == 1
        except Exception as e:
            self._failed("remove", e)
            return False

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        return None  # recency is kept by the daemon on every lookup and get

    def close(self) -> None:
        self.link.close()
        self._pool.shutdown(wait=False)
        self.prompts.close()
        self.client.close()
        logger.info("kvtierd plugin closed: %s", self.stats)


def codec_device() -> torch.device:
    """Where int8/int4 chunks are encoded and decoded: the worker's CUDA device when vLLM runs
    on a GPU (``chunk_codec`` then runs the Triton kernels there and only the compressed bytes
    are copied back to host memory), else the CPU with the torch reference (vLLM-CPU; Triton
    would only run there under its interpreter, which is for tests)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
