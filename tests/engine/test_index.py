"""The index of contexts and objects, in process (no daemon, no tiers, no I/O)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvtierd.engine.index import ContextIndex, found_order
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import CapacityError
from kvtierd.types import DROPPED, ObjectMeta, Placement


def _meta(key: str, ctx: str = "c", size: int = 100, tenant: str = "", variant: str = "none"):
    return ObjectMeta(key=key, size_bytes=size, context_id=ctx, tenant=tenant, variant=variant)


def test_objects_join_their_context_in_put_order_and_are_charged_where_they_are() -> None:
    index = ContextIndex()
    index.add(ObjectRecord(_meta("k1"), "cpu"))
    ctx = index.add(ObjectRecord(_meta("k2", size=50), "ssd"))
    assert list(ctx.keys) == ["k1", "k2"]
    assert ctx.size_bytes == 150
    assert index.usage["", "cpu"] == 100 and index.usage["", "ssd"] == 50
    assert index.placement_of(ctx) == Placement("none", "cpu")  # its first object's tier


def test_objects_are_numbered_in_their_context_and_numbers_only_grow() -> None:
    """The position kept with a persistent copy (issue 31): numbered as objects join; after a
    removal the next is numbered past every earlier one (never a number a file may still
    carry); one found at start keeps its number, or none (a file from before positions)."""
    index = ContextIndex()
    records = [ObjectRecord(_meta(k), "cpu") for k in ("k1", "k2", "k3")]
    for rec in records:
        index.add(rec)
    assert [r.meta.position for r in records] == [0, 1, 2]
    index.remove("k3")
    later = ObjectRecord(_meta("k4"), "cpu")
    index.add(later)
    assert later.meta.position == 3
    found = [ObjectRecord(_meta(k, ctx="old"), "ssd") for k in ("a", "b")]
    found.append(ObjectRecord(_meta("c", ctx="old").replace(position=9), "ssd"))
    for rec in found:
        index.add(rec, found=True)
    assert [r.meta.position for r in found] == [None, None, 9]
    new = ObjectRecord(_meta("d", ctx="old").replace(position=4), "cpu")  # another numbering
    index.add(new)
    assert new.meta.position == 10


def test_objects_take_their_contexts_own_id_string() -> None:
    """Each put decodes its own copy of the context id; indexed, the object holds the
    context's string instead (issue 42: one string a context, not one an object)."""
    index = ContextIndex()
    first, second = (ObjectRecord(_meta(k, ctx="".join(["con", "text"])), "cpu") for k in "ab")
    assert first.meta.context_id is not second.meta.context_id  # two decoded copies
    ctx = index.add(first)
    index.add(second)
    assert second.meta.context_id == "context"
    assert first.meta.context_id is ctx.context_id and second.meta.context_id is ctx.context_id
    assert index.objects["b"] is second and second.meta.position == 1


def test_found_objects_are_ordered_by_position_those_without_one_first_by_key() -> None:
    metas = [_meta(k).replace(position=p) for k, p in (("x", 2), ("y", None), ("z", 0),
                                                         ("a", None), ("b", 2))]  # fmt: skip
    assert [m.key for m in sorted(metas, key=found_order)] == ["a", "y", "z", "b", "x"]


def test_removing_the_last_object_removes_its_context() -> None:
    index = ContextIndex()
    index.add(ObjectRecord(_meta("k1"), "cpu"))
    index.add(ObjectRecord(_meta("k2"), "cpu"))
    ctx = index.remove("k1")
    assert list(ctx.keys) == ["k2"] and ctx.size_bytes == 100 and "c" in index.contexts
    ctx = index.remove("k2")
    assert not ctx.keys and "c" not in index.contexts
    assert index.placement_of(ctx) == DROPPED


def test_an_object_is_found_only_by_its_tenant() -> None:
    index = ContextIndex()
    index.add(ObjectRecord(_meta("A/k", tenant=""), "cpu"))
    assert index.owned("A/k", "") is not None
    assert index.owned("A/k", "A") is None  # stored before tenant A existed: not A's


