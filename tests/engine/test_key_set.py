"""KeySet: a context's keys, an ordered set that holds one key without a dict (issue 42)."""

from __future__ import annotations

import tracemalloc

import pytest

from kvtierd.engine.key_set import KeySet


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
    keys = KeySet(["a", "b", "c"])
    with pytest.raises(RuntimeError):
        for key in keys:
            keys.remove(key)


def test_one_key_costs_no_dict() -> None:
    """The point of the class: 10,000 one-key sets take well under a third of one-key dicts."""
    names = [f"key-{i}" for i in range(10_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sets = [KeySet((n,)) for n in names]
        lean = tracemalloc.get_traced_memory()[0] - before
        dicts = [{n: None} for n in names]
        full = tracemalloc.get_traced_memory()[0] - before - lean
    finally:
        tracemalloc.stop()
    assert len(sets) == len(dicts) and lean * 3 < full
