"""Placer benchmarks (issues 4, 14): the share of the achievable gain each path reaches on every
instance family, the cost of an exact solve by size (the threshold), the gap to the LP bound,
rebalance and insert cost.

    .venv/bin/python -m benchmarks.micro.bench_placer [--instances 200] [--quick]

Instance families (``kvtierd/policies/families.py``): "paper" (simulator-calibrated contexts,
DRAM/SSD at ~10%/~40% of the bytes), "uniform" (independent random sizes/qualities, each 10-60%
of a tier), "trap" (large contexts against slightly better small ones that leave a gap), "tie"
(equal gain per byte: subset-sum packing), "slow_ssd" (an SSD about as slow as recomputing).
The achievable gain is ``opt - u_drop`` (``u_drop``: every context dropped, ``opt``: the MILP
optimum); a path's share is ``(u - u_drop) / (opt - u_drop)``. Goal: every instance >= 98% on
rebalance and >= 95% on online inserts (issue 14). Times are wall-clock on this machine and
also given as a ratio to a numpy pass over the same utility array (same process).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from benchmarks._support.common import machine, verdict
from benchmarks.micro.placer_daemon import run as daemon_rows
from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer, solve
from kvtierd.policies.exact import Problem, solve_exact
from kvtierd.policies.greedy_state import Selection
from kvtierd.policies.knapsack import greedy_assign, greedy_solve
from kvtierd.policies.model import UtilityTable
from kvtierd.policies.refine import RefineLimits, lagrangian_bound, refine
from kvtierd.sim.families import FAMILIES, merged_traps, paper
from kvtierd.sim.replay import PAPER_TIERS
from kvtierd.sim.variant_space import VariantSpace
from kvtierd.types import TierModel

REBALANCE_GOAL = 0.98
ONLINE_GOAL = 0.95

PATHS: dict[str, Callable[[UtilityTable], float]] = {
    "rebalance per_byte (greedy + refine)": lambda t: solve(t).total_utility(t),
    "rebalance absolute (Alg. 1 + refine)": lambda t: solve(t, Selection.ABSOLUTE).total_utility(t),
    "greedy alone (before issue 14)": lambda t: greedy_assign(t).total_utility(t),
    "online inserts per_byte (daemon)": lambda t: online(t, "per_byte"),
    "online inserts absolute": lambda t: online(t, "absolute"),
}
"""The paths measured, by name; a share below the goal fails the rows named rebalance/online
per_byte (the defaults)."""


def online(table: UtilityTable, selection: str) -> float:
    """The daemon's insert path: one insert at a time, in context order, into an empty placer."""
    tiers = [TierModel(str(t), c, 1.0) for t, c in enumerate(table.capacity_bytes)]
    placer = EvicPressPlacer(tiers, PlacerParams(selection=selection))
    for i in range(table.n_contexts):
        placer.insert_row(table, i)
    return placer.total_utility()


def family_shares(name: str, seeds: range, size: Callable[[int], int]) -> list[str]:
    """Every path's share of the achievable gain on ``name`` instances; the failing rows."""
    shares: dict[str, list[float]] = {p: [] for p in PATHS}
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    unproven, t_exact = 0, 0.0
    for seed in seeds:
        table = FAMILIES[name](seed, size(seed))
        t0 = time.perf_counter()
        exact = solve_exact(table, mip_rel_gap=1e-6, time_limit_s=120.0)
        t_exact += time.perf_counter() - t0
        # Unproven (time limit): measure against HiGHS's bound, which is at least the optimum.
        best = exact.objective if exact.optimal else exact.bound
        unproven += not exact.optimal
        floor = float(table.drop_util.sum())
        for path, run in PATHS.items():
            t0 = time.perf_counter()
            value = run(table)
            times[path].append(time.perf_counter() - t0)
            shares[path].append((value - floor) / (best - floor) if best > floor else 1.0)
    sizes = sorted({size(s) for s in seeds})
    print(
        f"\n{name}: {len(seeds)} instances, {sizes[0]}-{sizes[-1]} contexts; reference MILP"
        f" {t_exact:.1f} s in all, {unproven} not proven optimal (measured against its bound)"
    )
    print(
        "  path                                  gain share: min     p5    p50  n<98% n<95%"
        "   time p50 / max"
    )
    failed = []
    for path in PATHS:
        g, tm = np.array(shares[path]), np.array(times[path]) * 1e3
        goal = ONLINE_GOAL if path.startswith("online inserts per_byte") else REBALANCE_GOAL
        checked = path.startswith(("rebalance per_byte", "online inserts per_byte"))
        mark = f"{verdict(float(g.min()), goal)} (>= {goal:.0%})" if checked else ""
        if mark.startswith("FAIL"):
            failed.append(f"{name}/{path}")
        print(
            f"  {path:37s} {g.min():.4f} {np.percentile(g, 5):.4f} {np.median(g):.4f}"
            f" {np.sum(g < 0.98):5d} {np.sum(g < 0.95):5d}"
            f"  {np.median(tm):6.1f} / {tm.max():6.1f} ms  {mark}"
        )
    return failed


