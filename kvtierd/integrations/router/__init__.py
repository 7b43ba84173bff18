"""``kvtierd router``: OpenAI-compatible proxy that loads compressed contexts into vLLM.

Entry point for the CLI: ``kvtierd.integrations.router.main(argv)``.
"""

from __future__ import annotations

import argparse
import logging
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
    p.add_argument("--port", type=int, default=8100)
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
    web.run_app(make_app(config), host=args.host, port=args.port, print=None)
    return 0


__all__ = ["main"]
