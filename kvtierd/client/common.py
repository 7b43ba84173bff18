"""What the sync and asyncio clients share: connection settings, spec building, results."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtierd import errors
from kvtierd.environment import default_socket_path
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.rpc.framing import data_of

STREAM_PART_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20
RECONNECT_BACKOFF_MS = (100, 1000)
"""First and longest wait between reconnects to a daemon that went away. gRPC's defaults
(1 s growing to 120 s) kept a sidecar's client away 6-30 s after its daemon restarted (issue
32); a connect to a Unix socket or a nearby host costs microseconds, so trying every second
at most costs nothing and brings a restarted daemon back within about a second."""
CONNECT_TIMEOUT_MS = 20_000
"""How long one connection attempt may take, up to the daemon's HTTP/2 SETTINGS (gRPC's
default). gRPC reads it from ``grpc.min_reconnect_backoff_ms``, which despite its name sets no
backoff: set to 100 ms, a daemon busy for 100 ms on a loaded machine failed a new connection
and its first call as "cannot reach kvtierd". A daemon that is down refuses the connect at
once, so this wait costs only while the daemon runs; a call's own timeout still bounds it."""
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the daemon is. A Unix socket means co-located (bytes through shared memory);
    an ``address`` means TCP with TLS and a token (bytes streamed)."""

    socket_path: str = ""
    address: str = ""
    tls_ca_file: str = ""
    token: str = ""
    tls_cert_file: str = ""  # client certificate and key, for a daemon that requires mutual TLS
    tls_key_file: str = ""

    @staticmethod
    def resolve(
        socket_path: str | None = None,
        address: str | None = None,
        *,
        tls_ca_file: str = "",
        token: str = "",
        tls_cert_file: str = "",
        tls_key_file: str = "",
    ) -> Endpoint:
        if address:
            return Endpoint(
                address=address,
                tls_ca_file=tls_ca_file,
                token=token,
                tls_cert_file=tls_cert_file,
                tls_key_file=tls_key_file,
            )
        path = socket_path or os.environ.get("KVTIERD_SOCKET") or default_socket_path()
        return Endpoint(socket_path=path)

    @property
    def colocated(self) -> bool:
        return bool(self.socket_path)

    @property
    def target(self) -> str:
        return f"unix:{self.socket_path}" if self.socket_path else self.address

    def credentials(self) -> grpc.ChannelCredentials:
        ca = Path(self.tls_ca_file).read_bytes() if self.tls_ca_file else None
        key = Path(self.tls_key_file).read_bytes() if self.tls_key_file else None
        cert = Path(self.tls_cert_file).read_bytes() if self.tls_cert_file else None
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        if self.token:
            token_creds = grpc.access_token_call_credentials(self.token)
            return grpc.composite_channel_credentials(creds, token_creds)
        return creds


PLAN_RENAMED = (
    "KVClient.plan() / AsyncKVClient.plan() is deprecated: call advise() (KVStore.Advise), the "
    "write advice's new name; plan() will be removed in the next release"
)
"""What the clients' ``plan()`` warns, once per client: since issue 17 "plan" names only a
placer's list of operations (docs/vocabulary.md)."""


def advise_request(
    context_id: str, num_tokens: int, size_bytes: int, after_key: str = ""
) -> pb.AdviseRequest:
    """The ``KVStore.Advise`` request for one context (docs/daemon.md, "Write advice");
    ``after_key``: the chunk before the put's first one (the context it joins: issue 29)."""
    query = pb.AdviseQuery(
        context_id=context_id, num_tokens=num_tokens, size_bytes=size_bytes, after_key=after_key
    )
    return pb.AdviseRequest(contexts=[query])


GET_STREAM = "/kvtierd.v1.KVStore/GetStream"
PUT_STREAM = "/kvtierd.v1.KVStore/PutStream"


def encode_put_part(message: pb.PutPart | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode_get_part(data: bytes) -> pb.GetPart | memoryview:
    """A data frame becomes a zero-copy view of the received bytes; the header is parsed."""
    view = data_of(data)
    return pb.GetPart.FromString(data) if view is None else view


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``load_chunks``/``decision``/``reason``: the daemon's load-or-recompute decision, when
    the lookup asked for it (``decide``; else ``load_chunks`` is ``prefix_hits``)."""

    found: tuple[bool, ...]
    tiers: tuple[str, ...]
    prefix_hits: int
    load_chunks: int = 0
    decision: str = ""
    reason: str = ""


def lookup_result(resp: pb.LookupResponse) -> LookupResult:
    found = tuple(resp.found)
    names = tuple(resp.tiers)
    tiers = tuple(map(names.__getitem__, resp.tier_index))  # C loops: a 1,000-key batch
    if not all(found):
        tiers = tuple(t if f else "" for f, t in zip(found, tiers, strict=True))
    decided = bool(resp.decision)
    return LookupResult(
        found=found,
        tiers=tiers,
        prefix_hits=resp.prefix_hits,
        load_chunks=min(resp.load_chunks, resp.prefix_hits) if decided else resp.prefix_hits,
        decision=resp.decision,
        reason=resp.reason,
    )


_HANDSHAKE_TIMED_OUT = "connection attempt timed out before receiving SETTINGS frame"
"""gRPC's words for a connection the daemon accepted but did not answer in time: it runs."""


def domain_error(e: grpc.RpcError, endpoint: Endpoint) -> errors.KvtierError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    detail = e.details() if hasattr(e, "details") else str(e)
    if code is grpc.StatusCode.UNAVAILABLE and _HANDSHAKE_TIMED_OUT in (detail or ""):
        return errors.UnavailableError(
            f"kvtierd at {endpoint.target} accepted the connection but did not answer it within "
            f"{CONNECT_TIMEOUT_MS / 1000:g} s (overloaded or stopped?): {_HANDSHAKE_TIMED_OUT}"
        )
    if code is grpc.StatusCode.UNAVAILABLE and "connect" in (detail or "").lower():
        return errors.UnavailableError(
            f"cannot reach kvtierd at {endpoint.target}: is it running? "
            "(start it with ./scripts/serve or `kvtierd serve --config FILE`)"
        )
    return errors.error_class(code.name)(detail or code.name)


def spec(
    key: str,
    size_bytes: int,
    dtype: str,
    shape: tuple[int, ...],
    *,
    context_id: str,
    variant: str,
    layout: str,
    token_count: int,
    parent_context_id: str = "",
) -> pb.ObjectSpec:
    return pb.ObjectSpec(
        key=key,
        context_id=context_id,
        variant=variant,
        size_bytes=size_bytes,
        dtype=dtype,
        shape=list(shape),
        layout=layout,
        token_count=token_count,
        parent_context_id=parent_context_id,
    )
