"""``python -m kvtierd.server.health_probe ADDRESS``: exit 0 when the daemon at ``ADDRESS``
(``host:port`` of ``health_address``, or ``unix:/path/to/kvtierd.sock``) answers
``grpc.health.v1`` with SERVING, else 1 with the reason on stderr. For probes that run a
command (Docker's ``HEALTHCHECK``); Kubernetes' ``grpc`` probe asks the port itself."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def serving(address: str, timeout_s: float = TIMEOUT_S) -> str:
    """``""`` when SERVING, else what is wrong."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as e:
            return f"{address}: {e.code().name}: {e.details()}"
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvtierd.server.health_probe HOST:PORT|unix:PATH", file=sys.stderr)
        return 2
    problem = serving(args[0])
    if problem:
        print(f"kvtierd not serving: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
