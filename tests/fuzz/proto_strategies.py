"""Hypothesis strategies that build any message of kvtierd's API from its proto descriptor.

Every field may be left unset or get a hostile value: integers at their type's edges (huge,
negative, zero), floats including NaN and infinities, unicode and path-like strings, random
bytes, empty and duplicated repeated fields. Fields whose name says what they hold (``key``,
``allocation_ids``, ``tier``...) also draw from :class:`Pools` of values the daemon knows, so a
fuzzed Commit can name a real allocation and a fuzzed Get a real key: the calls then reach the
engine instead of stopping at the first lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from kvtierd.rpc import kvtier_pb2 as pb

F = FieldDescriptor
INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
ALIAS_BOMB = "placer: lru\na0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)
)
"""A 'billion laughs' policy: the ApplyPolicy of a few hundred bytes that took the daemon down
before aliases were refused (issue 16.4)."""
HOSTILE_STRINGS = (
    "",
    " ",
    "../../../../etc/passwd",
    "/abs/path",
    "a/b",
    "t1/k0",
    "nul\x00byte",
    "\u202eright-to-left",
    "日本語キー",
    "🙂" * 8,
    "{hash}tag",
    "*",
    "calibrate/x",
    "x" * 1025,  # one byte over the key limit
    "y" * 5000,
)
DTYPES = ("uint8", "bfloat16", "float16", "float32", "int64", "bool", "complex128", "")
VARIANTS = ("", "none", "int8", "int4", "knorm@0.5", "knorm@0.5+int8", "bogus@7")
ORDERS = ("", "recency", "frequency", "size", "id", "nonsense")


@dataclass
class Pools:
    """Values the daemon knows, harvested from its answers while the fuzzer runs."""

    keys: list[str] = field(default_factory=list)
    contexts: list[str] = field(default_factory=list)
    allocation_ids: list[str] = field(default_factory=list)
    lease_ids: list[str] = field(default_factory=list)
    tiers: list[str] = field(default_factory=lambda: ["cpu", "ssd"])
    policies: list[str] = field(default_factory=list)

    def harvest(self, reply: object) -> None:
        """Remember ids found in a reply (bounded, so a long run does not grow without end)."""
        if isinstance(reply, pb.AllocateResponse):
            self.allocation_ids.extend(a.allocation_id for a in reply.allocations)
        if isinstance(reply, pb.GetResponse):
            self.lease_ids.extend(lease.lease_id for lease in reply.leases)
        for pool in (self.allocation_ids, self.lease_ids):
            del pool[:-200]


def _pick(values: list[str]) -> st.SearchStrategy[str]:
    """A value of ``values`` as it is when drawn (the pool grows during the run)."""
    return st.integers(0, 10_000).map(lambda i: values[i % len(values)] if values else "")


def _string(name: str, pools: Pools) -> st.SearchStrategy[str]:
    base = st.one_of(st.text(max_size=24), st.sampled_from(HOSTILE_STRINGS))
    named = {
        "key": pools.keys,
        "keys": pools.keys,
        "context_id": pools.contexts,
        "context_ids": pools.contexts,
        "allocation_ids": pools.allocation_ids,
        "lease_ids": pools.lease_ids,
        "tier": pools.tiers,
        "yaml": pools.policies,
    }
    fixed = {"dtype": DTYPES, "variant": VARIANTS, "order_by": ORDERS}
    if name in named:
        return st.one_of(_pick(named[name]), _pick(named[name]), base)
    if name in fixed:
        return st.one_of(st.sampled_from(fixed[name]), base)
    return base


def _integer(fd: FieldDescriptor) -> st.SearchStrategy[int]:
    lo, hi = INT_RANGES[fd.type]
    # 1: GetStream part_bytes=1 sent a message per byte (issue 16.8)
    edges = [v for v in (lo, hi, 0, 1, -1, 2**31, 2**32, 2**53, 2**62) if lo <= v <= hi]
    small = st.integers(max(lo, 0), min(hi, 1 << 16))  # sizes an arena can actually hold
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), small)


def scalar(fd: FieldDescriptor, pools: Pools) -> st.SearchStrategy[object]:
    if fd.type in INT_RANGES:
        return _integer(fd)
    if fd.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        # 1e300: a lease or hold that never expired (issue 16.8)
        edges = st.sampled_from([0.0, -0.0, -1.0, 1e-9, 0.001, 1e300, 1e308, -1e308])
        return st.one_of(st.floats(width=64 if fd.type == F.TYPE_DOUBLE else 32), edges)
    if fd.type == F.TYPE_BOOL:
        return st.booleans()
    if fd.type == F.TYPE_STRING:
        return _string(fd.name, pools)
    if fd.type == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=70_000))
    if fd.type == F.TYPE_ENUM:
        return st.integers(-5, 5)
    if fd.type == F.TYPE_MESSAGE:
        return message(fd.message_type, pools)
    raise TypeError(f"no strategy for field {fd.full_name} of type {fd.type}")


LONG_TOKENS = (1 << 20) + 1  # one over SetContextTokens' per-request bound (issue 16.3)


def _value(fd: FieldDescriptor, pools: Pools) -> st.SearchStrategy[object]:
    one = scalar(fd, pools)
    if not fd.is_repeated:
        return one
    lists = st.lists(one, max_size=6)
    if fd.name == "token_ids":  # memory a tenant could make the daemon keep
        lists = st.one_of(lists, st.sampled_from([[7] * 50_000, [7] * LONG_TOKENS]))
    return st.one_of(lists, lists.map(lambda xs: xs + xs[:2]))  # duplicated entries


def message(descriptor: Descriptor, pools: Pools) -> st.SearchStrategy[object]:
    """Messages of ``descriptor``'s class: each field unset or set; of a oneof, at most one."""
    cls = _message_class(descriptor)
    plain = [f for f in descriptor.fields if f.containing_oneof is None]
    oneofs = list(descriptor.oneofs)

    @st.composite
    def build(draw: st.DrawFn) -> object:
        msg = cls()
        chosen = [f for f in plain if draw(st.booleans())]
        for group in oneofs:
            pick = draw(st.sampled_from([None, *group.fields]))
            if pick is not None:
                chosen.append(pick)
        for fd in chosen:
            _assign(msg, fd, draw(_value(fd, pools)))
        return msg

    return build()


def _assign(msg: object, fd: FieldDescriptor, value: object) -> None:
    if fd.is_repeated:
        getattr(msg, fd.name).extend(value)  # type: ignore[arg-type]
    elif fd.type == F.TYPE_MESSAGE:
        getattr(msg, fd.name).CopyFrom(value)
    else:
        setattr(msg, fd.name, value)


def _message_class(descriptor: Descriptor) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)
