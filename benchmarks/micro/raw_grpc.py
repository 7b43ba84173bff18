"""A raw-bytes gRPC server (no protobuf) — the baseline the daemon's streams are held to.

Run as ``python -m benchmarks.micro.raw_grpc SOCKET`` (bench_daemon starts it): methods
/raw.Raw/Empty (unary), /raw.Raw/Put (client stream of byte parts) and /raw.Raw/Get (server
stream: the request is the total size as ASCII, answered in 4 MiB parts from a reused buffer).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

PART = 4 << 20
OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


async def _empty(request: bytes, context: Any) -> bytes:
    return b""


async def _put(requests: AsyncIterator[bytes], context: Any) -> bytes:
    total = 0
    async for part in requests:
        total += len(part)
    return str(total).encode()


async def _get(request: bytes, context: Any) -> AsyncIterator[bytes]:
    size = int(request.decode())
    block = b"\x01" * PART
    for start in range(0, size, PART):
        yield block[: min(PART, size - start)]


async def serve(socket_path: str) -> None:
    server = aio.server(options=OPTIONS)
    handlers = {
        "Empty": grpc.unary_unary_rpc_method_handler(_empty),
        "Put": grpc.stream_unary_rpc_method_handler(_put),
        "Get": grpc.unary_stream_rpc_method_handler(_get),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("raw.Raw", handlers),))
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    await server.wait_for_termination()


# No ``main()``: this is the baseline server, not a benchmark that prints figures (and its machine).
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", help="Unix socket path to serve on")
    asyncio.run(serve(parser.parse_args().socket))
