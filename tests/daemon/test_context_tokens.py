"""Context token ids (``KVStore.SetContextTokens``): evaluators that run the model through the
serving stack need the tokens a context was computed from; the daemon gets them from a writer
that knows them (kvtierd router), keeps them with the context's queries across restarts, and
profiles a context with such an evaluator only once they are known."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

import pytest
import torch

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import (
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.profiler.quality import DEFAULT_FORM, EVALUATORS
from kvtierd.profiler.queries import QueryStore
from kvtierd.types import ObjectMeta

T = 16


class TokenEcho(QualityEvaluator):
    """Needs token ids, like ``served``; remembers the ones it was given."""

    name = "test-token-echo"
    needs_token_ids = True
    seen: ClassVar[list[tuple[int, ...]]] = []

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery] = (),
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        TokenEcho.seen.append(kv.token_ids)
        return QualityResult(self.name, MappingProxyType(dict.fromkeys(variants, 1.0)), 0)


@pytest.fixture(autouse=True)
def registered_evaluator() -> Iterator[None]:
    with EVALUATORS.registered(TokenEcho):
        yield


async def _put_chunk(engine: Engine, cid: str) -> None:
    x = torch.zeros(2, 2, T, 2 * 32, dtype=torch.bfloat16)
    layout = ChunkFormat(tuple(x.shape), "bfloat16", 2).layout()
    data = memoryview(x.view(torch.uint8).numpy().tobytes())
    meta = ObjectMeta(key=f"{cid}/0", size_bytes=len(data), context_id=cid, dtype="bfloat16",
                      shape=tuple(x.shape), layout=layout, token_count=T)  # fmt: skip
    await engine.put_bytes(meta, data)


def _cpu_engine(tmp_path: Path) -> Engine:
    """An engine with one small CPU tier (started by the caller)."""
    tiers = (TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "8MiB"}),)
    return Engine(
        DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "d"), tiers=tiers)
    )


def test_query_store_keeps_the_longest_tokens_across_a_reload(tmp_path: Path) -> None:
    store = QueryStore(tmp_path)
    store.set_tokens("c", (1, 2, 3, 4))
    store.set_tokens("c", (1, 2))  # a shorter prefix never replaces what is known
    assert store.tokens("c", 3) == (1, 2, 3)
    assert store.tokens("c", 5) == ()  # fewer known than the KV holds: unknown
    again = QueryStore(tmp_path)
    again.load()
    assert again.tokens("c", 4) == (1, 2, 3, 4)


async def test_profiled_only_once_its_tokens_are_registered(tmp_path: Path) -> None:
    engine = _cpu_engine(tmp_path)
    await engine.start()
    try:
        policy = parse_policy(
            "placer: evicpress\nvariants:\n  methods: [knorm]\n  ratios: [0.5]\n", "p.yaml"
        )
        await engine.apply_policy(
            replace(policy, estimator=TokenEcho.name, evaluator=TokenEcho.name)
        )
        await _put_chunk(engine, "doc")
        ctx = engine.contexts["doc"]
        TokenEcho.seen.clear()
        assert not await engine.profiling.profile_context(ctx)
        assert "none were registered" in engine.profiling.last_error
        assert TokenEcho.seen == []
        prompt = tuple(range(100, 100 + T + 5))  # the prompt: the context plus a suffix
        await engine.profiling.inputs.set_tokens("doc", prompt)
        assert await engine.profiling.profile_context(ctx)
        assert TokenEcho.seen == [prompt[:T]]
    finally:
        await engine.close()


async def test_a_linked_prompt_gives_tokens_and_a_traffic_query(tmp_path: Path) -> None:
    """The router registers a prompt by request id; the plugin's put links it to the context:
    the context gets the prompt's tokens, the rest of the prompt is a real query of it."""
    from kvtierd.profiler import ProfilingQuery

    engine = _cpu_engine(tmp_path)
    await engine.start()
    try:
        await _put_chunk(engine, "doc")
        prompt = tuple(range(500, 500 + T + 3))
        engine.profiling.inputs.note_prompt("", "req-1", prompt)
        await engine.profiling.inputs.link_prompt("doc", "req-1")
        queries = engine.profiling.profiler.queries  # type: ignore[union-attr]
        assert queries.tokens("doc", T) == prompt[:T]
        assert queries.recent("doc") == (ProfilingQuery(token_ids=prompt[T:]),)
        with pytest.raises(errors.NotFoundError, match="no prompt registered"):
            await engine.profiling.inputs.link_prompt("doc", "never-registered")
    finally:
        await engine.close()


def test_set_context_tokens_over_the_socket(start_daemon) -> None:
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        c.put("held/0", b"x" * 4096, context_id="held", token_count=3)
        c.set_context_tokens("held", [1, 2, 3])
        c.note_prompt("r", [1, 2, 3])
        c.link_prompt("held", "r")
        with pytest.raises(errors.NotFoundError, match="no prompt registered"):
            c.link_prompt("held", "unknown-request")
        for bad in (lambda: c.set_context_tokens("x", []), lambda: c.set_context_tokens("", [1])):
            with pytest.raises(errors.InvalidArgumentError, match="context_id \\+ token_ids"):
                bad()


