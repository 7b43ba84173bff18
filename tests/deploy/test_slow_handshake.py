"""A daemon that is slow to answer a new connection is slow, not unreachable.

On a loaded 2-core machine a daemon can take longer than 100 ms to send its HTTP/2 SETTINGS
to a new connection. The client's channel once gave a connection attempt only 100 ms (gRPC
reads ``grpc.min_reconnect_backoff_ms`` as the minimum *connect timeout*, not a backoff), so
the call failed at once with "cannot reach kvtierd ... is it running?" while the daemon ran
(tests/fault/test_load.py saw it once under load). Modelled here without loading the machine:
a proxy in front of a real gRPC server holds the server's first bytes back.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvtierd.client import AsyncKVClient, KVClient
from kvtierd.client.common import CONNECT_TIMEOUT_MS, Endpoint, domain_error
from kvtierd.errors import UnavailableError
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

HANDSHAKE_DELAY_S = 0.5  # 5x the old connect timeout; far under the new one


class _Admin(pb_grpc.AdminServicer):
    def Status(  # noqa: N802 (the RPC's name, as gRPC calls it)
        self, request: pb.StatusRequest, context: grpc.ServicerContext
    ) -> pb.StatusResponse:
        return pb.StatusResponse(version="slow-but-alive")


class _SlowFirstBytes:
    """A Unix-socket proxy that forwards both ways, but holds the server's first bytes (its
    SETTINGS frame) back ``delay_s``: a daemon too busy to answer a new connection at once."""

    def __init__(self, listen_path: Path, backend_path: Path, delay_s: float) -> None:
        self.backend_path, self.delay_s = str(backend_path), delay_s
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(listen_path))
        self._listener.listen()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            backend.connect(self.backend_path)
            self._sockets += [client, backend]
            threading.Thread(target=self._pump, args=(client, backend, 0.0), daemon=True).start()
            args = (backend, client, self.delay_s)
            threading.Thread(target=self._pump, args=args, daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, first_delay_s: float) -> None:
        try:
            while data := src.recv(1 << 16):
                time.sleep(first_delay_s)
                first_delay_s = 0.0
                dst.sendall(data)
        except OSError:
            pass  # either side closed
        finally:
            dst.close()

    def close(self) -> None:
        for s in self._sockets:
            s.close()


@pytest.fixture
def slow_socket(tmp_path: Path) -> Iterator[str]:
    """The path of a Unix socket whose server answers each new connection 0.5 s late."""
    backend = tmp_path / "daemon.sock"
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_AdminServicer_to_server(_Admin(), server)
    server.add_insecure_port(f"unix:{backend}")
    server.start()
    proxy = _SlowFirstBytes(tmp_path / "slow.sock", backend, HANDSHAKE_DELAY_S)
    try:
        yield str(tmp_path / "slow.sock")
    finally:
        proxy.close()
        server.stop(0)


def test_sync_client_waits_for_a_slow_handshake(slow_socket: str) -> None:
    with KVClient(slow_socket, timeout_s=10) as client:
        t0 = time.monotonic()
        assert client.status().version == "slow-but-alive"
        assert time.monotonic() - t0 >= HANDSHAKE_DELAY_S  # the delay was really in the way


async def test_async_client_waits_for_a_slow_handshake(slow_socket: str) -> None:
    client = AsyncKVClient(slow_socket, timeout_s=10)
    try:
        assert (await client.status()).version == "slow-but-alive"
    finally:
        await client.close()


class _Unavailable(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def test_a_handshake_that_times_out_is_named_as_such() -> None:
    """A daemon that accepted the connection but never answered it is running: the message
    says so instead of asking whether it is."""
    endpoint = Endpoint(socket_path="/run/k.sock")
    late = _Unavailable(
        "failed to connect to all addresses; last error: UNKNOWN: unix:/run/k.sock: connection "
        "attempt timed out before receiving SETTINGS frame"
    )
    error = domain_error(late, endpoint)
    assert isinstance(error, UnavailableError)
    assert str(error) == (
        "kvtierd at unix:/run/k.sock accepted the connection but did not answer it within "
        f"{CONNECT_TIMEOUT_MS / 1000:g} s (overloaded or stopped?): connection attempt timed "
        "out before receiving SETTINGS frame"
    )
    refused = _Unavailable(
        "failed to connect to all addresses; last error: UNKNOWN: unix:/run/k.sock: Connection "
        "refused"
    )
    assert str(domain_error(refused, endpoint)).startswith(
        "cannot reach kvtierd at unix:/run/k.sock: is it running?"
    )
