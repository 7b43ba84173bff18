"""The daemon process: the engine behind grpc.aio servers on a Unix socket (and optional TCP).

Start-up: tiers start (the SSD index is rebuilt from its files), the Unix socket is bound with
mode 0600 in a 0700 runtime directory; TCP only when configured, always with TLS and a bearer
token. Shutdown on SIGTERM/SIGINT: refuse new work, let in-flight calls finish (grace period),
stop the executor, close the tiers (flushing the SSD tier), remove the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtierd.config import DaemonConfig
from kvtierd.engine import Engine
from kvtierd.errors import ConfigError
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc import kvtier_pb2_grpc as pb_grpc
from kvtierd.server.admin import AdminServicer
from kvtierd.server.health import HealthMonitor
from kvtierd.server.identity import Identities
from kvtierd.server.interceptors import ErrorInterceptor, Identify
from kvtierd.server.kvstore import KVStoreServicer

logger = logging.getLogger(__name__)

GRACE_S = 5.0
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _prepare_socket(path: Path) -> None:
    """Create the runtime dir (0700); refuse to start over a live daemon; clear a stale socket."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a leftover from a crash
    else:
        raise ConfigError(f"another kvtierd is already serving on {path}")
    finally:
        probe.close()


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.health = HealthMonitor(self.engine)
        self.identities = Identities(config)
        self.servers: list[aio.Server] = []
        self.socket_path = Path(config.socket_path)
        self._stop = asyncio.Event()

    def _interceptor(self, identify: Identify) -> ErrorInterceptor:
        return ErrorInterceptor(identify, lambda code: self.engine.metrics.record_error(code.name))

    def _server(self, interceptors: list[aio.ServerInterceptor]) -> aio.Server:
        server = aio.server(interceptors=interceptors, options=_OPTIONS)
        pb_grpc.add_KVStoreServicer_to_server(KVStoreServicer(self.engine), server)
        pb_grpc.add_AdminServicer_to_server(AdminServicer(self.engine, self.health), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        names = (
            pb.DESCRIPTOR.services_by_name["KVStore"].full_name,
            pb.DESCRIPTOR.services_by_name["Admin"].full_name,
            "grpc.health.v1.Health",
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        return server

    async def start(self) -> None:
        await self.engine.start()
        _prepare_socket(self.socket_path)
        if self.config.metrics_port:
            port = self.engine.metrics.start_http_server(self.config.metrics_port)
            logger.info("metrics on http://127.0.0.1:%d/metrics", port)
        unix = self._server([self._interceptor(self.identities.unix)])
        old = os.umask(0o177)  # the socket file is created 0600, no window with wider bits
        try:
            unix.add_insecure_port(f"unix:{self.socket_path}")  # binds here
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        await unix.start()
        self.servers.append(unix)
        if self.config.tcp_address:
            self.servers.append(await self._start_tcp())
        self.health.start()
        logger.info("kvtierd %s serving on unix:%s%s (placer %s, tiers: %s)",
                    self.engine.instance_id, self.socket_path,
                    f" and tcp {self.config.tcp_address}" if self.config.tcp_address else "",
                    self.engine.placer.name, ", ".join(self.engine.tiers))  # fmt: skip

    async def _start_tcp(self) -> aio.Server:
        tls = self.config.tls
        if tls is None or not self.config.token_file:
            raise ConfigError("tcp_address requires tls and token_file")
        ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
        creds = grpc.ssl_server_credentials(
            [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )
        server = self._server([self._interceptor(self.identities.tcp)])
        server.add_secure_port(self.config.tcp_address, creds)
        await server.start()
        return server

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_until_stopped(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self._stop.wait()
        await self.stop()

    async def stop(self) -> None:
        logger.info("kvtierd shutting down: finishing in-flight calls")
        self.engine.draining = True
        await asyncio.gather(*(s.stop(GRACE_S) for s in self.servers))
        await self.health.stop()
        await self.engine.close()
        self.engine.metrics.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        logger.info("kvtierd stopped")
