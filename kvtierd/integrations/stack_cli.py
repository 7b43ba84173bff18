"""``kvtierd stack``: the whole serving path with one command — the daemon, vLLM with LMCache and
the kvtierd plugin, and ``kvtierd router`` in front (docs/integration.md).

This module is the command line: its flags, the model it fetches, the signals that stop it and
what it prints; the supervisor it drives (starting, watching and stopping the three parts) is
``stack.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from kvtierd.errors import ConfigError, KvtierError
from kvtierd.integrations.stack import INTEGRATIONS, LOG_LEVELS, Stack, StackConfig, tail


def main(argv: list[str]) -> int:
    """``kvtierd stack``: start daemon + vLLM + router, print where each listens, run until
    Ctrl-C or until a part exits."""
    import argparse

    p = argparse.ArgumentParser(prog="kvtierd stack", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="smollm2",
        help="a checkpoint folder, or 'smollm2' (fetched by `kvtierd model fetch`)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp") / f"kvtierd-stack-{os.getuid()}",
        help="logs, generated configs, the daemon's socket and data",
    )
    p.add_argument("--config", type=Path, help="daemon YAML (default: one written in --work-dir)")
    p.add_argument("--cpu", default="2GiB", help="CPU tier size when no --config")
    p.add_argument("--ssd", default="16GiB", help="SSD tier size when no --config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="the router (send requests here)")
    p.add_argument("--vllm-port", type=int, default=8000)
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk_size")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--served-model-name",
        default="",
        help="a short name requests may give as 'model', beside the checkpoint's path "
        "(default: --model when it is a short name such as 'smollm2', else the folder's name)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM-CPU's own KV cache")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn off vLLM's own prefix cache: every reuse goes through kvtierd",
    )
    p.add_argument(
        "--integration",
        choices=INTEGRATIONS,
        default="connector",
        help="connector: LMCache in vLLM with the kvtierd plugin, and the router; offloading: "
        "vLLM's --kv-offloading-backend lmcache to an LMCache server whose L2 is kvtierd",
    )
    p.add_argument(
        "--offloading-gib",
        type=float,
        default=1.0,
        help="with --integration offloading: the LMCache server's own memory (its L1), GiB",
    )
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM argument")
    p.add_argument(
        "--daemon-log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the daemon's log level (debug: every plan operation it runs, and why)",
    )
    args = p.parse_args(argv)  # fmt: skip
    try:
        config = StackConfig(
            model=_model_path(args.model), work_dir=args.work_dir, daemon_config=args.config,
            cpu=args.cpu, ssd=args.ssd, host=args.host, vllm_port=args.vllm_port,
            router_port=args.port, chunk_size=args.chunk_size, max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib, prefix_caching=not args.no_prefix_caching,
            vllm_args=tuple(args.vllm_arg), daemon_log_level=args.daemon_log_level,
            served_name=args.served_model_name or _short_name(args.model),
            integration=args.integration, lmcache_cpu_gb=args.offloading_gib,
        )  # fmt: skip
    except KvtierError as e:
        print(f"kvtierd stack: {e}", file=sys.stderr)
        return 2
    before = {signum: signal.signal(signum, _stop_on_signal)
              for signum in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    stack = Stack(config)
    try:
        print(f"kvtierd stack: starting (logs in {config.work_dir}) ...", flush=True)
        if (choice := stack.dtype_choice()) is not None:
            print(f"kvtierd stack: vLLM dtype {choice.dtype} ({choice.reason}; "
                  "--vllm-arg --dtype=... overrides)", flush=True)  # fmt: skip
        stack.start()
        for name, where, log in stack.describe():
            print(f"kvtierd stack: {name:6s} {where}  (log {log})", flush=True)
        count = {3: "three", 2: "two"}.get(len(stack.parts), str(len(stack.parts)))
        print(f"kvtierd stack: ready; send OpenAI requests to {stack.serve_url}/v1 (model "
              f"{stack.served_name!r}); Ctrl-C stops all {count}", flush=True)  # fmt: skip
        print(f"kvtierd stack: try: {stack.example_request()}", flush=True)
        while (failed := stack.failed_part()) is None:
            time.sleep(0.5)
        print(
            f"kvtierd stack: {failed.name} exited with {failed.proc.returncode}; stopping the "
            f"others. Its log ({failed.log}):\n{tail(failed.log)}",
            file=sys.stderr,
        )
        return 1
    except _Stop:
        return 0
    except KvtierError as e:
        print(f"kvtierd stack: {e}", file=sys.stderr)
        return 1
    finally:
        for signum in before:  # a second Ctrl-C must not cut the stop
            signal.signal(signum, signal.SIG_IGN)
        stack.stop()
        for signum, handler in before.items():  # a caller's own (a test's process) again
            signal.signal(signum, handler)
        print("kvtierd stack: stopped", flush=True)


class _Stop(Exception):  # noqa: N818 - a signal, not an error
    """Ctrl-C or SIGTERM: leave whatever the stack is doing and stop every part."""


def _stop_on_signal(signum: int, frame: object) -> None:
    raise _Stop


def _short_name(model: str) -> str:
    """``--model``'s own name when it names a fetched model (``smollm2``), else its folder's
    name."""
    from kvtierd.model_fetch import MODELS

    return model if model in MODELS and not Path(model).is_dir() else Path(model).name


def _model_path(model: str) -> Path:
    if Path(model).is_dir():
        return Path(model)
    from kvtierd.model_fetch import MODELS, fetch_model

    if model in MODELS:
        return fetch_model(model, log=lambda line: print(f"kvtierd model: {line}", flush=True))
    raise ConfigError(f"--model {model!r} is neither a checkpoint folder nor one of "
                      f"{', '.join(sorted(MODELS))}")  # fmt: skip
