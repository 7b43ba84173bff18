"""On TCP nothing answers without a valid token: every method of every service the daemon
serves - KVStore and Admin from the proto, grpc.health, server reflection (a stream-stream
handler the auth interceptor once left unwrapped: issue 16.6) - whatever the request."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from benchmarks._support.daemon_proc import DaemonProcess, tcp_listener, write_config
from kvtierd.rpc import kvtier_pb2 as pb


@dataclass(frozen=True)
class Method:
    path: str
    client_streaming: bool
    server_streaming: bool
    request: Any  # an empty request message of the method


EXTRA = [
    Method("/grpc.health.v1.Health/Check", False, False, health_pb2.HealthCheckRequest()),
    Method("/grpc.health.v1.Health/Watch", False, True, health_pb2.HealthCheckRequest()),
    Method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True,
           reflection_pb2.ServerReflectionRequest(list_services="")),
]  # fmt: skip


def _methods() -> list[Method]:
    out = list(EXTRA)
    for service in pb.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            request = getattr(pb, m.input_type.name)()
            path = f"/{service.full_name}/{m.name}"
            out.append(Method(path, m.client_streaming, m.server_streaming, request))
    return out


@pytest.fixture(scope="module")
def tcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, bytes]]:
    directory = tmp_path_factory.mktemp("tcp-auth")
    tcp = tcp_listener(directory, "the-token")
    config = write_config(directory / "d", **tcp.settings)
    d = DaemonProcess(config, str(directory / "d" / "kvtierd.sock"), directory / "log").start()
    try:
        yield tcp.address(d), tcp.ca_file.read_bytes()
    finally:
        d.kill()


def _call(channel: grpc.Channel, m: Method) -> None:
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    stub = kinds[m.client_streaming, m.server_streaming](
        m.path, type(m.request).SerializeToString, lambda b: b
    )
    reply = stub(iter([m.request]) if m.client_streaming else m.request, timeout=10)
    if m.server_streaming:
        list(reply)


@pytest.mark.parametrize("token", ["", "wrong-token"], ids=["no-token", "wrong-token"])
@pytest.mark.parametrize("m", _methods(), ids=lambda m: m.path.rsplit("/", 1)[-1])
def test_every_method_needs_the_token(tcp: tuple[str, bytes], token: str, m: Method) -> None:
    address, ca = tcp
    creds = grpc.ssl_channel_credentials(ca)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    with grpc.secure_channel(address, creds) as channel, pytest.raises(grpc.RpcError) as refused:
        _call(channel, m)
    code, details = refused.value.code(), refused.value.details()  # type: ignore[attr-defined]
    assert code == grpc.StatusCode.UNAUTHENTICATED, (m.path, details)
