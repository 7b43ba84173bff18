"""Issue 42: the engine keeps an ObjectRecord per object and a ContextRecord per context, a
million of them at scale: what most share is one shared value, what few have is aside."""

from __future__ import annotations

import sys

from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.types import ObjectMeta


def test_fields_set_one_at_a_time_and_records_share_their_where() -> None:
    a = ObjectRecord(ObjectMeta("a", 10, "c"), "cpu")
    b = ObjectRecord(ObjectMeta("b", 10, "c"), "ssd", shadow="", durable=True, unread=True)
    assert (a.tier, a.shadow, a.durable, a.unread) == ("cpu", "", False, False)
    a.tier = "ssd"
    a.durable = True
    assert (a.tier, a.shadow, a.durable, a.unread) == ("ssd", "", True, False)
    a.unread = True
    assert a._where is b._where  # one shared value, not one a record
    a.shadow = "remote"
    a.unread = False
    assert (a.tier, a.shadow, a.durable, a.unread) == ("ssd", "remote", True, False)
    assert (b.tier, b.shadow, b.durable, b.unread) == ("ssd", "", True, True)
    assert a == ObjectRecord(ObjectMeta("a", 10, "c"), "ssd", "remote", True, False)
    assert a != b and "tier='ssd'" in repr(a) and "shadow='remote'" in repr(a)
    assert sys.getsizeof(a) <= 48  # two slots and the collector's header (five were 72)


def test_a_context_record_shares_its_names_and_keeps_pinning_aside() -> None:
    """A ContextRecord per context: its form, tenant and namespace are one shared value, and
    pinning (an operator's, rare) is kept with the other rare fields: nine slots, not twelve."""
    a = ContextRecord("a", "none", tenant="t", namespace="n")
    b = ContextRecord("b", "none", tenant="t", namespace="n")
    assert a._names is b._names and (a.variant, a.tenant, a.namespace) == ("none", "t", "n")
    a.variant = "int8"
    assert (a.variant, a.tenant, a.namespace, b.variant) == ("int8", "t", "n", "none")
    assert not a.pinned and a._rare is None
    a.pinned = True
    assert a.pinned and a._rare is not None and not b.pinned
    a.pinned = False
    assert a._rare is None  # nothing aside any more
    assert ContextRecord("c", pinned=True).pinned
    assert sys.getsizeof(a) <= 104  # nine slots and the collector's header (twelve were 128)