def test_a_variant_marker_is_read_as_an_object_of_no_context() -> None:
    index = ContextIndex()
    ctx = index.add(ObjectRecord(_meta("k1"), "cpu"))
    marker = _meta("m", variant="knorm@0.5")
    ctx.marker = (marker, "ssd")
    index.marker_owner["m"] = "c"
    found = index.record_of("m")
    assert found is not None and found.tier == "ssd" and found.meta == marker
    assert "m" not in ctx.keys
    ctx.marker = None  # replaced by another variant's marker meanwhile
    assert index.record_of("m") is None


def test_owned_all_answers_each_key_as_owned_does() -> None:
    """A Lookup's keys in one pass: the tenant's objects, another tenant's (by key or by a
    key it stored before that tenant was configured), a marker and a missing key are each
    answered as :meth:`ContextIndex.owned` answers them alone."""
    index = ContextIndex()
    ctx = index.add(ObjectRecord(_meta("k1"), "cpu"))
    index.add(ObjectRecord(_meta("A/k2", ctx="A/c", tenant="A"), "ssd"))
    index.add(ObjectRecord(_meta("A/old", ctx="old"), "ssd"))  # the default tenant's
    marker = _meta("m", variant="knorm@0.5")
    ctx.marker = (marker, "ssd")
    index.marker_owner["m"] = "c"
    keys = ["k1", "A/k2", "A/old", "m", "missing", "k1"]
    for tenant in ("", "A", "B"):
        expected = [index.owned(k, tenant) for k in keys]
        got = index.owned_all(keys, tenant)
        assert [None if r is None else (r.meta, r.tier) for r in got] == [
            None if r is None else (r.meta, r.tier) for r in expected
        ], tenant
    assert [r is not None for r in index.owned_all(keys, "")] == [1, 0, 1, 1, 0, 1]
    assert [r is not None for r in index.owned_all(keys, "A")] == [0, 1, 0, 0, 0, 0]


def test_unread_durable_objects_are_counted() -> None:
    index = ContextIndex()
    ctx = index.add(ObjectRecord(_meta("k1"), "ssd", durable=True, unread=True))
    index.add(ObjectRecord(_meta("k2"), "ssd", durable=True))
    assert index.unread_durable(ctx) == 1


def test_objects_added_in_a_compressed_form_are_told_from_the_reference_copy() -> None:
    index = ContextIndex()
    original = _meta("k1")
    ctx = index.add(ObjectRecord(_meta("k1", variant="int8"), "cpu"))
    index.add(ObjectRecord(_meta("k2", variant="int8"), "cpu"))  # added compressed
    index.add(ObjectRecord(_meta("c\x00knorm@0.5\x000", variant="knorm@0.5"), "cpu"))
    ctx.variant, ctx.reference = "int8", [(original, "remote")]
    assert index.added_in_form(ctx) == ["k2"]  # not the derived key, not the reference
    sources = index.sources(ctx)
    assert [(r.meta.key, r.tier) for r in sources] == [("k1", "remote"), ("k2", "cpu")]
    assert sources[0].meta == original
    assert index.can_make(ctx, "none") and index.can_make(ctx, "knorm@0.5")


def test_a_context_kept_only_quantized_is_its_own_source() -> None:
    """No reference copy: int8 chunks dequantize to every token's KV, so the variants quantized
    the same or coarser are made from them; the original and finer forms are not."""
    index = ContextIndex()
    ctx = index.add(ObjectRecord(_meta("k1", variant="int8"), "cpu"))
    index.add(ObjectRecord(_meta("k2", variant="int8"), "ssd"))
    assert index.self_sourced(ctx)
    assert [r.meta.key for r in index.sources(ctx)] == ["k1", "k2"]
    made = [v for v in ("int8", "int4", "keydiff@0.5+int8", "knorm@0.5+int4", "none",
                        "knorm@0.5") if index.can_make(ctx, v)]  # fmt: skip
    assert made == ["int8", "int4", "keydiff@0.5+int8", "knorm@0.5+int4"]
    ctx.variant = "int4"
    assert not index.can_make(ctx, "int8") and index.can_make(ctx, "keydiff@0.5+int4")


