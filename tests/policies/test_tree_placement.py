"""Placement with precedence (issue 29): contexts that form a tree, held to the exact optimum."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.policies.base import PlacerParams
from kvtierd.policies.evicpress import EvicPressPlacer, solve
from kvtierd.policies.exact import Problem, solve_problem
from kvtierd.policies.model import Assignment, OptionArrays, UtilityTable
from kvtierd.policies.tree_placement import (
    MAX_DEPTH,
    ContextTree,
    descendants,
    enforce,
    solve_with_precedence,
    subtree_frequency,
    violations,
)
from kvtierd.types import TierModel
from tests.policies.placer_helpers import profile

TIERS = [TierModel("cpu", 0, 4e9), TierModel("ssd", 0, 1e9)]
ALPHA = 2.0


def random_tree(rng: np.random.Generator, n: int) -> tuple[UtilityTable, ContextTree]:
    """``n`` contexts, each the child of an earlier one or a root, with frequencies, sizes
    and variants drawn at random; both tiers hold about a third of all originals."""
    ids = [f"c{i}" for i in range(n)]
    parent_of = {ids[i]: ids[int(rng.integers(0, i))] for i in range(1, n) if rng.random() < 0.75}
    sizes = rng.integers(1, 9, size=n) * 64 * 2**20
    profiles = [
        profile(
            cid,
            {
                "none": (int(s), 1.0),
                "int8": (int(s) // 2, float(rng.uniform(0.9, 0.99))),
                "knorm@0.5": (int(s) // 4, float(rng.uniform(0.5, 0.9))),
            },
            frequency=float(rng.integers(0, 6)),
            prefill_s=float(s) / 2**30,
        )
        for cid, s in zip(ids, sizes, strict=True)
    ]
    options = OptionArrays.from_profiles(profiles)
    forest = ContextTree.of(ids, parent_of)
    options = OptionArrays(
        **{f: getattr(options, f) for f in OptionArrays.__dataclass_fields__ if f != "frequency"},
        frequency=subtree_frequency(options.frequency, forest),
    )
    cap = int(sizes.sum()) // 3
    tiers = [TierModel(t.name, cap, t.load_bandwidth_bytes_per_s) for t in TIERS]
    return UtilityTable.from_options(options, tiers, ALPHA), forest


def exact(table: UtilityTable, forest: ContextTree) -> Assignment:
    result = solve_problem(Problem.of(table), parent=forest.parent)
    assert result.assignment is not None and result.optimal
    return result.assignment


@pytest.mark.parametrize("seed", range(100))
def test_greedy_with_precedence_reaches_98_percent_of_the_exact_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    table, forest = random_tree(rng, int(rng.integers(4, 10)))
    best = exact(table, forest)
    assert violations(best, forest).size == 0
    greedy = solve_with_precedence(table, forest, solve)
    assert greedy.feasible(table)
    assert violations(greedy, forest).size == 0
    floor = float(table.drop_util.sum())  # everything dropped: the gain is measured from here
    gain_best = best.total_utility(table) - floor
    gain_greedy = greedy.total_utility(table) - floor
    assert gain_greedy >= 0.98 * gain_best - 1e-9, (gain_greedy, gain_best)


def test_exact_without_precedence_caches_a_child_whose_parent_is_dropped() -> None:
    """The check above can fail: without the precedence rows the optimum keeps a popular
    child and drops its large, rarely used parent."""
    ids = ["prefix", "doc"]
    big, small = 8 * 2**20, 2**20
    profiles = [
        profile("prefix", {"none": (big, 1.0)}, frequency=0.0, prefill_s=0.001),
        profile("doc", {"none": (small, 1.0)}, frequency=5.0, prefill_s=0.001),
    ]
    forest = ContextTree.of(ids, {"doc": "prefix"})
    tiers = [TierModel("cpu", small, 4e9)]
    table = UtilityTable.from_profiles(profiles, tiers, ALPHA)
    free = solve_problem(Problem.of(table)).assignment
    assert free is not None and violations(free, forest).tolist() == [1]
    tied = exact(table, forest)
    assert tied.dropped.tolist() == [True, True]


def test_a_dropped_parent_never_leaves_a_cached_child_counted_as_a_hit() -> None:
    """The plain greedy keeps the small popular child and drops its parent; with precedence
    the child is dropped too (its KV would never load) and the utility counts no hit for it."""
    profiles = [
        profile("prefix", {"none": (8 * 2**20, 1.0)}, frequency=0.0, prefill_s=0.001),
        profile("doc", {"none": (2**20, 1.0)}, frequency=5.0, prefill_s=0.001),
    ]
    forest = ContextTree.of(["prefix", "doc"], {"doc": "prefix"})
    table = UtilityTable.from_profiles(profiles, [TierModel("cpu", 2**20, 4e9)], ALPHA)
    plain = solve(table)
    assert plain.dropped.tolist() == [True, False]  # the hit the precedence rule forbids
    tied = solve_with_precedence(table, forest, solve)
    assert tied.dropped.tolist() == [True, True]
    assert violations(enforce(plain, forest), forest).size == 0


def test_subtree_frequency_counts_every_descendant_once() -> None:
    """A parent's frequency is at least its children's together (their requests load it),
    and a measured parent that already counts them is not counted twice."""
    forest = ContextTree.of(["a", "b", "c", "d"], {"b": "a", "c": "b", "d": "a"})
    freq = subtree_frequency(np.array([1.0, 2.0, 3.0, 4.0]), forest)
    assert freq.tolist() == [7.0, 3.0, 3.0, 4.0]
    measured = subtree_frequency(np.array([9.0, 5.0, 3.0, 4.0]), forest)
    assert measured.tolist() == [9.0, 5.0, 3.0, 4.0]
    assert descendants(forest, 0).tolist() == [1, 3, 2]
    assert descendants(forest, 2).tolist() == []


def test_a_parent_outside_the_rows_makes_a_root() -> None:
    forest = ContextTree.of(["a", "b"], {"b": "gone"})
    assert forest.parent.tolist() == [0, 1] and forest.depth.tolist() == [0, 0]


def test_a_cycle_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'a'.*cycle"):
        ContextTree.of(["a", "b"], {"a": "b", "b": "a"})


def test_a_chain_deeper_than_the_limit_is_refused() -> None:
    ids = [f"c{i}" for i in range(MAX_DEPTH + 2)]
    chain = {ids[i]: ids[i - 1] for i in range(1, len(ids))}
    with pytest.raises(InvalidArgumentError, match=f"deeper than {MAX_DEPTH}"):
        ContextTree.of(ids, chain)
    ContextTree.of(ids[:-1], chain)  # MAX_DEPTH levels below the root are allowed


def test_the_evicpress_placer_rebalances_with_precedence() -> None:
    """Through the placer: the parent's frequency counts its child's requests, so the prefix
    the child needs is kept, with the child; unlinked, the popular child alone is kept."""
    profiles = [
        profile("prefix", {"none": (2**20, 1.0)}, frequency=0.0, prefill_s=0.001),
        profile("doc", {"none": (2**20, 1.0)}, frequency=5.0, prefill_s=0.001),
        profile("other", {"none": (2**20, 1.0)}, frequency=3.0, prefill_s=0.001),
    ]
    tiers = [TierModel("cpu", 2 * 2**20, 4e9)]
    plain = EvicPressPlacer(tiers, PlacerParams(alpha=ALPHA))
    plain.rebalance(profiles)
    assert [plain.placement(c).dropped for c in ("prefix", "doc", "other")] == [True, False, False]
    tied = EvicPressPlacer(tiers, PlacerParams(alpha=ALPHA))
    tied.link("doc", "prefix")
    tied.rebalance(profiles)
    assert [tied.placement(c).dropped for c in ("prefix", "doc", "other")] == [False, False, True]
    assert tied.frequency("prefix") == 5.0


def test_an_insert_that_pushes_a_parent_out_drops_its_children() -> None:
    """The greedy pushes out the less used prefix alone; its child goes with it."""
    tiers = [TierModel("cpu", 3 * 2**20, 4e9)]
    placer = EvicPressPlacer(tiers, PlacerParams(alpha=ALPHA))
    placer.link("doc", "prefix")
    placer.insert(profile("prefix", {"none": (2**20, 1.0)}, frequency=1.0, prefill_s=0.001))
    placer.insert(profile("doc", {"none": (2**20, 1.0)}, frequency=2.0, prefill_s=0.001))
    assert not placer.placement("doc").dropped
    plan = placer.insert(profile("big", {"none": (2 * 2**20, 1.0)}, frequency=50.0))
    assert placer.placement("prefix").dropped and placer.placement("doc").dropped
    dropped = {op.context_id for op in plan.operations if op.target.dropped}
    assert dropped == {"prefix", "doc"}


def test_a_child_whose_parent_is_dropped_is_not_placed() -> None:
    """A parent the placer does not know yet (the daemon adopts contexts at start in no
    particular order) does not drop its child; a dropped one does."""
    placer = EvicPressPlacer([TierModel("cpu", 4 * 2**20, 4e9)], PlacerParams(alpha=ALPHA))
    placer.link("doc", "prefix")
    placer.insert(profile("doc", {"none": (2**20, 1.0)}, frequency=5.0, prefill_s=0.001))
    assert not placer.placement("doc").dropped
    placer.insert(profile("prefix", {"none": (8 * 2**20, 1.0)}, frequency=1.0))  # does not fit
    assert placer.placement("prefix").dropped and placer.placement("doc").dropped
    placer.insert(profile("doc", {"none": (2**20, 1.0)}, frequency=5.0, prefill_s=0.001))
    assert placer.placement("doc").dropped
