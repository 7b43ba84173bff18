"""ObjectMeta: one per stored object, so lean (issue 42), and otherwise the frozen value it was."""

from __future__ import annotations

import sys
from dataclasses import FrozenInstanceError

import pytest

from kvtierd import types
from kvtierd.types import ObjectKind, ObjectMeta


def _meta(key: str = "a", **fields: object) -> ObjectMeta:
    return ObjectMeta(key, 1024, "ctx", dtype="bfloat16", shape=(2, 16), layout="KV_2LTD",
                      tenant="t", token_count=16, **fields)  # type: ignore[arg-type]  # fmt: skip


def test_objects_of_one_kind_share_it() -> None:
    a, b = _meta("a", checksum=1), _meta("b", position=3)
    assert a.kind is b.kind
    assert (a.variant, a.dtype, a.shape, a.layout, a.tenant, a.token_count, a.durable) == (
        "none", "bfloat16", (2, 16), "KV_2LTD", "t", 16, False)  # fmt: skip
    assert _meta("c", durable=True).kind is not a.kind
    # 16 bytes of the collector's header, 16 of the object's, 8 a slot: eight slots
    assert sys.getsizeof(a) <= 96


def test_equal_and_hashed_by_its_fields() -> None:
    assert _meta("a", checksum=7) == _meta("a", checksum=7)
    assert hash(_meta("a", checksum=7)) == hash(_meta("a", checksum=7))
    assert _meta("a") != _meta("b")
    assert _meta("a") != _meta("a").replace(tenant="u")  # a field of its kind
    assert _meta("a") != _meta("a", parent_context_id="p")
    assert _meta("a").__eq__("a") is NotImplemented


def test_of_kind_is_the_constructors_object() -> None:
    a = _meta("a", checksum=5, position=2, kept_indices=b"\x01\x00\x00\x00")
    b = ObjectMeta.of_kind("a", 1024, "ctx", a.kind, checksum=5, position=2,
                           kept_indices=b"\x01\x00\x00\x00")  # fmt: skip
    assert a == b
    assert repr(a) == repr(b)


def test_replace_makes_a_changed_copy() -> None:
    a = _meta("a")
    b = a.replace(durable=True, checksum=9, position=4)
    assert (b.durable, b.checksum, b.position, b.key, b.tenant) == (True, 9, 4, "a", "t")
    assert (a.durable, a.checksum, a.position) == (False, 0, None)
    with pytest.raises(TypeError, match="no field 'colour'"):
        a.replace(colour="red")


def test_frozen() -> None:
    a = _meta("a")
    with pytest.raises(FrozenInstanceError):
        a.key = "b"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        del a.checksum
    with pytest.raises(AttributeError):
        a.colour = "red"  # type: ignore[attr-defined]


def test_repr_names_every_field() -> None:
    text = repr(_meta("a", position=1))
    assert text.startswith("ObjectMeta(key='a', size_bytes=1024, context_id='ctx', variant='none'")
    assert text.endswith("durable=False, parent_context_id='', position=1)")


def test_kinds_held_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts naming a new layout each must not grow the shared kinds without bound."""
    monkeypatch.setattr(types, "_KINDS", {})
    monkeypatch.setattr(types, "_KINDS_HELD", 8)
    metas = [ObjectMeta(f"k{i}", 1, layout=f"L{i}") for i in range(20)]
    assert len(types._KINDS) <= 8
    assert [m.layout for m in metas] == [f"L{i}" for i in range(20)]
    assert ObjectKind.of(variant="none", dtype="uint8", shape=(), layout="L19", tenant="",
                         token_count=0, durable=False) is metas[-1].kind  # fmt: skip


def test_a_put_shares_its_size_and_kind_strings_with_other_puts() -> None:
    """Two puts decoded from the wire: equal sizes are one int object, not one each (issue 42:
    28 bytes an object above 256). A context id is left to the index (``numbered``)."""
    from kvtierd.rpc import kvtier_pb2 as pb
    from kvtierd.server.convert import meta_from_spec
    from kvtierd.server.identity import Caller

    specs = [pb.ObjectSpec(key=k, context_id="ctx", size_bytes=int("70000"), dtype="uint8")
             for k in ("a", "b")]  # fmt: skip
    a, b = (meta_from_spec(s, Caller()) for s in specs)
    assert a.size_bytes == b.size_bytes == 70000
    assert a.size_bytes is b.size_bytes
    assert a.kind is b.kind