def exact_cost(sizes: list[int], count: int) -> None:
    """Seconds of the exact re-solve as the placer runs it (all contested contexts, warm-started
    from the greedy, gap 1e-4) by instance size: the measurement behind ``EXACT_MAX``."""
    print("\nexact re-solve of every contested context (refine.EXACT_MAX's measurement), ms:")
    print("  family    " + "".join(f"   n={n:<3d} p50 / p90 / max" for n in sizes))
    unlimited = RefineLimits(max_nodes=10**9, exact_max=10**9)
    for name, make in FAMILIES.items():
        cells = []
        for n in sizes:
            tm = []
            for seed in range(count):
                table = make(5000 + seed, n)
                problem, start = Problem.of(table), greedy_assign(table)
                t0 = time.perf_counter()
                refine(problem, start, unlimited)
                tm.append((time.perf_counter() - t0) * 1e3)
            a = np.array(tm)
            cells.append(f" {np.median(a):6.0f} /{np.percentile(a, 90):5.0f} /{a.max():5.0f}")
        print(f"  {name:9s}" + "".join(f"{c:>29s}" for c in cells))


def lp_gaps(sizes: list[int]) -> None:
    print("\nlarge paper instances: greedy vs LP relaxation (an upper bound on the optimum)")
    for n in sizes:
        table = paper(1000 + n, n, ratios=VariantSpace().ratios)
        t0 = time.perf_counter()
        lp = solve_exact(table, relax=True).objective
        t_lp = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = greedy_assign(table).total_utility(table)
        t_g = time.perf_counter() - t0
        floor = float(table.drop_util.sum())
        print(
            f"  n={n:6d} x {table.size_bytes.shape[1]} variants x 3 tiers: greedy/LP = "
            f"{g / lp:.5f}, (g-drop)/(LP-drop) = {(g - floor) / (lp - floor):.5f};"
            f" LP {t_lp:.2f} s, greedy {t_g:.3f} s"
        )


