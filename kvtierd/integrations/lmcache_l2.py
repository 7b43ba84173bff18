"""kvtierd as an L2 adapter of LMCache's multiprocess server (issue 41.3).

``vllm --kv-offloading-backend lmcache`` runs LMCache outside vLLM: vLLM's
``LMCacheMPConnector`` talks to an LMCache server process (``lmcache server``), whose first
level is its own memory (L1) and whose second level is a list of L2 adapters. The in-process
storage plugin (``lmcache_plugin.py``) has no place there; this adapter is kvtierd's L2. The
server loads it through its built-in ``plugin`` adapter type, which imports a module and class
by name (``lmcache/v1/distributed/l2_adapters/plugin_l2_adapter.py``), so it needs no wrapper
around the server::

    lmcache server --l1-size-gb 1 --eviction-policy LRU --supported-transfer-mode auto \\
      --l2-adapter '{"type": "plugin", "module_path": "kvtierd.integrations.lmcache_l2",
                     "class_name": "KvtierdL2Adapter",
                     "adapter_params": {"socket_path": "/run/kvtierd/kvtierd.sock"}}'

``adapter_params`` become :class:`KvtierdL2AdapterConfig` (the plugin type finds it by the
``<class_name>Config`` convention).

What the server hands an L2 adapter is a key (``ObjectKey``: chunk hash, model, KV rank,
object group and the request's ``cache_salt``) and a buffer in its L1; no request settings. So
objects are stored as the server's bytes, opaque to the daemon (layout ``""``): the placer
moves and drops them between tiers but neither profiles nor compresses them, and the router's
variants and store requests do not apply on this path (docs/integration.md). The salt is in
every daemon key as the plugin writes it (``salt.salt_key_prefix``: a digest, never the salt;
a namespace salt names the tenant's namespace). A store task's chunks form one context (the
server submits a request's newly written chunks together).

LMCache's controllers call the adapter from two threads and wait on three event fds; every
daemon call runs on one worker thread here, in submission order, and signals the task's fd
when done. A failure never escapes to the server: a store is reported failed, a lookup or load
as misses (a bitmap of zeros), and the failure logged; while the daemon does not answer
(``daemon_link``) lookups miss and stores are dropped without calling it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvtierd.client import KVClient
from kvtierd.errors import UnavailableError
from kvtierd.integrations.daemon_io import PutItem, lease_many, put_many
from kvtierd.integrations.daemon_link import DaemonLink
from kvtierd.integrations.plugin_log import ensure_plugin_log
from kvtierd.integrations.salt import salt_key_prefix
from kvtierd.types import ORIGINAL_VARIANT

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger(__name__)

KEY_PREFIX = "lmcache-mp"
"""First field of every daemon key this adapter writes: the in-process plugin's keys
(``plugin_settings.key_string``) hash chunks differently, so the two never share an object."""


@dataclass(frozen=True, slots=True)
class KvtierdL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """The adapter's ``adapter_params``. ``hold_s``: how long a lookup keeps the found chunks
    from eviction in the daemon (the server's lock, until its load); ``timeout_s``: per daemon
    call; ``tenant``: the tenant the chunks are charged to (docs/daemon.md)."""

    socket_path: str
    tenant: str = ""
    hold_s: float = 30.0
    timeout_s: float = 10.0
    durable: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.socket_path, str) or not self.socket_path:
            raise ValueError(f"socket_path must be a non-empty string, got {self.socket_path!r}")
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a string, got {self.tenant!r}")
        for name in ("hold_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.durable, bool):
            raise ValueError(f"durable must be true or false, got {self.durable!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KvtierdL2AdapterConfig:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(
                f"kvtierd L2 adapter: unknown adapter_params {unknown}; known are {known}"
            )
        if "socket_path" not in d:
            raise ValueError("kvtierd L2 adapter: adapter_params needs socket_path")
        return cls(**d)

    @classmethod
    def help(cls) -> str:
        return (
            "kvtierd L2 adapter (adapter_params):\n"
            "- socket_path (str): the kvtierd daemon's Unix socket (required)\n"
            "- tenant (str): tenant the chunks are charged to (default: none)\n"
            "- hold_s (float): how long a lookup holds the found chunks (default 30)\n"
            "- timeout_s (float): per daemon call (default 10)\n"
            "- durable (bool): commit each store durably (default false)"
        )


def daemon_key(key: ObjectKey) -> str:
    """The daemon's key of an LMCache MP object: ``[<salt tag>@]lmcache-mp@<model>@<rank>@
    <group>@<chunk hash hex>`` (unambiguous: ``ObjectKey`` refuses ``@`` in the model name)."""
    return (
        f"{salt_key_prefix(key.cache_salt)}{KEY_PREFIX}@{key.model_name}@{key.kv_rank}@"
        f"{key.object_group_id}@{key.chunk_hash.hex()}"
    )


def _bytes_of(obj: MemoryObj) -> torch.Tensor:
    """A flat ``uint8`` view of an L1 object's bytes (its logical size, not the aligned
    allocation): what is stored, and what a load writes into."""
    raw: torch.Tensor | None = obj.raw_tensor
    if raw is None:
        raise ValueError(f"L1 object {obj!r} has no tensor (invalidated, or not a tensor buffer)")
    return raw.reshape(-1).view(torch.uint8)[: obj.get_size()]


class KvtierdL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """An L2 of LMCache's multiprocess server kept in a kvtierd daemon."""

    def __init__(
        self, config: KvtierdL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None
    ) -> None:
        # No capacity here (0): the daemon's placer decides what stays, not LMCache's L2
        # eviction.
        super().__init__(max_capacity_bytes=0)
        ensure_plugin_log()  # the adapter's INFO lines in the server's log, as in vLLM's
        self.config = config
        self.client = KVClient(config.socket_path, tenant=config.tenant,
                               timeout_s=config.timeout_s)  # fmt: skip
        self.link = DaemonLink(self.client, on_connected=lambda: None)
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-l2")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}
        self.link.connect()
        logger.info("kvtierd L2 adapter: daemon at %s (%s)", config.socket_path,
                    "answering" if self.link.up else "not answering yet")  # fmt: skip

    # -- event fds ----------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_fd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_fd.fileno())

    # -- tasks --------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> int:
        return self._submit(lambda: self._store(keys, objects), self._stores, self._store_fd,
                            failed=L2StoreResult(False, 0))  # fmt: skip

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> int:
        return self._submit(lambda: self._lookup(keys), self._lookups, self._lookup_fd,
                            failed=Bitmap(len(keys)))  # fmt: skip

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Nothing to do: a lookup's hold in the daemon lapses by itself after ``hold_s``
        (the daemon has no release of a hold), so an unlock can never be lost."""

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> int:
        return self._submit(lambda: self._load(keys, objects), self._loads, self._load_fd,
                            failed=Bitmap(len(keys)))  # fmt: skip

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self.link.close()
        self.client.close()
        for fd in (self._store_fd, self._lookup_fd, self._load_fd):
            fd.close()

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": self.link.up, "type": "KvtierdL2Adapter",
                "socket_path": self.config.socket_path}  # fmt: skip

    # -- on the worker thread -----------------------------------------------------------------

    def _submit(self, run: Callable[[], Any], results: dict[int, Any], fd: Any, failed: Any) -> int:
        task_id = next(self._ids)

        def task() -> None:
            try:
                result = run()
            except UnavailableError as e:
                self.link.lost(e)
                result = failed
            except Exception:  # reported to the server as a failed task, never raised into it
                logger.exception("kvtierd L2 adapter: task %d failed", task_id)
                result = failed
            with self._lock:
                results[task_id] = result
            fd.notify()

        self._worker.submit(task)
        return task_id

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        if not self.link.up:
            self.link.dropped(len(keys))
            return L2StoreResult(False, 0)
        names = [daemon_key(k) for k in keys]
        present = self.client.lookup(names).found  # the server stores a chunk again: skip it
        todo = [(n, k, o) for n, k, o, found in zip(names, keys, objects, present, strict=True)
                if not found]  # fmt: skip
        if not todo:
            return L2StoreResult(True, 0)
        context = todo[0][0]
        items = [PutItem(key=n, data=_bytes_of(o), context_id=context, variant=ORIGINAL_VARIANT,
                         layout="", token_count=0) for n, _, o in todo]  # fmt: skip
        stored = put_many(self.client, items, durable=self.config.durable)
        self._notify_keys_stored([k for _, k, _ in todo], [int(i.data.numel()) for i in items])
        return L2StoreResult(True, stored)

    def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        found = Bitmap(len(keys))
        if not self.link.up:
            return found
        result = self.client.lookup([daemon_key(k) for k in keys], hold_s=self.config.hold_s)
        for i, hit in enumerate(result.found):
            if hit:
                found.set(i)
        return found

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        loaded = Bitmap(len(keys))
        if not self.link.up:
            return loaded
        names = [daemon_key(k) for k in keys]
        # Only what is there, in one read: a missing key refuses a whole batch.
        present = [i for i, hit in enumerate(self.client.lookup(names).found) if hit]
        try:
            self._read_into(present, names, objects, loaded)
        except UnavailableError:
            raise
        except Exception as e:  # one went between the lookup and the read: the rest one by one
            logger.info("kvtierd L2 adapter: batched load refused (%s); loading one by one", e)
            for i in present:
                if loaded.test(i):
                    continue
                try:
                    self._read_into([i], names, objects, loaded)
                except UnavailableError:
                    raise
                except Exception as one:
                    logger.warning("kvtierd L2 adapter: chunk %s not loaded: %s", names[i], one)
        accessed = [k for i, k in enumerate(keys) if loaded.test(i)]
        if accessed:
            self._notify_keys_accessed(accessed)
        return loaded

    def _read_into(
        self, which: list[int], names: list[str], objects: list[MemoryObj], loaded: Bitmap
    ) -> None:
        if not which:
            return
        with lease_many(self.client, [names[i] for i in which]) as views:
            for i, (_, view) in zip(which, views, strict=True):
                if self._copy_into(names[i], view, objects[i]):
                    loaded.set(i)

    @staticmethod
    def _copy_into(name: str, view: memoryview, obj: MemoryObj) -> bool:
        dst = _bytes_of(obj)
        if len(view) != dst.numel():
            # another model's or layout's bytes under this key: a miss, not a wrong load
            logger.error("kvtierd L2 adapter: chunk %s is %d bytes, the server's buffer %d",
                         name, len(view), dst.numel())  # fmt: skip
            return False
        dst.copy_(torch.frombuffer(view, dtype=torch.uint8))
        return True