def test_token_registrations_are_bounded(start_daemon, tmp_path) -> None:
    """Issue 16 (3): token ids are kept only for contexts the daemon holds, at most one
    context's length, and within the tenant's token_bytes_per_tenant - also over TCP."""
    from benchmarks._support.daemon_proc import tcp_listener

    tcp = tcp_listener(tmp_path)
    (tmp_path / "a.token").write_text("a-token")
    d = start_daemon(
        tenants=[{"name": "a", "token_file": str(tmp_path / "a.token")}],
        token_bytes_per_tenant="64KiB",  # 16,384 ids
        **tcp.settings,
    )
    with KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="a-token") as a:
        with pytest.raises(errors.NotFoundError, match="context 'nowhere' not found"):
            a.set_context_tokens("nowhere", [1, 2, 3])
        a.note_prompt("r", [1, 2, 3])
        with pytest.raises(errors.NotFoundError, match="context 'nowhere' not found"):
            a.link_prompt("nowhere", "r")
        with pytest.raises(errors.InvalidArgumentError, match="at most 1048576 token ids"):
            a.note_prompt("huge", [7] * ((1 << 20) + 1))
        for i in range(3):  # contexts of unknown length: each may keep what it is given
            a.put(f"c{i}/0", b"x" * 4096, context_id=f"c{i}")
        a.set_context_tokens("c0", [5] * 10_000)
        with pytest.raises(errors.CapacityError, match="token_bytes_per_tenant"):
            a.set_context_tokens("c1", [5] * 10_000)  # 20,000 ids > 16,384
        a.put("short/0", b"x" * 4096, context_id="short", token_count=16)
        a.set_context_tokens("short", [5] * 10_000)  # only its 16 tokens are kept
        assert a.delete(["c0/0"]) == 1  # a context that goes frees its ids
        a.set_context_tokens("c1", [5] * 10_000)
        for i in range(8):  # pending prompts: the oldest are forgotten, never refused
            a.note_prompt(f"p{i}", [9] * 4000)
        with pytest.raises(errors.NotFoundError, match="no prompt registered"):
            a.link_prompt("c2", "p0")
        a.link_prompt("c2", "p7")
    with KVClient(d.socket_path) as admin:
        status = admin.call(admin.admin.ProfileStatus, _status_request("a/short"))
        assert status.known_tokens == 16


def _status_request(context_id: str) -> object:
    from kvtierd.rpc import kvtier_pb2 as pb

    return pb.ProfileStatusRequest(context_id=context_id)


async def test_a_context_lost_to_corruption_forgets_its_profile_data(tmp_path: Path) -> None:
    """A context whose last object turns out corrupt is gone like a deleted one: its token
    ids are forgotten, not left behind for a context that no longer exists (its profile and
    queries are set aside for when its prompt is stored again: test_profile_kept.py)."""
    tiers = (
        TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "8MiB"}),
        TierConfig("ssd", "ssd", 64 << 20, str(tmp_path / "ssd")),
    )
    engine = Engine(
        DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "d"), tiers=tiers)
    )
    await engine.start()
    try:
        await _put_chunk(engine, "doc")
        await engine.profiling.inputs.set_tokens("doc", tuple(range(T)))
        queries = engine.profiling.profiler.queries  # type: ignore[union-attr]
        assert queries.tokens("doc", T)
        await engine.mover.move_context(engine.contexts["doc"], "ssd")
        ssd = engine.tiers["ssd"]
        path = ssd.layout.object_path("", "doc/0")  # type: ignore[attr-defined]
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(errors.CorruptObjectError):
            await engine.get(["doc/0"])
        assert "doc" not in engine.contexts
        deadline = time.monotonic() + 5.0  # the profiler forgets on its worker thread
        while queries.tokens("doc", T) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert queries.tokens("doc", T) == ()
    finally:
        await engine.close()


async def test_a_prompt_linked_after_its_context_went_is_a_query_of_it(tmp_path: Path) -> None:
    """The placer may drop a context as it arrives, before the plugin links the request that
    stored it. That request is still a query of the context: kept with its set-aside profile,
    so that a context which keeps being dropped is profiled on enough queries when it returns
    (issue 13's fourth run lost every such query to NOT_FOUND)."""
    engine = _cpu_engine(tmp_path)
    await engine.start()
    try:
        await _put_chunk(engine, "doc")
        inputs = engine.profiling.inputs
        assert engine.profiling.options.geometry_of(engine.contexts["doc"])[1] == T
        prompt = tuple(range(700, 700 + T + 4))
        inputs.note_prompt("", "req-1", prompt)
        assert await engine.delete(["doc/0"]) == 1
        assert inputs.set_aside_tokens("doc") == T
        await inputs.link_prompt("doc", "req-1")
        queries = engine.profiling.profiler.queries  # type: ignore[union-attr]
        assert queries.recent("doc") == (ProfilingQuery(token_ids=prompt[T:]),)
        assert queries.tokens("doc", T) == ()  # ids come back with the context, not before
        with pytest.raises(errors.NotFoundError, match="context 'never' not found"):
            await inputs.link_prompt("never", "req-1")
        await _put_chunk(engine, "doc")  # back: linked the usual way again
        assert inputs.set_aside_tokens("doc") == 0
    finally:
        await engine.close()


def test_a_prompt_links_over_the_socket_to_a_context_deleted_since_its_put(start_daemon) -> None:
    d = start_daemon()
    x = torch.zeros(2, 2, T, 2 * 32, dtype=torch.bfloat16)
    layout = ChunkFormat(tuple(x.shape), "bfloat16", 2).layout()
    with KVClient(d.socket_path) as c:
        c.put("gone/0", x, context_id="gone", layout=layout, token_count=T)
        c.set_context_tokens("gone", range(T))  # its length is known from here on
        c.note_prompt("r", range(T + 2))
        assert c.delete(["gone/0"]) == 1
        c.link_prompt("gone", "r")  # a query of the deleted context
        with pytest.raises(errors.NotFoundError, match="context 'never' not found"):
            c.link_prompt("never", "r")
        with pytest.raises(errors.NotFoundError, match="context 'gone' not found"):
            c.set_context_tokens("gone", [1, 2, 3])  # its token ids are not kept
