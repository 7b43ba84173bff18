"""What a restart keeps of the variants the daemon made (``settle_variants``): a complete one
(its marker found) replaces its original, and what a compression cut short left is deleted.
The markers and the daemon's objects are picked out of every object found in one pass
(issue 42); a marker's key need not be a derived one (a token-dropped variant's manifest)."""

from __future__ import annotations

import asyncio
from typing import cast

from kvtierd.engine.context_kv import MARKER_LAYOUT, variant_key
from kvtierd.engine.variant_writer import Settled, made_or_marking, settle_variants
from kvtierd.kernels.placeholder import manifest_key
from kvtierd.storage import Tier
from kvtierd.types import ObjectMeta


class _Tier:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    async def delete(self, key: str, *, tenant: str = "") -> None:
        self.deleted.append(key)


def _settle(found: list[tuple[ObjectMeta, str]]) -> tuple[Settled, list[str]]:
    tier = _Tier()
    tiers = {"ssd": cast(Tier, tier), "remote": cast(Tier, tier)}
    picked = made_or_marking(found)
    return asyncio.run(settle_variants(found, picked, tiers, "remote")), tier.deleted


def test_without_a_marker_the_objects_the_daemon_made_are_leftovers() -> None:
    plain = (ObjectMeta("a/0", 8, "a"), "ssd")
    cut_short = (ObjectMeta(variant_key("a/0", "int8"), 4, "a", variant="int8"), "ssd")
    settled, deleted = _settle([plain, cut_short])
    assert (settled.objects, settled.markers, deleted) == ([plain], {}, [cut_short[0].key])
    found = [plain, (ObjectMeta("b/0", 8, "b"), "ssd")]
    settled, deleted = _settle(found)
    assert settled.objects is found and deleted == []  # nothing to do: no copy made


def test_a_token_dropped_variant_whose_manifest_is_found_replaces_its_original() -> None:
    chunks = [(ObjectMeta(f"c\x00knorm@0.5\x00{i}", 4, "c", variant="knorm@0.5"), "ssd")
              for i in range(2)]  # fmt: skip
    manifest = ObjectMeta(manifest_key("d1g"), 2, "c", variant="knorm@0.5", layout=MARKER_LAYOUT)
    original = [(ObjectMeta("c/0", 8, "c"), "remote"), (ObjectMeta("c/1", 8, "c"), "ssd")]
    settled, deleted = _settle([*original, *chunks, (manifest, "ssd")])
    assert settled.objects == chunks
    assert settled.markers == {"c": (manifest, "ssd")}
    assert settled.references == {"c": [original[0]]}  # kept in the reference tier
    assert deleted == ["c/1"]  # an original's copy elsewhere was superseded
