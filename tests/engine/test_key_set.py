"""KeySet: a context's keys, an ordered set that holds a few keys without a dict (issue 42)."""

from __future__ import annotations

import sys
import tracemalloc

import pytest

from kvtierd.engine.key_set import FEW, KeySet
from kvtierd.engine.state import ContextRecord


def test_it_behaves_as_an_ordered_set_through_zero_one_and_two_keys() -> None:
    keys = KeySet()
    assert (len(keys), bool(keys), list(keys), list(reversed(keys))) == (0, False, [], [])
    assert "a" not in keys
    keys.add("a")
    keys.add("a")  # held already
    assert (len(keys), bool(keys), list(keys)) == (1, True, ["a"])
    assert "a" in keys and "b" not in keys
    keys.add("b")
    keys.add("a")  # keeps its place
    assert (len(keys), list(keys), list(reversed(keys))) == (2, ["a", "b"], ["b", "a"])
    keys.remove("a")
    assert (len(keys), list(keys), "a" in keys) == (1, ["b"], False)
    keys.remove("b")
    assert (len(keys), bool(keys), list(keys)) == (0, False, [])
    with pytest.raises(KeyError):
        keys.remove("b")
    keys.discard("b")  # not held: nothing to do


def test_an_empty_key_is_a_key() -> None:
    keys = KeySet([""])
    assert (len(keys), "" in keys, list(keys)) == (1, True, [""])
    keys.remove("")
    assert not keys


def test_a_context_of_thousands_of_chunks_keeps_its_order_through_removals() -> None:
    """Removal in the middle and membership stay O(1) (a dict from the second key on): a
    context of 5,000 chunks loses every third one and keeps the order of the rest."""
    names = [f"chunk-{i}" for i in range(5000)]
    keys = KeySet(names)
    for name in names[1::3]:
        keys.remove(name)
    kept = [n for i, n in enumerate(names) if i % 3 != 1]
    assert list(keys) == kept and list(reversed(keys)) == kept[::-1] and len(keys) == len(kept)
    assert all(n in keys for n in kept) and not any(n in keys for n in names[1::3])
    keys.add(names[1])  # back in, last
    assert next(reversed(keys)) == names[1] and next(iter(keys)) == names[0]
    for name in list(keys)[:-1]:
        keys.remove(name)
    assert list(keys) == [names[1]]
    keys.clear()
    assert not keys and list(keys) == []


def test_changing_it_while_iterating_its_dict_is_refused_as_a_dicts() -> None:
    keys = KeySet([f"k{i}" for i in range(FEW + 1)])
    with pytest.raises(RuntimeError):
        for key in keys:
            keys.remove(key)


def test_a_contexts_keys_cost_no_object() -> None:
    """The point of the class: a context's one key is kept in the context's own slot, so
    10,000 contexts of a key each take their records' bytes and the list's, no more (a dict
    each would be ~184 bytes more, a key set object of their own 40)."""
    ids = [f"c{i}" for i in range(10_000)]
    names = [f"key-{i}" for i in range(10_000)]
    record_bytes = sys.getsizeof(ContextRecord("c"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        records = [ContextRecord(cid) for cid in ids]
        for ctx, name in zip(records, names, strict=True):
            ctx.keys.add(name)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert [list(ctx.keys) for ctx in records[:2]] == [["key-0"], ["key-1"]]
    assert grown < 10_000 * (record_bytes + 16), (grown, record_bytes)


def test_a_contexts_keys_are_its_own() -> None:
    a, b = ContextRecord("a"), ContextRecord("b")
    a.keys.add("x")
    a.keys.add("y")
    b.keys.add("z")
    assert (list(a.keys), list(b.keys), len(a.keys)) == (["x", "y"], ["z"], 2)
    a.keys.remove("x")
    assert a.held_keys == "y" and "x" not in a.keys and "y" in a.keys


def test_a_few_keys_are_a_tuple_and_more_a_dict_in_order_either_way() -> None:
    """Up to FEW keys are held as a tuple (added, removed in the middle, added again), one
    more makes a dict, and the set behaves the same through each."""
    names = [f"k{i}" for i in range(FEW + 3)]
    keys = KeySet(names[:3])
    assert isinstance(keys._keys, tuple) and list(keys) == names[:3]
    keys.remove("k1")
    keys.add("k1")
    keys.add("k0")  # held already: keeps its place
    assert list(keys) == ["k0", "k2", "k1"] and list(reversed(keys)) == ["k1", "k2", "k0"]
    with pytest.raises(KeyError):
        keys.remove("k9")
    for name in names[3:FEW]:
        keys.add(name)
    assert isinstance(keys._keys, tuple) and len(keys) == FEW
    keys.add(names[FEW])
    assert isinstance(keys._keys, dict) and len(keys) == FEW + 1
    assert list(keys) == ["k0", "k2", "k1", *names[3 : FEW + 1]]
    assert all(n in keys for n in names[: FEW + 1]) and names[FEW + 1] not in keys
    keys = KeySet(["a", "b"])
    keys.remove("a")
    assert keys._keys == "b"  # one left: the bare key


def test_a_context_of_three_keys_costs_a_small_tuple() -> None:
    """Issue 42's bench_scale puts contexts of three and four objects too: a dict of their
    keys was 184 bytes a context, a tuple of three is 64."""
    records = [ContextRecord(f"c{i}") for i in range(10_000)]
    names = [[f"c{i}/{j}" for j in range(3)] for i in range(10_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for ctx, three in zip(records, names, strict=True):
            for name in three:
                ctx.keys.add(name)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert list(records[7].keys) == names[7]
    assert grown < 10_000 * 80, grown
