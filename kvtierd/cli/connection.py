"""How kvtierctl reaches the daemon: a Unix socket by default, TCP + TLS + token when asked.

Resolution order for the socket: ``--socket``, ``$KVTIERD_SOCKET``, then the daemon's default
(``kvtierd.environment.default_socket_path()``, ``<runtime dir>/kvtierd.sock``).
``--address HOST:PORT`` switches to TCP, always over TLS (``--tls-ca`` for a private CA; the
daemon refuses plain TCP), with ``authorization: Bearer <token>`` metadata from ``--token``,
``--token-file`` or ``$KVTIERD_TOKEN``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from kvtierd.cli.exit_codes import EXIT_OF_STATUS, CliError, ExitCode
from kvtierd.environment import default_socket_path
from kvtierd.rpc import kvtier_pb2_grpc

logger = logging.getLogger(__name__)

SOCKET_ENV = "KVTIERD_SOCKET"
TOKEN_ENV = "KVTIERD_TOKEN"
START_HINT = "start it with ./scripts/serve or kvtierd serve --config FILE"

Resp = TypeVar("Resp")


@dataclass(frozen=True, slots=True)
class Target:
    """Where the daemon is. ``address`` empty: the Unix socket ``socket_path``."""

    socket_path: str
    address: str = ""
    tls_ca: str = ""
    token: str = ""
    call_timeout_s: float = 120.0

    @property
    def uri(self) -> str:
        return self.address or f"unix:{self.socket_path}"

    @classmethod
    def resolve(
        cls,
        *,
        socket: str | None,
        address: str | None,
        tls_ca: str | None,
        token: str | None,
        token_file: str | None,
        timeout_s: float,
    ) -> Target:
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as e:
                raise CliError(ExitCode.INVALID, f"cannot read token file {token_file}: {e}") from e
        return cls(
            socket_path=socket or os.environ.get(SOCKET_ENV) or default_socket_path(),
            address=address or "",
            tls_ca=tls_ca or "",
            token=token or os.environ.get(TOKEN_ENV, ""),
            call_timeout_s=timeout_s,
        )


class AdminConnection:
    """Connected ``Admin`` (``stub``) and ``KVStore`` (``kv``, for ``queries add``) stubs;
    ``call`` turns gRPC errors into :class:`CliError`."""

    def __init__(self, target: Target) -> None:
        self.target = target
        # No channel_ready_future: its connectivity poller makes close() wait ~0.2 s. A failed
        # connection shows up as UNAVAILABLE from the first call instead (see rpc_error).
        self._channel = _open_channel(target)
        self.stub = kvtier_pb2_grpc.AdminStub(self._channel)
        self.kv = kvtier_pb2_grpc.KVStoreStub(self._channel)
        self._metadata = (("authorization", f"Bearer {target.token}"),) if target.token else ()

    def call(self, method: Callable[..., Resp], request: object) -> Resp:
        try:
            return method(request, timeout=self.target.call_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise rpc_error(e, self.target) from e

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_channel(target: Target) -> grpc.Channel:
    if not target.address:
        if not Path(target.socket_path).exists():
            raise CliError(ExitCode.UNREACHABLE, unreachable_message(target))
        return grpc.insecure_channel(target.uri)
    root = None
    if target.tls_ca:
        try:
            root = Path(target.tls_ca).read_bytes()
        except OSError as e:
            raise CliError(ExitCode.INVALID, f"cannot read --tls-ca {target.tls_ca}: {e}") from e
    return grpc.secure_channel(target.address, grpc.ssl_channel_credentials(root))


def unreachable_message(target: Target) -> str:
    if target.address:
        return f"cannot reach kvtierd at {target.address} (TLS); is the daemon listening there?"
    why = "no such socket" if not Path(target.socket_path).exists() else "no answer"
    return f"cannot reach kvtierd at unix:{target.socket_path} ({why}); {START_HINT}"


def rpc_error(e: grpc.RpcError, target: Target) -> CliError:
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (e.details() if isinstance(e, grpc.Call) else "") or str(code)
    # A daemon that dies mid-call reads as UNAVAILABLE with a transport message.
    gone = not target.address and not Path(target.socket_path).exists()
    if code is grpc.StatusCode.UNAVAILABLE and (gone or _transport_failure(details)):
        return CliError(ExitCode.UNREACHABLE, unreachable_message(target))
    return CliError(EXIT_OF_STATUS.get(code.name, ExitCode.ERROR), f"{code.name}: {details}")


def _transport_failure(details: str) -> bool:
    """UNAVAILABLE raised by the gRPC transport (nobody listening) rather than by the daemon
    (draining, tier down): the daemon's messages never contain these phrases."""
    text = details.lower()
    return any(p in text for p in ("failed to connect", "connection refused", "socket closed",
                                   "connection reset", "no such file"))  # fmt: skip
