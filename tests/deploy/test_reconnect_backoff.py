"""The client's reconnect backoff is bounded (issue 32): a channel that failed to connect for
12 s reaches a server that then appears within 1.5 s. With gRPC's defaults (1 s growing by 1.6x
to 120 s, +-20% jitter) its next attempt after 12 s of failures falls ~13.5-18 s after the
first, so the same check fails (4.3 s measured on this machine)."""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvtierd.client.common import CHANNEL_OPTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _answers(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return True


def test_channel_reaches_a_late_server_within_1_5s(tmp_path: Path) -> None:
    target = f"unix:{tmp_path / 'late.sock'}"
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        away_until = time.monotonic() + 12
        while time.monotonic() < away_until:
            assert not _answers(stub)
            time.sleep(0.25)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        server.add_insecure_port(target)
        server.start()
        up = time.monotonic()
        try:
            while not _answers(stub):
                assert time.monotonic() - up < 1.5, "the channel waited out a long backoff"
                time.sleep(0.05)
        finally:
            server.stop(0)