def synthetic_table(n: int, n_var: int, seed: int = 0) -> UtilityTable:
    """n contexts x n_var variants x 3 paper tiers, built from arrays (no Python objects)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1000, 128000, n).astype(np.float64)
    ratio = np.concatenate([[1.0], np.linspace(0.95, 0.05, n_var - 1)])
    size = tokens[:, None] * ratio[None, :] * 131072
    sens = rng.uniform(0.05, 0.9, n)
    quality = 1 - sens[:, None] * ((1 - ratio[None, :]) / 0.9) ** 1.6 * rng.lognormal(
        0, 0.2, (n, n_var)
    )
    quality[:, 0] = 1.0
    return UtilityTable.from_arrays(
        tiers=PAPER_TIERS,
        alpha=1.0,
        size_bytes=size,
        quality=np.clip(quality, 0, 1),
        restore_s=np.zeros((n, n_var)),
        frequency=rng.zipf(1.5, n).astype(np.float64),
        prefill_s=tokens * 5e-5,
    )


def rebalance_cost(n: int, n_var: int, repeats: int) -> None:
    table = synthetic_table(n, n_var)
    t0 = time.perf_counter()
    for _ in range(repeats):
        ref = table.util.max(axis=1).sum()  # one numpy pass over the (n, V, T) utilities
    t_ref = (time.perf_counter() - t0) / repeats
    del ref
    times = {}
    for label, fn in [
        ("greedy_assign (1 round, no polish)", lambda: greedy_assign(table, 1, 0)),
        ("greedy_assign (2 rounds + polish, small default)", lambda: greedy_assign(table, 2, 64)),
        ("greedy_assign (default for n > 5000)", lambda: greedy_assign(table)),
        ("solve: greedy + refine (certified by its Lagrangian bound)", lambda: solve(table)),
    ]:
        t0 = time.perf_counter()
        for _ in range(repeats):
            a = fn()
        times[label] = (time.perf_counter() - t0) / repeats
        assert a.feasible(table)
    table_ids = _with_ids(table, 1.0)
    placer = EvicPressPlacer(PAPER_TIERS, PlacerParams(alpha=1.0))
    t0 = time.perf_counter()
    plan = placer.rebalance_table(table_ids)
    times["EvicPressPlacer.rebalance_table (fresh; state, lazy plan)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_ops = len(plan.operations)
    times["  + reading the ordered plan (built on first use)"] = time.perf_counter() - t0
    # A second rebalance after re-profiling: frequencies drift by up to +-20%.
    drifted = _with_ids(table, np.random.default_rng(5).uniform(0.8, 1.2, n))
    t0 = time.perf_counter()
    plan2 = placer.rebalance_table(drifted)
    n_ops2 = len(plan2.operations)
    times["rebalance_table again, frequencies +-20%, plan read"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, n // 1000):
        placer.placement(f"c{i}")
    times["  placement() per context (x1000, from the arrays)"] = (time.perf_counter() - t0) / 1000
    print(
        f"\narray path only (a prebuilt UtilityTable, no engine: the daemon's path is below) —"
        f" rebalance of {n} contexts x {n_var} variants x 3 tiers "
        f"(numpy max+sum over the utilities: {t_ref * 1e3:.1f} ms)"
    )
    for label, t in times.items():
        print(f"  {label:58s} {t:8.4f} s  ({t / t_ref:6.2f}x the numpy pass)")
    print(f"  plan: {n_ops} operations fresh, {n_ops2} after the drift")
    greedy = greedy_solve(table)
    floor = float(table.drop_util.sum())
    have = greedy.assignment.total_utility(table) - floor
    bound = lagrangian_bound(Problem.of(table), greedy.prices) - floor
    print(f"  greedy's share of the achievable gain, certified by its Lagrangian bound: "
          f">= {have / bound:.7f}")  # fmt: skip
    fresh = times["EvicPressPlacer.rebalance_table (fresh; state, lazy plan)"]
    print(f"  rebalance_table {fresh:.2f} s vs the 2 s limit: {verdict(2.0 / fresh, 1.0)}")


def _with_ids(table: UtilityTable, scale: float | np.ndarray) -> UtilityTable:
    """``table`` with context ids and variant names, frequencies scaled by ``scale``."""
    n, n_var = table.size_bytes.shape
    return UtilityTable.from_arrays(
        tiers=PAPER_TIERS,
        alpha=1.0,
        size_bytes=table.size_bytes,
        quality=table.quality,
        restore_s=np.zeros_like(table.size_bytes),
        frequency=table.frequency * scale,
        prefill_s=1.0 - table.drop_util / table.frequency,  # drop_util = (1 - prefill) * freq
        context_ids=[f"c{i}" for i in range(n)],
        variant_names=[tuple(str(v) for v in range(n_var))] * n,
    )


def insert_cost(n: int, selection: str) -> None:
    table = synthetic_table(n, 30, seed=1)
    caps = [int(0.05 * table.size_bytes[:, 0].sum()), int(0.3 * table.size_bytes[:, 0].sum()), None]
    tiers = [
        TierModel(t.name, c, t.load_bandwidth_bytes_per_s, t.load_overhead_s)
        for t, c in zip(PAPER_TIERS, caps, strict=True)
    ]
    from kvtierd.types import ContextProfile, VariantProfile

    profiles = [
        ContextProfile(
            f"c{i}",
            tuple(
                VariantProfile(str(v), int(table.size_bytes[i, v]), float(table.quality[i, v]))
                for v in range(30)
            ),
            float(table.frequency[i]),
            3.0,
        )
        for i in range(n)
    ]
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=1.0, selection=selection))
    ops = 0
    t0 = time.perf_counter()
    for p in profiles:
        ops += len(placer.insert(p).operations)
    dt = time.perf_counter() - t0
    print(
        f"  insert ({selection:8s}): {n} contexts x 30 variants: {dt / n * 1e6:7.1f} us/insert,"
        f" {ops / n:.2f} operations/insert, final utility {placer.total_utility():.4g}"
    )


def online_merged(seeds: range) -> None:
    """Online inserts on merged trap instances of 100-200 contexts (issue 28): share of the
    gain the LP relaxation bounds (at least the optimum: the share of the optimum is higher)
    and the longest single insert (the event loop is blocked that long; its CPU time too,
    which other processes on a shared machine do not inflate)."""
    print("\nonline inserts on merged trap instances (issue 28; goal >= 98%, longest <= 50 ms):")
    for seed in seeds:
        n = 100 + (seed * 37) % 101
        table = merged_traps(seed, n)
        lp = solve_exact(table, relax=True).objective
        tiers = [TierModel(str(t), c, 1.0) for t, c in enumerate(table.capacity_bytes)]
        placer = EvicPressPlacer(tiers, PlacerParams())
        longest = longest_cpu = 0.0
        for i in range(n):
            t0, c0 = time.perf_counter(), time.process_time()
            placer.insert_row(table, i)
            longest = max(longest, time.perf_counter() - t0)
            longest_cpu = max(longest_cpu, time.process_time() - c0)
        floor = float(table.drop_util.sum())
        share = (placer.total_utility() - floor) / (lp - floor)
        print(f"  seed {seed} n={n}: share of the LP bound {share:.4f} "
              f"({verdict(share, 0.98)}), longest insert {longest * 1e3:.1f} ms wall "
              f"({verdict(0.05 / longest, 1.0)}), {longest_cpu * 1e3:.1f} ms CPU")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--daemon-only",
        action="store_true",
        help="only issue 28's rows: online inserts on merged traps, the daemon's rebalance",
    )
    args = parser.parse_args()
    if args.daemon_only:
        print(f"machine: {machine()}")
        online_merged(range(2 if args.quick else 6))
        daemon_rows([1000, 10000] if args.quick else [1000, 10000, 100000])
        return
    count = 20 if args.quick else args.instances
    print(f"machine: {machine()}")
    failed: list[str] = []
    for name in FAMILIES:
        failed += family_shares(name, range(count), lambda seed: 8 + seed % 17)
    large = 4 if args.quick else 10
    for n in [48] if args.quick else [48, 100]:
        print(f"\n-- above the exact threshold: {n} contexts --", end="")
        for name in FAMILIES:
            failed += family_shares(name, range(10_000, 10_000 + large), lambda _, n=n: n)
    exact_cost([16, 24, 32, 40, 48, 64], 4 if args.quick else 10)
    lp_gaps([500, 2000] if args.quick else [555, 2000, 10000])
    rebalance_cost(20000 if args.quick else 100000, 60, 1 if args.quick else 3)
    print("\ninsert cost (Algorithm 1, lazy heaps), tiers at 5% / 30% of the bytes + remote:")
    for sel in ("per_byte", "absolute"):
        insert_cost(2000 if args.quick else 20000, sel)
    daemon_rows([1000, 10000] if args.quick else [1000, 10000, 100000])
    print(f"\nshare goals: {'all met' if not failed else 'FAIL: ' + ', '.join(failed)}")


if __name__ == "__main__":
    main()
