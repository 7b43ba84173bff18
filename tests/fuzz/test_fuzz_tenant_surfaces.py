"""Fuzz the surfaces of issue 27 with values built to hit their checks, not random messages
(test_grpc_fuzz does those): chunk layouts and variants of puts, model cards, ReportServed,
AddQueries and SetContextTokens, from two tenants (one over the Unix socket, one over TCP
without admin), on a daemon under EvicPress so that profiling and the placer see what was
stored; and the router's request fields. Every answer must be a status a client can act on
(never INTERNAL or UNKNOWN; a router answer below 500), the daemon logs no traceback, its
profiling loop and health stay up, and the shared prefill speed stays what the default
tenant's reports made it.

``KVTIERD_FUZZ_EXAMPLES=N`` runs N examples per surface instead of the CI's 40.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from benchmarks._support.daemon_proc import REPO, DaemonProcess, tcp_listener, write_config
from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.kernels.placeholder import MODEL_CARD_LAYOUT, model_card_key
from kvtierd.rpc import kvtier_pb2 as pb
from tests.fuzz.test_grpc_fuzz import new_tracebacks

EXAMPLES = int(os.environ.get("KVTIERD_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)
ACCEPTED = (
    errors.InvalidArgumentError,
    errors.NotFoundError,
    errors.AlreadyExistsError,
    errors.CapacityError,
    errors.PermissionDeniedError,
)


@dataclass
class Target:
    daemon: DaemonProcess
    local: KVClient  # tenant a, Unix socket
    remote: KVClient  # tenant b, TCP, no admin
    admin: KVClient


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    directory = tmp_path_factory.mktemp("fuzz27")
    tcp = tcp_listener(directory, "admin-token")
    (directory / "b.token").write_text("b-token")
    tenants = [{"name": "a", "quota": {"cpu": "4MiB", "ssd": "8MiB"}},
               {"name": "b", "token_file": str(directory / "b.token")}]  # fmt: skip
    config = write_config(directory, cpu="16MiB", ssd="64MiB", tenants=tenants,
                          policy_file=str(REPO / "configs/policies/evicpress.yaml"),
                          **tcp.settings)  # fmt: skip
    d = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log").start()
    clients = (
        KVClient(d.socket_path, tenant="a", timeout_s=20),
        KVClient(address=tcp.address(d), tls_ca_file=str(tcp.ca_file), token="b-token",
                 timeout_s=20),
        KVClient(d.socket_path, timeout_s=20),
    )  # fmt: skip
    try:
        yield Target(d, *clients)
    finally:
        for c in clients:
            c.close()
        d.kill()


def _tenant(t: Target) -> st.SearchStrategy[KVClient]:
    return st.sampled_from([t.local, t.remote])


def _calls(t: Target, fn: Any) -> list[str]:
    """Run ``fn``; the problem it met, if any (an error class a client cannot act on)."""
    try:
        fn()
    except ACCEPTED:
        return []
    except errors.KvtierError as e:
        return [f"{type(e).__name__}: {e}"[:500]]
    return []


def _after(t: Target, log_at: int, problems: list[str]) -> None:
    assert not problems, f"{len(problems)} bad answers; first:\n" + "\n".join(problems[:3])
    assert not new_tracebacks(t, log_at), new_tracebacks(t, log_at)  # type: ignore[arg-type]
    assert t.daemon.proc is not None and t.daemon.proc.poll() is None
    assert t.admin.status().health == "SERVING"


def _log_at(t: Target) -> int:
    return Path(t.daemon.log).stat().st_size


# -- puts: layouts, variants, cards -----------------------------------------------------------

small = st.one_of(st.integers(-2, 70), st.sampled_from([2**31, 2**63, 10**30]))
dims = st.lists(small, min_size=0, max_size=5).map(lambda ds: "x".join(map(str, ds)))
quant_parts = st.builds(
    lambda q, g: f";{q};g={g}", st.sampled_from(["int8", "int4", "int99", ""]), small
)
chunk_layouts = st.builds(
    lambda d, dt, h, rest: f"KV_2LTD;{d};{dt};h={h}{rest}",
    dims,
    st.sampled_from(["bfloat16", "float16", "float32", "int8", "nonsense", ""]),
    small,
    st.one_of(st.just(""), quant_parts),
)
layouts = st.one_of(
    st.sampled_from(["", "KV_2LTD", "KV_2LTD;2x2x16x64;bfloat16;h=2", MODEL_CARD_LAYOUT, "zz"]),
    chunk_layouts,
)
variants = st.one_of(
    st.sampled_from(["", "none", "int8", "int4", "knorm@0.5", "knorm@0.5+int8", "zzz@9.9+int99",
                     "knorm@nan", "knorm@inf", "knorm@0", "knorm-window=0@0.5", "@", "+"]),
    st.text(max_size=20),
)  # fmt: skip
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20,
)  # fmt: skip
card_docs = st.fixed_dictionaries(
    {"model": st.one_of(st.just("/m"), st.text(max_size=10), json_values),
     "head_dim": st.one_of(small, json_values),
     "inv_freq": st.one_of(st.lists(st.floats(), max_size=40), json_values),
     "vocab_size": st.one_of(small, json_values),
     "special_ids": st.one_of(st.lists(small, max_size=5), json_values)},
    optional={"refused": json_values, "style": st.sampled_from(["neox", "gptj", ""])},
)  # fmt: skip


def _chunk_bytes(layout: str) -> int:
    try:
        from kvtierd.kernels.chunk_codec import ChunkFormat

        n = ChunkFormat.parse(layout).encoded_bytes()
    except Exception:
        return 256
    return n if 0 < n <= 1 << 20 else 256


def test_fuzz_puts(target: Target) -> None:
    problems: list[str] = []
    log_at = _log_at(target)
    counter = iter(range(10**9))

    @FUZZ
    @given(c=_tenant(target), layout=layouts, variant=variants, data=st.data())
    def run(c: KVClient, layout: str, variant: str, data: st.DataObject) -> None:
        n = next(counter)
        size = _chunk_bytes(layout) + data.draw(st.sampled_from([0, 0, 0, 1, -1]))
        payload = data.draw(st.binary(min_size=8, max_size=8)) * (max(size, 1) // 8 + 1)
        put = lambda: c.put(f"k{n}", payload[: max(size, 1)], context_id=f"c{n % 7}",  # noqa: E731
                            variant=variant, layout=layout, token_count=16)  # fmt: skip
        problems.extend(_calls(target, put))

    @FUZZ
    @given(c=_tenant(target), doc=st.one_of(card_docs, json_values), nest=st.integers(0, 3000))
    def cards(c: KVClient, doc: Any, nest: int) -> None:
        text = json.dumps(doc) if nest < 2000 else "[" * (nest * 10) + "]" * (nest * 10)
        model = doc.get("model") if isinstance(doc, dict) else None
        key = model_card_key(model if isinstance(model, str) else "/m")
        put = lambda: c.put(key, text.encode(), context_id="card", layout=MODEL_CARD_LAYOUT)  # noqa: E731
        problems.extend(_calls(target, put))

    run()
    cards()
    time.sleep(2)  # the profiling loop takes up what was stored
    _after(target, log_at, problems)


# -- the reporting and registration RPCs ------------------------------------------------------

numbers = st.one_of(st.floats(), st.sampled_from([5e-324, 1e-300, 1e-3, 0.5, 3600.0, -0.0]))
counts = st.one_of(st.integers(0, 10_000), st.sampled_from([0, 2**32, 2**63, 2**64 - 1]))


def test_fuzz_reports_and_registrations(target: Target) -> None:
    problems: list[str] = []
    log_at = _log_at(target)
    router = target.admin
    for n in (500, 1000, 1500, 2000, 2500, 3000, 3500, 4000):  # the router's own: 800 tokens/s
        router.call(router.kv.ReportServed,
                    pb.ReportServedRequest(prompt_tokens=n, ttft_s=0.2 + n / 800))  # fmt: skip
    shared = router.status().prefill_tokens_per_s
    target.local.put("q", b"x" * 64, context_id="q")
    target.remote.put("q", b"x" * 64, context_id="q")

    @FUZZ
    @given(c=_tenant(target), prompt=counts, cached=counts, ttft=numbers)
    def reports(c: KVClient, prompt: int, cached: int, ttft: float) -> None:
        req = pb.ReportServedRequest(prompt_tokens=prompt, cached_tokens=cached, ttft_s=ttft)
        problems.extend(_calls(target, lambda: c.call(c.kv.ReportServed, req)))

    @FUZZ
    @given(
        c=_tenant(target),
        texts=st.lists(st.one_of(st.text(max_size=30), st.just("q" * 20_000)), max_size=20),
        cid=st.sampled_from(["q", "nowhere", "", "a/q"]),
        traffic=st.booleans(),
    )
    def queries(c: KVClient, texts: list[str], cid: str, traffic: bool) -> None:
        req = pb.AddQueriesRequest(context_id=cid, texts=texts, from_traffic=traffic)
        problems.extend(_calls(target, lambda: c.call(c.kv.AddQueries, req)))

    @FUZZ
    @given(
        c=_tenant(target),
        cid=st.sampled_from(["q", "nowhere", ""]),
        rid=st.one_of(st.sampled_from(["", "r1", "r2"]), st.just("r" * 5000)),
        ids=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    )
    def tokens(c: KVClient, cid: str, rid: str, ids: list[int]) -> None:
        req = pb.SetContextTokensRequest(context_id=cid, request_id=rid, token_ids=ids)
        problems.extend(_calls(target, lambda: c.call(c.kv.SetContextTokens, req)))

    reports()
    queries()
    tokens()
    _after(target, log_at, problems)
    rate = router.status().prefill_tokens_per_s
    assert math.isfinite(rate) and rate == pytest.approx(shared)  # the tenants moved nothing


# -- the router's request fields --------------------------------------------------------------


class _Stack:
    """A vLLM stand-in and a router in front of it (on the daemon), on a loop of their own."""

    def __init__(self, socket_path: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(socket_path), self.loop).result()

    async def _start(self, socket_path: str) -> str:
        from aiohttp import web

        from kvtierd.integrations.router.app import RouterConfig, make_app
        from tests.integrations.test_router_errors import Upstream

        self.runners: list[web.AppRunner] = []

        async def serve(app: web.Application) -> str:
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.runners.append(runner)
            return f"http://127.0.0.1:{runner.addresses[0][1]}"

        upstream = await serve(Upstream().app())
        return await serve(make_app(RouterConfig(upstream, socket_path, chunk_tokens=16)))

    def close(self) -> None:
        async def stop() -> None:
            for r in reversed(self.runners):
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


kvtierd_fields = st.dictionaries(
    st.sampled_from(["context_tokens", "variant", "scope", "other"]),
    st.one_of(json_values, st.sampled_from([16, 32, "knorm@0.5", 10**30, -1])),
    max_size=3,
)
bodies = st.fixed_dictionaries(
    {"model": st.just("m"),
     "prompt": st.one_of(st.text(alphabet="w1 23", max_size=40),
                         st.lists(st.integers(-5, 2**64), max_size=20), json_values)},
    optional={"kvtierd": st.one_of(kvtierd_fields, json_values),
              "kv_transfer_params": st.one_of(
                  st.dictionaries(st.sampled_from(["lmcache.tag.kvtierd_manifest", "lmcache.x",
                                                   "k"]), json_values, max_size=3), json_values),
              "max_tokens": st.one_of(st.integers(), json_values),
              "stream": st.booleans()},
)  # fmt: skip


def test_fuzz_router_fields(target: Target) -> None:
    pytest.importorskip("aiohttp")
    stack = _Stack(target.daemon.socket_path)
    problems: list[str] = []

    @FUZZ
    @given(body=bodies, nest=st.integers(0, 200), raw=st.booleans())
    def run(body: dict[str, Any], nest: int, raw: bool) -> None:
        text = json.dumps(body)
        if raw:  # what json.dumps cannot write: a number too large for a float, deep nesting
            text = text[:-1] + ', "deep": ' + "[" * nest + "1e400" + "]" * nest + "}"
        req = urllib.request.Request(f"{stack.url}/v1/completions", data=text.encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        if status >= 500 and status not in (502, 503):  # 502/503: vLLM / the daemon refused
            problems.append(f"HTTP {status} for {text[:300]}")

    try:
        run()
    finally:
        stack.close()
    assert not problems, f"{len(problems)} bad answers; first:\n" + "\n".join(problems[:3])
    assert target.admin.status().health == "SERVING"
