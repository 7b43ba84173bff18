"""``kvtierd router``: OpenAI-compatible proxy that loads compressed contexts into vLLM.

Entry point for the CLI: ``kvtierd.integrations.router.main(argv)``.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    from aiohttp import web

    from kvtierd.integrations.router.app import RouterConfig, make_app

    p = argparse.ArgumentParser(prog="kvtierd router", description=__doc__)
    p.add_argument("--upstream", required=True, help="vLLM server, e.g. http://127.0.0.1:8000")
    p.add_argument("--socket", default="", help="kvtierd socket (default: $KVTIERD_SOCKET)")
    p.add_argument(
        "--host", default="127.0.0.1",
        help="bind address (default loopback: the router has no authentication unless "
        "--token-file is given; bind elsewhere only with it, or behind a proxy that has)",
    )  # fmt: skip
    p.add_argument(
        "--token-file", default="",
        help="file holding a token every HTTP request must send as 'Authorization: Bearer'",
    )  # fmt: skip
    p.add_argument(
        "--tenant", default="",
        help="daemon tenant the router stores and looks up contexts as (default: the default "
        "tenant, whose served-request reports price every tenant's recomputes)",
    )  # fmt: skip
    p.add_argument("--port", type=int, default=8100, help="0: any free port (printed)")
    p.add_argument(
        "--port-file", type=Path,
        help="write the port listened on here once bound (with --port 0: how a parent learns it)",
    )  # fmt: skip
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk_size")
    p.add_argument("--hold-s", type=float, default=30.0, help="pin placeholder chunks this long")
    p.add_argument(
        "--lookup-timeout-s", type=float, default=2.0,
        help="wait this long for the daemon's manifest lookup of a production request, then "
        "send the real prompt",
    )  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.lookup_timeout_s <= 0:
        p.error(f"--lookup-timeout-s must be > 0, got {args.lookup_timeout_s}")
    token = ""
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            p.error(f"cannot read --token-file {args.token_file}: {e.strerror}")
        if not token:
            p.error(f"--token-file {args.token_file} is empty")
    config = RouterConfig(
        args.upstream.rstrip("/"), args.socket, args.chunk_size, args.hold_s,
        args.lookup_timeout_s, tenant=args.tenant, api_token=token,
    )  # fmt: skip
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"kvtierd router: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    port = int(sock.getsockname()[1])
    print(f"kvtierd router: listening on http://{args.host}:{port}", flush=True)
    if args.port_file is not None:
        # Written whole, then renamed: a reader never sees a partial number.
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(f"{port}\n")
        tmp.replace(args.port_file)
    web.run_app(make_app(config), sock=sock, print=None)
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound here, so that port 0 (any free port) can be read back before
    the app starts; handed to aiohttp as it is."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


__all__ = ["main"]
