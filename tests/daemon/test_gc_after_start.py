"""The collector around the daemon's start (issue 42): what the start made is frozen without
a collection walking it, what was there before is collected first, and the collector is back
on, tuned, after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kvtierd.server.main import gc_tuned_after_start


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def collector_restored() -> Iterator[None]:
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def test_the_start_runs_without_collections_and_what_it_made_is_frozen(
    collector_restored: None,
) -> None:
    before = _Node()
    gone = weakref.ref(before)
    del before
    frozen = gc.get_freeze_count()
    with gc_tuned_after_start():
        assert gone() is None  # garbage from before the start: collected first
        assert not gc.isenabled()
        made = [_Node() for _ in range(1000)]
        collections = gc.get_stats()
    assert [s["collections"] for s in gc.get_stats()] == [s["collections"] for s in collections]
    assert gc.get_freeze_count() >= frozen + len(made)
    assert not any(o is made[0] for o in gc.get_objects())  # out of the collector's sight
    assert gc.isenabled() and gc.get_threshold() == (10_000, 10, 10)


def test_a_start_that_fails_freezes_nothing_and_turns_the_collector_back_on(
    collector_restored: None,
) -> None:
    frozen = gc.get_freeze_count()
    with pytest.raises(OSError), gc_tuned_after_start():
        _ = [_Node() for _ in range(100)]
        raise OSError("cannot bind")
    assert gc.get_freeze_count() == frozen
    assert gc.isenabled()
