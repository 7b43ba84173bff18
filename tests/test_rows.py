"""Issue 42: the engine's option rows and the placer's slots number their rows from 0 up, a
million contexts each at scale; a number above 256 is one int object wherever it is stored."""

from __future__ import annotations

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.option_rows import OptionRows
from kvtierd.engine.servable import Servability
from kvtierd.engine.state import ObjectRecord, RunningPolicy
from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.loader import parse_policy
from kvtierd.rows import shared_row
from kvtierd.types import ContextProfile, ObjectMeta, TierModel, VariantProfile

N = 600  # numbers past the interpreter's own small ints (up to 256)


def test_a_row_number_is_one_object_of_its_value() -> None:
    made = [int(str(i)) for i in range(5000)]  # new objects of the same values, past a block
    assert [shared_row(m) for m in made] == list(range(5000))
    assert all(shared_row(m) is shared_row(i) for i, m in enumerate(made))


def test_option_rows_and_placer_slots_hold_the_same_objects() -> None:
    tiers = [TierModel("cpu", 10**9, 1e9, 0.0), TierModel("ssd", 10**12, 1e8, 0.0)]
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=10.0))
    for i in range(N):
        placer.insert(ContextProfile(f"c{i}", (VariantProfile("none", 1000, 1.0),), 1.0, 1.0))
    slots = placer._state.slots.index

    index = ContextIndex()
    policy = RunningPolicy(parse_policy("placer: evicpress\n", "p.yaml"))
    rows = OptionRows(ContextOptions(index=index, policy=policy, servable=Servability({}),
                                     profiler=lambda: None))  # fmt: skip
    rows.arrays([index.add(ObjectRecord(ObjectMeta(f"c{i}", 1000, f"c{i}"), "cpu"))
                 for i in range(N)])  # fmt: skip

    assert sorted(slots.values()) == sorted(rows._slot.values()) == list(range(N))
    by_value = {n: n for n in slots.values()}
    assert all(by_value[n] is n for n in rows._slot.values())  # one object per number


def test_full_tables_grow_by_a_quarter() -> None:
    """Issue 42: rows not taken yet are written and resident; doubling at 526,316 contexts
    (bench_scale's 1M objects) left half the rows of both tables waiting."""
    from kvtierd.rows import grown_capacity

    assert [grown_capacity(n) for n in (0, 10, 16, 1000, 1 << 20)] == [16, 16, 20, 1250, 1310720]
    tiers = [TierModel("cpu", 10**9, 1e9, 0.0), TierModel("ssd", 10**12, 1e8, 0.0)]
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=10.0))
    index = ContextIndex()
    policy = RunningPolicy(parse_policy("placer: evicpress\n", "p.yaml"))
    rows = OptionRows(ContextOptions(index=index, policy=policy, servable=Servability({}),
                                     profiler=lambda: None))  # fmt: skip
    n = 3000
    for i in range(n):
        placer.insert(ContextProfile(f"c{i}", (VariantProfile("none", 1000, 1.0),), 1.0, 1.0))
    rows.arrays([index.add(ObjectRecord(ObjectMeta(f"c{i}", 1000, f"c{i}"), "cpu"))
                 for i in range(n)])  # fmt: skip
    assert n <= placer._state.slots.capacity <= 1.25 * n
    assert n <= rows.count.size <= 1.25 * n