def test_a_token_dropped_form_without_its_original_has_no_source() -> None:
    index = ContextIndex()
    ctx = index.add(
        ObjectRecord(_meta("c\x00knorm@0.5+int8\x000", variant="knorm@0.5+int8"), "cpu")
    )
    assert not index.self_sourced(ctx) and index.sources(ctx) == []
    assert not index.can_make(ctx, "knorm@0.5+int4") and index.can_make(ctx, "knorm@0.5+int8")


def test_a_quota_counts_stored_and_in_flight_bytes() -> None:
    index = ContextIndex({"t": {"cpu": 250}})
    index.add(ObjectRecord(_meta("k1", tenant="t"), "cpu"))
    index.check_quota([_meta("k2", tenant="t")], {"t": 50})  # 100 + 50 + 100 <= 250
    with pytest.raises(CapacityError, match="tenant 't' quota exceeded: 200 bytes"):
        index.check_quota([_meta("k2", tenant="t")], {"t": 100})
    index.check_quota([_meta("k3", size=10**9)], {})  # the default tenant has no quota


def test_a_namespace_quota_counts_its_stored_and_in_flight_bytes() -> None:
    index = ContextIndex(namespace_quotas={"": {"a": {"cpu": 100, "ssd": 150}}})
    index.add(ObjectRecord(_meta("ns:a:k1", ctx="ns:a:c"), "ssd"))
    being_put = index.namespace_bytes([_meta("ns:a:k2", size=50), _meta("ns:b:k", size=999)])
    assert being_put == {("", "a"): 50}  # b is no configured namespace
    index.check_quota([_meta("ns:a:k3", size=100)], {}, being_put)  # 100 + 50 + 100 <= 250
    with pytest.raises(CapacityError, match="namespace 'a' of tenant '' quota exceeded: 150"):
        index.check_quota([_meta("ns:a:k3", size=101)], {}, being_put)
    index.check_quota([_meta("k4", size=10**9)], {}, being_put)  # the tenant's alone


def test_quota_tier_is_the_first_tier_down_where_the_context_fits() -> None:
    index = ContextIndex({"t": {"cpu": 150, "ssd": 1000}})
    ctx = index.add(ObjectRecord(_meta("k1", ctx="big", tenant="t", size=200), "ssd"))
    tiers = ["cpu", "ssd", "remote"]
    assert index.quota_tier(ctx, "cpu", tiers) == "ssd"
    assert index.quota_tier(ctx, "cpu", tiers, size_bytes=150) == "cpu"  # a form it is to take
    index.quotas["t"]["ssd"] = 100
    assert index.quota_tier(ctx, "cpu", tiers) == "remote"  # no quota there: unlimited
    assert index.quota_tier(ctx, "cpu", tiers[:2]) is None


def test_a_child_found_before_its_parent_is_linked_at_start() -> None:
    """Issue 29: at start objects come in no particular order; a link that would close a
    cycle (damaged files) is not made."""
    from kvtierd.engine.index import ContextIndex
    from kvtierd.engine.state import ObjectRecord
    from kvtierd.types import ObjectMeta

    index = ContextIndex()
    for key, ctx, parent in (("b/0", "b", "a"), ("a/0", "a", ""), ("x/0", "x", "y"),
                             ("y/0", "y", "x")):  # fmt: skip
        index.add(ObjectRecord(ObjectMeta(key, 8, ctx, parent_context_id=parent), "cpu"))
    assert index.contexts["b"].parent == ""  # its parent was not there yet
    index.relink()
    assert index.contexts["b"].parent == "a"
    assert (index.contexts["x"].parent, index.contexts["y"].parent) == ("", "x")
    assert index.ancestors(index.contexts["b"]) == ["a"]


