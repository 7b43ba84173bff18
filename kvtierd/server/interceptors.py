"""Server interceptors: one maps :mod:`kvtierd.errors` to gRPC status codes, one checks the
bearer token on TCP listeners.

The error interceptor wraps every method handler of every kind (unary and streaming either way:
authentication must not depend on how a method streams), so servicers raise domain errors and
never call ``rpc_context.abort`` themselves (``rpc_context``: gRPC's ``ServicerContext``, named
apart from kvtierd's contexts). Anything else that escapes becomes ``INTERNAL`` with the
exception's class and message (logged with its traceback here, never sent to the client).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from kvtierd import errors
from kvtierd.server.identity import CALLER, Caller

logger = logging.getLogger(__name__)


def status_of(error: BaseException) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, errors.status_name(error))  # type: ignore[no-any-return]


ErrorHook = Callable[[grpc.StatusCode], None]


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can answer
    INVALID_ARGUMENT (a deserializer that raises makes gRPC answer UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


# Bytes one request message of a method may have, below the server's max_receive_message_length
# (app.py): a method whose requests are small refuses a large one before parsing it (an 8 MiB
# request_id cost the daemon its size several times over, issue 27.6).
MAX_REQUEST_BYTES = {
    "/kvtierd.v1.KVStore/ReportServed": 1 << 10,
    "/kvtierd.v1.KVStore/AddQueries": 1 << 20,
    "/kvtierd.v1.KVStore/SetContextTokens": 8 << 20,  # 2^20 ids of up to 5 bytes, and ids
    "/kvtierd.v1.KVStore/Advise": 4 << 20,
    "/kvtierd.v1.KVStore/Plan": 4 << 20,
    "/kvtierd.v1.Admin/ApplyPolicy": 1 << 20,
}


def _tolerant(
    deserialize: Callable[[bytes], Any] | None, method: str
) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    limit = MAX_REQUEST_BYTES.get(method)

    def parse(data: bytes) -> Any:
        if limit is not None and len(data) > limit:
            return _Malformed(
                errors.CapacityError(
                    f"a request to {method} of {len(data)} bytes; at most {limit} bytes"
                )
            )
        try:
            return deserialize(data)
        except Exception as e:
            return _Malformed(e)

    return parse


def _check(request: Any, method: str) -> Any:
    if isinstance(request, _Malformed):
        if isinstance(request.error, errors.KvtierError):
            raise request.error
        raise errors.InvalidArgumentError(f"malformed request to {method}: {request.error}")
    return request


def _passthrough(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """Let handlers yield pre-serialized frames (bytes) next to messages: the data path
    builds its stream parts' frames itself, which saves one copy of every part."""
    if serialize is None:
        return None

    def encode(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return encode


async def _checked(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        yield _check(request, method)


Identify = Callable[[Any], Caller]
Prepare = Callable[[Any, str], Any]  # the request(s) as the handler gets them: _check, _checked
ADMIN_PREFIX = "/kvtierd.v1.Admin/"


class ErrorInterceptor(aio.ServerInterceptor):
    """Identifies the caller (into :data:`CALLER`), then runs the handler and maps domain
    errors to status codes."""

    def __init__(self, identify: Identify, on_error: ErrorHook | None = None) -> None:
        self._identify = identify
        self._on_error = on_error

    def _enter(self, rpc_context: Any, method: str) -> None:
        caller = self._identify(rpc_context.invocation_metadata())
        if method.startswith(ADMIN_PREFIX) and not caller.admin:
            raise errors.PermissionDeniedError(
                f"tenant {caller.tenant!r} may not call the Admin service (needs admin: true)"
            )
        CALLER.set(caller)

    async def _fail(self, rpc_context: Any, method: str, e: Exception) -> None:
        code = status_of(e)
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("%s failed", method)
            message = f"internal error in {method}: {type(e).__name__}: {e}"
        else:
            message = str(e)
        if self._on_error is not None:
            self._on_error(code)
        # The abort raises from here: its traceback and ``e``'s hold the handler's frames, in
        # cycles gRPC and asyncio keep until a full collection, which a large request (one
        # Python object) does nothing to bring on: 120 refused 8 MiB requests kept over
        # 1 GiB (issue 27.6). So the frames let the request go first (``handle``), and the
        # servicer's frames go with ``e``'s traceback.
        e.__traceback__ = None
        await rpc_context.abort(code, message)

    def _one_reply(self, inner: Any, method: str, prepare: Prepare) -> Any:
        """A unary-reply handler (unary or streamed requests) run as :meth:`_enter` allows."""

        async def handle(request: Any, rpc_context: Any) -> Any:
            try:
                self._enter(rpc_context, method)
                return await inner(prepare(request, method), rpc_context)
            except Exception as e:
                request = None  # freed now, not with the cycles of the abort: see _fail
                await self._fail(rpc_context, method, e)

        return handle

    def _replies(self, inner: Any, method: str, prepare: Prepare) -> Any:
        """A streaming-reply handler (unary or streamed requests), likewise."""

        async def handle(request: Any, rpc_context: Any) -> AsyncIterator[Any]:
            try:
                self._enter(rpc_context, method)
                async for item in inner(prepare(request, method), rpc_context):
                    yield item
            except Exception as e:
                request = None  # freed now, not with the cycles of the abort: see _fail
                await self._fail(rpc_context, method, e)

        return handle

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        method, reply = details.method, handler.response_serializer
        parse = _tolerant(handler.request_deserializer, method)
        if handler.unary_unary:
            wrapped = self._one_reply(handler.unary_unary, method, _check)
            return grpc.unary_unary_rpc_method_handler(wrapped, parse, reply)
        if handler.stream_unary:
            wrapped = self._one_reply(handler.stream_unary, method, _checked)
            return grpc.stream_unary_rpc_method_handler(wrapped, parse, reply)
        if handler.unary_stream:
            wrapped = self._replies(handler.unary_stream, method, _check)
            return grpc.unary_stream_rpc_method_handler(wrapped, parse, _passthrough(reply))
        # Stream-stream (server reflection): left unwrapped, it answered on TCP without a token.
        wrapped = self._replies(handler.stream_stream, method, _checked)
        return grpc.stream_stream_rpc_method_handler(wrapped, parse, reply)
