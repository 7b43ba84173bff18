"""What the remote tier stores in Redis: options, the key scheme, the header and two scripts.

Key scheme (docs/remote-tier.md): an object ``(tenant, key)`` lives under the hash tag
``h = xxh3_128(namespace, tenant, key)`` (length-prefixed, hex), so no client string reaches a
Redis key, and every key of one object hashes to one cluster slot (one node, one pipeline, one
atomic script)::

    <namespace>:{<h>}:m                 header (JSON: ObjectMeta + parts + generation)
    <namespace>:{<h>}:<gen>:<i>         part i (<= part_bytes), gen = 16 random hex per write

Parts carry a per-write generation so two writers of one key never mix parts, and the header
is set last, atomically with the check that every part exists (``COMMIT_SCRIPT``).
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import xxhash

from kvtierd.config import parse_size
from kvtierd.errors import ConfigError, CorruptObjectError
from kvtierd.storage.ssd_format import check_parent_field, check_position_field
from kvtierd.types import ObjectMeta

HEADER_VERSION = 1
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

# Atomic commit. KEYS[1] = header, KEYS[2..] = parts; ARGV[1] = header, ARGV[2] = ttl ms.
# Returns 1 committed, 0 the header already exists, -1 a staged part has expired. On 0 and -1
# the staged parts are removed so a failed write leaves nothing behind.
COMMIT_SCRIPT = """
local function drop_parts()
  for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then drop_parts() return -1 end
end
local ttl = tonumber(ARGV[2])
local ok
if ttl > 0 then
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ttl)
else
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if not ok then drop_parts() return 0 end
for i = 2, #KEYS do
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
end
return 1
"""

# Compare-and-delete. KEYS[1] = header, KEYS[2..] = parts; ARGV[1] = the header as read.
# Deletes only the generation that was read, never a newer object written meanwhile.
DROP_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""


RELABEL_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1
"""
"""Replace a header only if it is still the one read (another daemon may have rewritten or
dropped the object since): the parts stay, named by the same generation."""


