"""Issue 42: the engine keeps an ObjectRecord per object, a million of them at scale. Its tier,
persistent copy and commit flags are one object shared by every record with the same ones."""

from __future__ import annotations

import sys

from kvtierd.engine.state import ObjectRecord
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
