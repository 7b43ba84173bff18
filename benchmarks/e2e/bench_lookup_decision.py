"""Load or recompute on a throttled tier (issue 41): TTFT with the daemon's decision against
always-load and always-recompute, on real vLLM-CPU + LMCache + kvtierd (+ its router, whose
reports teach the daemon vLLM's prefill speed).

    python -m benchmarks.e2e.bench_lookup_decision [--contexts 4] [--rounds 3]

Per mode (``lookup_decision``: ``load``, ``recompute``, ``decide``) a fresh stack: a daemon
with a remote tier behind a throttled proxy (``benchmarks/_support/throttled_proxy.py``, a
one-node Redis Cluster; ``--remote-mb-s``) and vLLM without its own prefix cache (every
repeat goes through LMCache's lookup). Warm-up: prompts of several lengths teach the router's
prefill fit; ``--contexts`` "slow" contexts are stored, then every context is drained to the
remote tier; ``--contexts`` "fast" contexts are stored in the CPU tier. Measured: ``--rounds``
rounds of every context once (fast and slow alternating), TTFT of each (one generated token).
Always-load loses on the slow contexts (its loads are slower than their prefill),
always-recompute on the fast ones; the decision should be no worse than the better of the
two in each class. Prints mean TTFT per mode and class with 95% bootstrap intervals, and the
ratio of the decision's overall mean to the better fixed mode's (limit 1.1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks._support.common import print_machine, verdict
from benchmarks._support.daemon_proc import write_config
from benchmarks._support.throttled_proxy import throttled_redis
from benchmarks.e2e.e2e_stats import bootstrap
from kvtierd.client import KVClient

MODES = ("load", "recompute", "decide")
LIMIT = 1.1


def _prompt(seed: int, tokens: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, 20000, size=tokens)]


def _ttft(url: str, model: str, prompt: list[int]) -> float:
    import urllib.request

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - started


def run_mode(args: argparse.Namespace, mode: str, work: Path) -> dict[str, list[float]]:
    from kvtierd.integrations.stack import Stack, StackConfig

    with throttled_redis(work / "redis", args.remote_mb_s * 1e6) as (address, _):
        remote = {"name": "remote", "kind": "remote", "capacity": 0,
                  "options": {"nodes": [address], "namespace": mode, "value_bytes": "1MiB",
                              "op_timeout_s": 120.0, "lookup_budget_s": 2.0}}  # fmt: skip
        daemon = write_config(work / "daemon", cpu="2GiB", ssd="4GiB", extra_tiers=[remote],
                              lookup_decision=mode)  # fmt: skip
        config = StackConfig(model=args.model, work_dir=work, daemon_config=daemon,
                             vllm_port=0, router_port=0, prefix_caching=False,
                             max_model_len=4096)  # fmt: skip
        with Stack(config) as stack:
            url, model = stack.router_url, str(args.model)
            for i, n in enumerate((256, 384, 512, 768, 1024, 256, 512, 1024, 768, 384)):
                _ttft(url, model, _prompt(10_000 + i, n))  # the router's prefill samples
            slow = [_prompt(i, args.tokens) for i in range(args.contexts)]
            fast = [_prompt(1000 + i, args.tokens) for i in range(args.contexts)]
            for p in slow:
                _ttft(url, model, p)
            with KVClient(stack.socket_path) as c:
                c.drain("cpu")
                c.drain("ssd")
            for p in fast:
                _ttft(url, model, p)
            out: dict[str, list[float]] = {"fast": [], "slow": []}
            for _ in range(args.rounds):
                for f, s in zip(fast, slow, strict=True):
                    out["fast"].append(_ttft(url, model, f))
                    out["slow"].append(_ttft(url, model, s))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: SmolLM2-135M)"
    )
    parser.add_argument("--contexts", type=int, default=4, help="contexts per class")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per context")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--remote-mb-s", type=float, default=4.0,
                        help="the throttled remote tier's reply rate, MB/s")  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-lookup-decision"))
    args = parser.parse_args(argv)
    if args.model is None:
        from kvtierd.model_fetch import fetch_model

        args.model = fetch_model(log=print)
    print_machine("bench_lookup_decision")
    runs = {mode: run_mode(args, mode, args.work / mode) for mode in MODES}
    means: dict[str, float] = {}
    for mode, per in runs.items():
        both = np.array(per["fast"] + per["slow"])
        means[mode] = float(both.mean())
        for cls, xs in (*per.items(), ("all", both.tolist())):
            print(f"{mode:>9} {cls:>4}: mean TTFT (s) {bootstrap(xs)} (n={len(xs)})")
    better = min(means["load"], means["recompute"])
    ratio = means["decide"] / better
    print(f"decide / better of load and recompute: {ratio:.3f} (limit {LIMIT}) "
          f"{verdict(ratio, LIMIT, higher_is_better=False)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
