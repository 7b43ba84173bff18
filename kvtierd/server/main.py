"""``kvtierd`` command line: ``kvtierd serve [--config FILE]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from kvtierd.config import default_config, load_daemon_config
from kvtierd.errors import KvtierError
from kvtierd.heap import collector_paused, trim, tune_malloc

logger = logging.getLogger("kvtierd")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
            }
        )


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler()
    if as_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def limit_compute_threads(requested: int) -> int:
    """The threads torch may use in the daemon (profiling on the real model, compression):
    ``requested``, else ``OMP_NUM_THREADS`` when the operator set it, else half the CPU cores
    (at least 1). The daemon shares the host with vLLM: on the 2-core machine a profile using
    both cores beside vLLM's two OpenMP threads made hits take 6-10 s instead of 0.7 s
    (benchmarks/RESULTS.md, issue 13). Set before torch is imported (it reads the variables
    then), or on torch itself when it already is."""
    if requested > 0:
        threads = requested
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads


@contextlib.contextmanager
def gc_tuned_after_start() -> Iterator[None]:
    """Around the daemon's start: the collector tuned for the daemon after it. Fewer, later
    collections: the index holds many long-lived objects, and a full collection over them is a
    latency spike of milliseconds on whatever call it lands. Objects alive after start-up
    (modules, the rebuilt index) are moved out of the collector's sight. Not as few as
    (50,000, 20, 100): a full collection came once in 10^8 allocations, and the cycles of
    refused requests (exception, traceback, the frames holding the request) held 8 MiB each
    until then, over 1 GiB after 120 (issue 27.6; the interceptor now breaks those cycles).

    What is there before the start (modules, the configuration) is collected first; the start
    runs with the collector off, and what it made is frozen without a collection: one walked
    every object of the rebuilt index twice (the young collection once the collector was back
    on, then a full one) for ~2.9 s of a 1,000,000-object restart before the daemon answered,
    and found nothing to free (no unreachable object after ``Daemon.start`` at 100,000)."""
    gc.collect()
    with collector_paused():
        yield
        gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def tune_numpy() -> bool:
    """numpy's 2 MB pages off for the placer's large temporary arrays, unless the operator
    chose (``NUMPY_MADVISE_HUGEPAGE``); whether they are on now. numpy asks the kernel for
    huge pages on every array of 4 MiB or more, and the first touch of each made a 100k-context
    rebalance after a re-profile take 2.2-2.6 s of CPU instead of 1.96-1.97 s
    (benchmarks/RESULTS.md, issue 28)."""
    from numpy._core import multiarray

    advise: Callable[[bool], bool] = multiarray._set_madvise_hugepage  # type: ignore[attr-defined]
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:  # numpy read it at import
        on = advise(False)
        advise(on)
        return bool(on)
    advise(False)
    return False


async def _serve(config_path: str | None) -> None:
    config = load_daemon_config(config_path) if config_path else default_config()
    threads = limit_compute_threads(config.compute_threads)
    logger.info("compute: %d torch thread(s) for profiling and compression", threads)
    from kvtierd.server.app import Daemon

    if config_path is None:
        logger.info("no --config given: using the embedded default configuration")
    for tier in config.tiers:
        logger.info("tier %s (%s): %d bytes%s", tier.name, tier.kind, tier.capacity_bytes,
                    f" at {tier.path}" if tier.path else "")  # fmt: skip
    if not any(t.kind == "gpu" for t in config.tiers):
        logger.info("no gpu tier: CUDA is not available or not configured")
    daemon = Daemon(config)
    with gc_tuned_after_start():
        await daemon.start()
    trim("start-up")
    tune_numpy()
    await daemon.serve_until_stopped()


def main(argv: list[str] | None = None, *, exit_at_stop: bool = False) -> int:
    """Run the daemon until it is stopped; ``exit_at_stop`` (a process started to serve: the
    command line): end the process as soon as the daemon has stopped cleanly
    (:func:`exit_without_teardown`)."""
    parser = argparse.ArgumentParser(prog="kvtierd", description="multi-tier KV-cache daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="daemon YAML (default: the embedded configuration)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    serve.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    args = parser.parse_args(argv)
    _setup_logging(args.log_level, args.log_json)
    tune_malloc()
    try:
        asyncio.run(_serve(args.config))
    except KvtierError as e:
        print(f"kvtierd: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if exit_at_stop:
        exit_without_teardown(0)
    return 0


def exit_without_teardown(code: int) -> NoReturn:
    """End the process now, its logs and standard streams flushed. Called once the daemon has
    stopped: its tiers are closed and synced, its socket removed. What the interpreter's own
    teardown would do next is free the index object by object, 8-10 s after "kvtierd stopped"
    at 1,000,000 objects (issue 42), with nothing left to write."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(exit_at_stop=True))
