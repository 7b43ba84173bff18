"""Fuzz every gRPC method of a real daemon with hypothesis-generated messages and raw garbage.

Each call must come back with a status within its timeout (a hang is ``DEADLINE_EXCEEDED``:
a failure), and the status must be one a client can act on: never ``INTERNAL`` / ``UNKNOWN``
(an exception the daemon did not expect), never ``UNAVAILABLE`` or ``DATA_LOSS`` (nothing here
takes a tier down or corrupts a file). After each method's run the daemon must still be
``SERVING`` on grpc.health, answer ``Admin.Status`` and store and read an object.

``KVTIERD_FUZZ_EXAMPLES=N`` runs N examples per method instead of the CI's 250 (a deeper hunt).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from benchmarks._support.daemon_proc import REPO, DaemonProcess, write_config
from benchmarks._support.workload import payload
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from tests.fuzz.proto_strategies import ALIAS_BOMB, Pools, message

CALL_TIMEOUT_S = 10.0
EXAMPLES = int(os.environ.get("KVTIERD_FUZZ_EXAMPLES", "250"))  # per method; ~40 s on 2 cores
GARBAGE_EXAMPLES = 80
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.OUT_OF_RANGE,
}
TENANTS = ("", "t1", "nobody", "../t1")
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: the daemon's state moves on
    suppress_health_check=list(HealthCheck),
)


@dataclass(frozen=True)
class Method:
    path: str
    request: type
    response: type
    client_streaming: bool
    server_streaming: bool


def _methods() -> list[Method]:
    out = []
    for service in pb.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            out.append(
                Method(
                    f"/{service.full_name}/{m.name}",
                    getattr(pb, m.input_type.name),
                    getattr(pb, m.output_type.name),
                    m.client_streaming,
                    m.server_streaming,
                )
            )
    return out


METHODS = _methods()
POLICY = next(m for m in METHODS if m.path.endswith("/ApplyPolicy"))


@dataclass
class Target:
    daemon: DaemonProcess
    channel: grpc.Channel
    pools: Pools


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    directory = tmp_path_factory.mktemp("fuzz")
    config = write_config(
        directory,
        cpu="16MiB",
        ssd="64MiB",
        allocation_timeout_s=2.0,
        lease_s=2.0,
        max_object_bytes="32MiB",
        tenants=[{"name": "t1", "quota": {"cpu": "1MiB", "ssd": "2MiB"}}],
    )
    daemon = DaemonProcess(config, str(directory / "kvtierd.sock"), directory / "daemon.log")
    daemon.start()
    presets = [p.read_text() for p in sorted((REPO / "configs/policies").glob("*"))]
    pools = Pools(policies=[*presets, ALIAS_BOMB])
    pools.keys.extend(SEED_KEYS)
    pools.contexts.extend(["ctx0", "ctx1", "ctx2"])
    channel = grpc.insecure_channel(f"unix:{daemon.socket_path}")
    try:
        yield Target(daemon, channel, pools)
    finally:
        channel.close()
        daemon.kill()


SEED_KEYS = [f"k{i}" for i in range(8)]


def reseed(t: Target) -> None:
    """Put back the seed objects earlier runs deleted or evicted, so that every method meets
    a daemon holding contexts (an empty daemon is tested on its own, test_fuzz_findings)."""
    with KVClient(t.daemon.socket_path, timeout_s=CALL_TIMEOUT_S) as c:
        found = c.lookup(SEED_KEYS).found
        for i, (key, present) in enumerate(zip(SEED_KEYS, found, strict=True)):
            if not present:
                c.put(key, payload(key, 4096), context_id=f"ctx{i % 3}", durable=i % 2 == 0)


def _call(t: Target, m: Method, request: object, tenant: str, serialize: bool = True) -> object:
    """One call; returns the reply (or the last stream item) or raises ``grpc.RpcError``."""
    ser = m.request.SerializeToString if serialize else (lambda b: b)
    metadata = (("x-kvtierd-tenant", tenant),) if tenant else ()
    kw = {"timeout": CALL_TIMEOUT_S, "metadata": metadata}
    if m.client_streaming:
        stub = t.channel.stream_unary(m.path, ser, m.response.FromString)
        return stub(iter(request), **kw)  # type: ignore[call-overload]
    if m.server_streaming:
        stub = t.channel.unary_stream(m.path, ser, m.response.FromString)
        items = list(stub(request, **kw))
        return items[0] if items else None
    stub = t.channel.unary_unary(m.path, ser, m.response.FromString)
    return stub(request, **kw)


def _status(t: Target, m: Method, request: object, tenant: str, serialize: bool = True) -> str:
    """Problem text, or "" when the daemon answered with an acceptable status."""
    try:
        reply = _call(t, m, request, tenant, serialize)
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        if code in ACCEPTABLE:
            return ""
        return f"{m.path} answered {code.name}: {e.details()}"  # type: ignore[attr-defined]
    if reply is not None:
        t.pools.harvest(reply)
    return ""


def new_tracebacks(t: Target, since: int) -> str:
    """Tracebacks the daemon logged after byte ``since`` of its log (an unexpected exception,
    even one answered with an acceptable status)."""
    text = Path(t.daemon.log).read_bytes()[since:].decode(errors="replace")
    at = text.find("Traceback")
    return "" if at < 0 else text[max(0, at - 300) : at + 3000]


def assert_healthy(t: Target) -> None:
    assert t.daemon.proc is not None and t.daemon.proc.poll() is None, t.daemon.logs()[-3000:]
    health = health_pb2_grpc.HealthStub(t.channel)
    for service in ("", "kvtierd.v1.KVStore", "kvtierd.v1.Admin"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    # A fuzzed ApplyPolicy may have left any preset in force, and some keep nothing by design
    # (`prefill` caches no KV; EvicPress may drop a small context it prices cheaper to
    # recompute). That is a placement, not a fault: the probe runs on the target's own LRU.
    lru = Path(t.daemon.config).parent / "lru.yaml"
    _call(t, POLICY, pb.ApplyPolicyRequest(yaml=lru.read_text(), source=lru.name), "")
    with KVClient(t.daemon.socket_path, timeout_s=CALL_TIMEOUT_S) as c:
        status = c.status()
        assert status.health == "SERVING", status.health
        data = payload("health-probe", 8192)
        c.delete(["health-probe"])
        c.put("health-probe", data)
        assert bytes(c.get("health-probe")) == data


def _requests(m: Method, pools: Pools) -> st.SearchStrategy[object]:
    one = message(m.request.DESCRIPTOR, pools)
    if not m.client_streaming:
        return one
    return st.lists(one, max_size=5)


@pytest.mark.parametrize("m", METHODS, ids=lambda m: m.path.rsplit(".", 1)[-1])
def test_fuzz_method(target: Target, m: Method) -> None:
    problems: list[str] = []
    reseed(target)
    log_at = Path(target.daemon.log).stat().st_size

    @FUZZ_SETTINGS
    @given(request=_requests(m, target.pools), tenant=st.sampled_from(TENANTS))
    def run(request: object, tenant: str) -> None:
        problem = _status(target, m, request, tenant)
        if problem:
            problems.append(f"{problem}\n  request: {request!r}"[:2000])

    run()
    assert not problems, f"{len(problems)} bad answers; first:\n" + "\n".join(problems[:3])
    assert not new_tracebacks(target, log_at), new_tracebacks(target, log_at)
    assert_healthy(target)


@pytest.mark.parametrize("m", METHODS, ids=lambda m: m.path.rsplit(".", 1)[-1])
def test_garbage_bytes(target: Target, m: Method) -> None:
    """Bytes that are (mostly) not a valid message: INVALID_ARGUMENT, or any acceptable
    status when they happen to parse."""
    problems: list[str] = []
    frame = st.binary(max_size=300)
    body = st.lists(frame, max_size=4) if m.client_streaming else frame

    @settings(FUZZ_SETTINGS, max_examples=GARBAGE_EXAMPLES)
    @given(request=body)
    def run(request: object) -> None:
        problem = _status(target, m, request, "", serialize=False)
        if problem:
            problems.append(f"{problem}\n  bytes: {request!r}"[:2000])

    run()
    assert not problems, f"{len(problems)} bad answers; first:\n" + "\n".join(problems[:3])
    assert_healthy(target)


def test_still_healthy_after_all_methods(target: Target) -> None:
    """Runs last in this module: after every method's fuzzing the daemon still serves."""
    assert_healthy(target)
