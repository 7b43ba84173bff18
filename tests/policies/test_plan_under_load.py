"""The same inputs give the same plan whatever the machine is doing (issue 28): every exact
re-solve is limited in work (search nodes), never in seconds. Measured by computing the plans
twice, the second time while busy processes take every core: with a wall-clock limit the
solves that hit it (HiGHS on these instances takes 0.1-1 s) stop at other incumbents."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.model import UtilityTable
from kvtierd.sim.families import merged_traps
from kvtierd.types import Operation, TierModel


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


@contextmanager
def _busy(seconds: float) -> Iterator[None]:
    """Two busy processes per core for up to ``seconds``."""
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_spin, args=(time.monotonic() + seconds,), daemon=True)
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


def _placer(table: UtilityTable) -> EvicPressPlacer:
    tiers = [TierModel(str(t), c, 1.0) for t, c in enumerate(table.capacity_bytes)]
    return EvicPressPlacer(tiers, PlacerParams())


def _plans() -> tuple[list[tuple[Operation, ...]], tuple[Operation, ...]]:
    """The plans of 100 inserts (repairs by the own search) and of a rebalance (HiGHS)."""
    inserts = merged_traps(6, 100)
    placer = _placer(inserts)
    insert_plans = [placer.insert_row(inserts, i).operations for i in range(inserts.n_contexts)]
    rebalanced = _placer(inserts).rebalance_table(merged_traps(7, 90)).operations
    return insert_plans, rebalanced


def test_plans_repeated_under_cpu_load_are_identical():
    quiet = _plans()
    with _busy(120.0):
        loaded = _plans()
    assert loaded == quiet