def parse_node(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"remote tier: node {text!r} is not 'host:port'")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """The ``options`` of a ``kind: remote`` tier (docs/remote-tier.md). Times in seconds."""

    nodes: tuple[tuple[str, int], ...]
    password: str = ""
    username: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    namespace: str = "kvtierd"
    ttl_s: float = 0.0
    value_bytes: int = 4 << 20
    staging_ttl_s: float = 300.0
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 5.0
    op_timeout_s: float = 10.0
    lookup_budget_s: float = 0.05  # a lookup's wait on the tier (engine/shared_lookups.py)
    health_interval_s: float = 1.0
    write_threads: int = 4
    pipeline_bytes: int = 64 << 20
    scan_on_start: bool = True

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> RemoteOptions:
        """Validate a config ``options`` mapping; unknown keys are errors naming the known."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            allowed = ", ".join(sorted(known))
            raise ConfigError(
                f"remote tier: unknown option(s) {', '.join(unknown)}; known: {allowed}"
            )
        raw_nodes = options.get("nodes")
        if not raw_nodes or isinstance(raw_nodes, str):
            raise ConfigError("remote tier: 'nodes' must be a list of 'host:port' strings")
        values = dict(options)
        values["nodes"] = tuple(parse_node(n) for n in raw_nodes)
        for size_key in ("value_bytes", "pipeline_bytes"):
            if size_key in values:
                values[size_key] = parse_size(values[size_key], f"remote tier: {size_key}")
        opts = cls(**values)
        opts._validate()
        return opts

    def _validate(self) -> None:
        if not _NAMESPACE_RE.match(self.namespace):
            raise ConfigError(
                f"remote tier: namespace {self.namespace!r} must match {_NAMESPACE_RE.pattern}"
            )
        if not 1 <= self.value_bytes <= 512 << 20:  # Redis' proto-max-bulk-len default
            raise ConfigError(f"remote tier: value_bytes {self.value_bytes} not in [1, 512MiB]")
        for name in ("ttl_s", "staging_ttl_s", "connect_timeout_s", "socket_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"remote tier: {name} must be >= 0")
        if self.op_timeout_s <= 0 or self.health_interval_s <= 0 or self.staging_ttl_s <= 0:
            raise ConfigError("remote tier: op_timeout_s, health_interval_s, staging_ttl_s > 0")
        if not 0 < self.lookup_budget_s <= self.op_timeout_s:
            raise ConfigError(
                f"remote tier: lookup_budget_s {self.lookup_budget_s} not in (0, op_timeout_s]"
            )
        if self.write_threads < 1 or self.pipeline_bytes < self.value_bytes:
            raise ConfigError("remote tier: write_threads >= 1 and pipeline_bytes >= value_bytes")


@dataclass(frozen=True, slots=True)
class ObjectKeys:
    """The Redis key names of one object; ``part(gen, i)`` names part ``i`` of a generation."""

    tag: str
    header: str

    def part(self, generation: str, index: int) -> str:
        return f"{self.header[:-2]}:{generation}:{index}"

    def parts(self, generation: str, count: int) -> list[str]:
        return [self.part(generation, i) for i in range(count)]


def object_keys(namespace: str, tenant: str, key: str) -> ObjectKeys:
    """Hash ``(namespace, tenant, key)`` into the object's key names (length-prefixed, so
    ``("a", "bc")`` and ``("ab", "c")`` differ)."""
    h = xxhash.xxh3_128()
    for part in (namespace, tenant, key):
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    tag = h.hexdigest()
    return ObjectKeys(tag=tag, header=f"{namespace}:{{{tag}}}:m")


def header_pattern(namespace: str) -> str:
    """SCAN MATCH pattern for every header of a namespace (the namespace has no glob chars)."""
    return f"{namespace}:{{*}}:m"


def as_bytes(reply: object) -> bytes | None:
    """A GET reply as bytes (the clients run with ``decode_responses=False``)."""
    if reply is None or isinstance(reply, bytes):
        return reply
    raise TypeError(f"unexpected Redis reply type {type(reply).__name__}")


def new_generation() -> str:
    return os.urandom(8).hex()


def part_count(size_bytes: int, part_bytes: int) -> int:
    return -(-size_bytes // part_bytes)


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """One committed object: its metadata (``meta.checksum`` = xxh3_64 of all bytes), its
    part size and count, and the generation naming its parts."""

    meta: ObjectMeta
    part_bytes: int
    parts: int
    generation: str

    def encode(self) -> bytes:
        m = self.meta
        doc = {
            "v": HEADER_VERSION, "key": m.key, "tenant": m.tenant, "size": m.size_bytes,
            "context_id": m.context_id, "variant": m.variant, "dtype": m.dtype,
            "shape": list(m.shape), "layout": m.layout, "token_count": m.token_count,
            "kept_indices": base64.b64encode(m.kept_indices).decode("ascii"),
            "checksum": m.checksum, "part_bytes": self.part_bytes, "parts": self.parts,
            "gen": self.generation,
        }  # fmt: skip
        if m.durable:  # only when set, as the SSD header
            doc["durable"] = True
        if m.parent_context_id:
            doc["parent_context_id"] = m.parent_context_id
        if m.position is not None:  # absent in headers written before issue 31
            doc["position"] = m.position
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ObjectHeader:
        """Parse a stored header; anything malformed is a ``CorruptObjectError``."""
        try:
            d = json.loads(raw)
            if d["v"] != HEADER_VERSION:
                raise ValueError(f"header version {d['v']}")
            meta = ObjectMeta(
                key=str(d["key"]), size_bytes=int(d["size"]), context_id=str(d["context_id"]),
                variant=str(d["variant"]), dtype=str(d["dtype"]),
                shape=tuple(int(x) for x in d["shape"]), layout=str(d["layout"]),
                token_count=int(d["token_count"]),
                kept_indices=base64.b64decode(d["kept_indices"], validate=True),
                tenant=str(d["tenant"]), checksum=int(d["checksum"]),
                durable=d.get("durable", False) is True,
                parent_context_id=check_parent_field(
                    d.get("parent_context_id", ""), d["context_id"], d["key"]
                ),
                position=check_position_field(d.get("position")),
            )  # fmt: skip
            header = cls(meta, int(d["part_bytes"]), int(d["parts"]), str(d["gen"]))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptObjectError(f"remote tier: unreadable header: {e}") from e
        if header.part_bytes < 1 or header.parts != part_count(meta.size_bytes, header.part_bytes):
            raise CorruptObjectError("remote tier: header part count does not match its size")
        return header