def test_found_objects_of_one_position_are_in_key_order() -> None:
    """Issue 42: with one position for all (one-object contexts), sort_found sorts by key
    alone, as found_order does; one object with another position is sorted by it first."""
    from kvtierd.engine.index_rebuild import sort_found

    for position in (None, 0):
        found = [(ObjectMeta(k, 1, position=position), "ssd") for k in ("k3", "k10", "k1", "k2")]
        sort_found(found)
        assert [m.key for m, _ in found] == ["k1", "k10", "k2", "k3"]
    found = [(ObjectMeta(k, 1, position=p), "ssd") for k, p in (("b", 0), ("a", 1), ("c", 0))]
    sort_found(found)
    assert [m.key for m, _ in found] == ["b", "c", "a"]


def test_a_restart_indexes_as_add_does_in_one_pass() -> None:
    """Issue 42: the restart's bulk path (two plain sorts, bytes charged per tenant and tier
    at the end, only contexts naming a parent relinked) gives what :func:`found_order` and
    ``ContextIndex.add`` one object at a time give."""
    from kvtierd.engine.index_rebuild import add_found, sort_found

    metas = [
        ObjectMeta("b/1", 10, "b", tenant="t", position=1, parent_context_id="a"),
        ObjectMeta("b/0", 20, "b", tenant="t", position=0),
        ObjectMeta("a/0", 30, "a", tenant="t", position=0),
        ObjectMeta("old", 40, "old", tenant="u"),  # from before positions were kept
        ObjectMeta("c/0", 50, "c", tenant="u", position=0, parent_context_id="a"),  # not t's
        ObjectMeta("a/0", 30, "a", tenant="t", position=0),  # the same key in a second tier
    ]
    found = [(m, "ssd" if i % 2 else "remote") for i, m in enumerate(metas)]
    want = sorted(found, key=lambda item: found_order(item[0]))
    sort_found(found)
    assert found == want
    bulk, one_by_one = ContextIndex(), ContextIndex()
    add_found(bulk, found)
    for meta, tier in found:
        if meta.key not in one_by_one.objects:
            one_by_one.add(ObjectRecord(meta, tier), found=True)
    one_by_one.relink()
    assert bulk.usage == one_by_one.usage
    assert (bulk.usage["t", "remote"], bulk.usage["t", "ssd"]) == (30 + 10, 20)
    assert {k: list(c.keys) for k, c in bulk.contexts.items()} == {
        k: list(c.keys) for k, c in one_by_one.contexts.items()
    }
    assert list(bulk.contexts) == ["old", "a", "b", "c"]
    got = [(c.parent, c.size_bytes) for c in bulk.contexts.values()]
    assert got == [("", 40), ("", 30), ("a", 30), ("", 50)]
    assert all(r.durable for r in bulk.objects.values())
    # The contexts add_found makes itself (no parent named) are those add would make.
    assert [_record(c) for c in bulk.contexts.values()] == [
        _record(c) for c in one_by_one.contexts.values()
    ]
    assert [c.next_position for c in bulk.contexts.values()] == [0, 1, 2, 1]


def _record(ctx: ContextRecord) -> tuple[object, ...]:
    fields = ("context_id", "variant", "tenant", "namespace", "held_keys", "size_bytes", "hits",
              "last_access_s", "pinned", "hold_until_s", "next_position")  # fmt: skip
    return (*(getattr(ctx, f) for f in fields), list(ctx.keys), ctx.parent, ctx.after_key)


