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
import stat
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtierd.config import DaemonConfig, TlsConfig
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
# Bounded at the transport: gRPC refuses a larger request (RESOURCE_EXHAUSTED) before reading
# it. A stream part is 4 MiB (MAX_PART_BYTES 16 at most), a batch of keys a few MiB; smaller
# bounds per method: interceptors.MAX_REQUEST_BYTES.
MAX_RECEIVE_BYTES = 24 << 20
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _private_directory(directory: Path) -> None:
    """The socket's directory: created 0700; one that exists must not let other users replace
    the socket. Writable by others without the sticky bit (a shared ``/tmp`` has it) it is set
    to 0700 when it is the daemon user's, and refused when it is not."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = directory.stat()
    if not st.st_mode & 0o022 or st.st_mode & stat.S_ISVTX:
        return
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"socket directory {directory} is writable by other users and belongs to uid "
            f"{st.st_uid}: another user could replace the socket; use a socket_path in a "
            "directory of the daemon's user"
        )
    os.chmod(directory, 0o700)
    logger.warning("socket directory %s was mode %o: set to 0700", directory,
                   stat.S_IMODE(st.st_mode))  # fmt: skip


def _prepare_socket(path: Path) -> None:
    """A private runtime dir; refuse to start over a live daemon; clear a stale socket."""
    _private_directory(path.parent)
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


def _read_tls(tls: TlsConfig) -> tuple[bytes, bytes, bytes | None]:
    """Key, certificate and client CA (for mutual TLS) of the TCP listener, read before
    anything starts: a missing file is a clean start-up error, not a traceback after the Unix
    socket was bound."""

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read tls.{name} {path}: {e.strerror}") from e

    ca = read("client_ca_file", tls.client_ca_file) if tls.client_ca_file else None
    return read("key_file", tls.key_file), read("cert_file", tls.cert_file), ca


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.health = HealthMonitor(self.engine)
        self.identities = Identities(config)
        self.servers: list[aio.Server] = []
        # The TCP address listened on, its port as bound: a configured port 0 is any free port,
        # and the start-up line names the one grpc took (tests read it there).
        self.tcp_address = ""
        self.socket_path = Path(config.socket_path)
        self.health_port = 0  # bound port of ``health_address``, when configured
        self.metrics_url = ""  # http://host:PORT/metrics as bound, when metrics_port is set
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
        """Start everything, or nothing: a start that fails part-way stops what it started
        and removes the socket it bound, so the error is all that is left."""
        tls = _read_tls(self.config.tls) if self.config.tcp_address and self.config.tls else None
        await self.engine.start()
        try:
            await self._listen(tls)
        except BaseException:
            await asyncio.gather(*(s.stop(None) for s in self.servers))
            self.servers.clear()
            await self.engine.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            raise
        self.health.start()
        logger.info("kvtierd %s serving on unix:%s%s%s (placer %s, tiers: %s)",
                    self.engine.instance_id, self.socket_path,
                    f" and tcp {self.tcp_address}" if self.tcp_address else "",
                    f" and metrics {self.metrics_url}" if self.metrics_url else "",
                    self.engine.placer_name, ", ".join(self.engine.tiers))  # fmt: skip

    async def _listen(self, tls: tuple[bytes, bytes, bytes | None] | None) -> None:
        _prepare_socket(self.socket_path)
        if self.config.metrics_port:
            wanted = 0 if self.config.metrics_port == "any" else self.config.metrics_port
            host = self.config.metrics_address
            port = self.engine.metrics.start_http_server(wanted, host)
            self.metrics_url = f"http://{host}:{port}/metrics"
        unix = self._server([self._interceptor(self.identities.unix)])
        old = os.umask(0o177)  # the socket file is created 0600, no window with wider bits
        try:
            unix.add_insecure_port(f"unix:{self.socket_path}")  # binds here
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on unix:{self.socket_path}: {e}") from e
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        await unix.start()
        self.servers.append(unix)
        if self.config.tcp_address:
            self.servers.append(await self._start_tcp(tls))
        if self.config.health_address:
            self.servers.append(await self._start_health())

    async def _start_health(self) -> aio.Server:
        """Plain-text gRPC with only ``grpc.health.v1`` (Kubernetes' ``grpc`` probes): it says
        whether the daemon serves, nothing else, so it needs neither TLS nor a token."""
        server = aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        try:
            self.health_port = server.add_insecure_port(self.config.health_address)
        except RuntimeError as e:
            raise ConfigError(
                f"cannot listen on health_address {self.config.health_address}: {e}"
            ) from e
        await server.start()
        host = self.config.health_address.rpartition(":")[0]
        logger.info("grpc health (only) on %s:%d", host, self.health_port)
        return server

    async def _start_tcp(self, tls: tuple[bytes, bytes, bytes | None] | None) -> aio.Server:
        if tls is None or not self.config.token_file:
            raise ConfigError("tcp_address requires tls and token_file")
        key, cert, ca = tls
        server = self._server([self._interceptor(self.identities.tcp)])
        try:
            creds = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
            )
            port = server.add_secure_port(self.config.tcp_address, creds)
        except RuntimeError as e:  # grpc refuses the key/certificate, or cannot bind
            given = self.config.tls
            tls_files = f"{given.key_file}, {given.cert_file}" if given else ""
            raise ConfigError(
                f"cannot listen on tcp {self.config.tcp_address}: grpc refused the TLS key or "
                f"certificate ({tls_files}) or the address is taken: {e}"
            ) from e
        await server.start()
        host = self.config.tcp_address.rsplit(":", 1)[0]
        self.tcp_address = f"{host}:{port}"
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
        await self.health.update()  # NOT_SERVING at once: probes stop sending work here
        await asyncio.gather(*(s.stop(GRACE_S) for s in self.servers))
        await self.health.stop()
        await self.engine.close(flush_s=self.config.shutdown_flush_s)
        self.engine.metrics.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        logger.info("kvtierd stopped")
