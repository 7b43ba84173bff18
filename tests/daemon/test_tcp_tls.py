"""TCP is opt-in and then needs TLS and a bearer token: a client with the CA and the token
puts and gets (bytes streamed); a wrong or missing token is refused; the config without TLS is
rejected at start."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from benchmarks._support.daemon_proc import (
    DaemonProcess,
    certificate,
    tcp_listener,
    tcp_port,
    write_config,
)
from kvtierd import errors
from kvtierd.client import AsyncKVClient, KVClient


def test_tcp_with_tls_and_token(start_daemon, tmp_path):
    cert, key = certificate(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    d = start_daemon(
        tcp_address="127.0.0.1:0",  # any free port: the daemon's start-up line names it
        tls={"cert_file": str(cert), "key_file": str(key)},
        token_file=str(token_file),
    )
    port = tcp_port(d)
    assert port != 0
    x = np.arange(3 << 20, dtype=np.int32)
    with KVClient(address=f"localhost:{port}", tls_ca_file=str(cert), token="s3cret-token") as c:
        assert not c.use_arena  # another host's view: bytes are streamed
        c.put("remote-put", x, context_id="r")
        assert np.array_equal(c.get("remote-put"), x)
    with (
        KVClient(address=f"localhost:{port}", tls_ca_file=str(cert), token="wrong") as c,
        pytest.raises(errors.PermissionDeniedError, match="bearer token"),
    ):
        c.status()
    with KVClient(d.socket_path) as c:  # the Unix socket needs no token
        assert c.lookup(["remote-put"]).found == (True,)

    async def async_round_trip() -> None:
        async with AsyncKVClient(
            address=f"localhost:{port}", tls_ca_file=str(cert), token="s3cret-token"
        ) as ac:
            await ac.put("remote-aput", x[::-1].copy(), context_id="r")
            assert np.array_equal(await ac.get("remote-aput"), x[::-1])
            assert np.array_equal(await ac.get("remote-put"), x)
            with pytest.raises(errors.InvalidArgumentError, match="bytes for a"):
                await ac.get("remote-put", out=np.empty(x.size + 1, np.int32))

    asyncio.run(async_round_trip())


def test_mutual_tls_requires_a_client_certificate(start_daemon, tmp_path):
    ca = certificate(tmp_path)
    ca_path = ca[0]
    server_cert, server_key = certificate(tmp_path, "server", issuer=ca)
    client_cert, client_key = certificate(tmp_path, "client", issuer=ca)
    (tmp_path / "token").write_text("t0ken")
    d = start_daemon(
        tcp_address="127.0.0.1:0",
        tls={"cert_file": str(server_cert), "key_file": str(server_key),
             "client_ca_file": str(ca_path)},
        token_file=str(tmp_path / "token"),
    )  # fmt: skip
    addr = f"localhost:{tcp_port(d)}"
    with KVClient(address=addr, tls_ca_file=str(ca_path), token="t0ken", timeout_s=5,
                  tls_cert_file=str(client_cert), tls_key_file=str(client_key)) as c:  # fmt: skip
        c.put("m", b"mutual")
        assert bytes(c.get("m")) == b"mutual"
    with (
        KVClient(address=addr, tls_ca_file=str(ca_path), token="t0ken", timeout_s=5) as c,
        pytest.raises(errors.UnavailableError),
    ):
        c.status()  # no client certificate: the TLS handshake fails


def test_tcp_without_tls_is_refused(tmp_path):
    config = write_config(tmp_path, tcp_address="127.0.0.1:1")
    d = DaemonProcess(config, str(tmp_path / "kvtierd.sock"), tmp_path / "log")
    with pytest.raises(RuntimeError, match="requires both tls"):
        d.start(timeout_s=20)


def test_reflection_needs_the_token_on_tcp(start_daemon, tmp_path):
    """Issue 16 (6): stream-stream handlers (server reflection) were not wrapped by the auth
    interceptor, so reflection answered without a token while every other method refused."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    tcp = tcp_listener(tmp_path)
    d = start_daemon(**tcp.settings)
    request = reflection_pb2.ServerReflectionRequest(list_services="")

    def services(token: str) -> list[str]:
        creds = grpc.ssl_channel_credentials(tcp.ca_file.read_bytes())
        if token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token)
            )
        with grpc.secure_channel(tcp.address(d), creds) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
            return [s.name for s in reply.list_services_response.service]

    for token in ("", "wrong"):
        with pytest.raises(grpc.RpcError) as refused:
            services(token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "kvtierd.v1.KVStore" in services("t0ken")