def test_a_restart_of_unparented_contexts_indexes_as_add_does() -> None:
    """Issue 42: add_found makes the context of a first object naming no parent itself (not
    through ``ContextIndex.context_add``): its form, tenant, namespace, keys, size and next
    position are those ``add`` gives, with and without configured namespaces, durable or not,
    with and without a position, for a derived key too."""
    from kvtierd.engine.context_kv import client_key
    from kvtierd.engine.index_rebuild import add_found, sort_found

    metas = [
        ObjectMeta("t/ns:ns1:a", 10, "a", tenant="t", position=4, durable=True),
        ObjectMeta("t/ns:ns1:a2", 20, "a", tenant="t", position=7),
        ObjectMeta("b", 30, variant="int8", tenant="u"),
        ObjectMeta("c\x00int8", 40, "c", variant="int8", position=0),
    ]
    for spaces in ({}, {"t": {"ns1": {"ssd": 100}}}):
        found = [(m, "ssd") for m in metas]
        sort_found(found)
        bulk = ContextIndex(namespace_quotas=spaces)
        one_by_one = ContextIndex(namespace_quotas=spaces)
        add_found(bulk, found)
        for meta, tier in found:
            record = ObjectRecord(meta, tier, durable=True, unread=meta.durable)
            one_by_one.add(record, client_key(meta.key), found=True)
        assert [_record(c) for c in bulk.contexts.values()] == [
            _record(c) for c in one_by_one.contexts.values()
        ]
        assert bulk.objects == one_by_one.objects and bulk.usage == one_by_one.usage
        assert bulk.namespace_usage == one_by_one.namespace_usage
    assert bulk.contexts["a"].namespace == "ns1" and bulk.contexts["a"].next_position == 8
    assert list(bulk.objects) == ["b", "c", "t/ns:ns1:a", "t/ns:ns1:a2"]


def test_a_context_keeps_its_rare_fields_aside_until_one_is_set():
    """Issue 42: the lock, marker, reference copy, durable hold and tree link of a context
    are unset for nearly all of a large daemon's; they take no room until one is set."""
    from kvtierd.engine.state import ContextRecord

    ctx = ContextRecord("c")
    assert (ctx.marker, ctx.reference, ctx.durable_held, ctx.parent, ctx.after_key) == (
        None, None, False, "", "",
    )  # fmt: skip
    ctx.parent = ""  # the default: still nothing aside
    assert ctx._rare is None
    ctx.parent, ctx.after_key = "p", "p/3"
    assert (ctx.parent, ctx.after_key, ctx.marker) == ("p", "p/3", None)
    assert ctx._rare is not None
    ctx.parent = ""
    assert ctx.parent == "" and ctx.after_key == "p/3"
    ctx.after_key = ""  # every field back to its default: the room goes with it
    assert ctx._rare is None


async def test_a_context_lock_excludes_and_is_let_go_when_no_one_holds_or_waits():
    """Issue 42: the lock is made for its first user and let go after its last, so that the
    contexts a daemon has moved keep no lock; meanwhile it excludes as an asyncio.Lock does."""
    ctx = ContextRecord("c")
    order: list[str] = []

    async def hold(name: str) -> None:
        async with ctx.lock:
            order.append(f"{name} in")
            await asyncio.sleep(0.01)
            order.append(f"{name} out")

    first = asyncio.ensure_future(hold("a"))
    await asyncio.sleep(0)
    assert ctx.lock.locked() and ctx._rare is not None
    await asyncio.gather(first, hold("b"), hold("c"))
    assert order == ["a in", "a out", "b in", "b out", "c in", "c out"]
    assert not ctx.lock.locked() and ctx._rare is None  # let go once the last one left

    ctx.parent = "p"  # another rare field set: the lock's going leaves it
    holder = asyncio.ensure_future(hold("d"))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(hold("e"))
    await asyncio.sleep(0)
    waiter.cancel()  # cancelled while it waits, then the holder while it holds
    holder.cancel()
    for task in (waiter, holder):
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert order[-1] == "d in"
    assert ctx._rare is not None and ctx._rare._lock is None and ctx.parent == "p"
