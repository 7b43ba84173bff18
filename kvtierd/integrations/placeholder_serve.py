"""The plugin's side of the one servable form (``kernels/placeholder.py``): it tells the daemon
the model's rope (:func:`register_model_card`), and it serves a rewritten request's placeholder
chunks from the daemon keys its manifest lists (:class:`PlaceholderKeys`).

A variant the plugin built (a router store request) lists LMCache's own keys of the
placeholder prompt, so the translation is the identity; a variant the daemon's executor built
lists keys the daemon derived (it cannot compute LMCache's chunk hashes), so vLLM's lookup,
load and put of the placeholder chunks are translated to those.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvtierd.errors import InvalidArgumentError, KvtierError
from kvtierd.integrations.daemon_io import PutItem, put_many, read_bytes
from kvtierd.integrations.plugin_settings import key_string, salt_prefix, tag
from kvtierd.kernels.placeholder import (
    MANIFEST_PREFIX,
    MODEL_CARD_LAYOUT,
    Manifest,
    ModelCard,
    model_card_key,
    read_model_rope,
)

logger = logging.getLogger(__name__)
MANIFEST_TAG = "kvtierd_manifest"
"""``lmcache.tag.kvtierd_manifest``: the key of the manifest a rewritten request loads."""


def model_card(model: str) -> ModelCard:
    """The card of the model in directory ``model`` (refused, with the reason, when its
    position encoding does not allow token dropping or its config cannot be read)."""
    from kvtierd.integrations.placeholder_store import rope_spec

    try:
        rope = read_model_rope(model)
        spec = rope_spec(model, rope)
    except (InvalidArgumentError, OSError, ValueError, KeyError) as e:
        return ModelCard(model=model, refused=f"model {model}: {e}")
    return ModelCard(
        model=model,
        head_dim=spec.head_dim,
        inv_freq=spec.inv_freq,
        vocab_size=rope.vocab_size,
        special_ids=rope.special_ids,
    )


def register_model_card(client: Any, model: str) -> ModelCard:
    """Give the daemon ``model``'s card (it builds the servable form of its own token-dropped
    variants with it); the daemon keeps the latest, never as an object."""
    card = model_card(model)
    key = model_card_key(model)
    data = torch.frombuffer(bytearray(card.to_bytes()), dtype=torch.uint8)
    put_many(client, [PutItem(key, data, key, "none", MODEL_CARD_LAYOUT, 0)])
    logger.info("kvtierd plugin: model card of %s registered%s", model,
                f" (token dropping refused: {card.refused})" if card.refused else "")  # fmt: skip
    return card


class PlaceholderKeys:
    """LMCache's keys of a rewritten request's placeholder chunks -> the daemon keys of its
    manifest, per manifest (a bounded, thread-safe cache: lookups, loads and puts run on
    different LMCache threads; a manifest key always names the same chunks while it exists)."""

    def __init__(self, plugin: Any, capacity: int = 64) -> None:
        self.plugin = plugin
        self.capacity = capacity
        self._maps: OrderedDict[str, dict[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def translate(self, keys: Sequence[Any], names: list[str]) -> list[str]:
        """``names`` (``key_string`` of ``keys``) with each placeholder chunk's key replaced
        by the daemon key of its chunk; unchanged for a request that is not rewritten, and for
        one naming a manifest of another salt than its own (the router names its own salt's:
        translated, another salt's keys would be read under this one's)."""
        manifest_key = tag(keys[0], MANIFEST_TAG) if keys else ""
        if not manifest_key:
            return names
        salt = salt_prefix(keys[0])
        if not manifest_key.startswith(salt + MANIFEST_PREFIX):
            logger.warning("kvtierd plugin: manifest %.120s is not of the request's salt; "
                           "its chunks are looked up untranslated", manifest_key)  # fmt: skip
            return names
        table = self._table(manifest_key, salt)
        return [table.get(n, n) for n in names]

    def _table(self, manifest_key: str, salt: str) -> dict[str, str]:
        with self._lock:
            table = self._maps.get(manifest_key)
            if table is not None:
                self._maps.move_to_end(manifest_key)
                return table
        try:
            manifest = Manifest.from_bytes(read_bytes(self.plugin.client, manifest_key))
        except KvtierError as e:  # evicted since the router read it: the load fails closed
            logger.warning("kvtierd plugin: manifest %s: %s", manifest_key, e)
            return {}
        lmcache_keys = placeholder_chunk_keys(self.plugin, manifest.placeholder_ids, salt)
        table = dict(zip(lmcache_keys, manifest.chunk_keys, strict=True))
        with self._lock:
            self._maps[manifest_key] = table
            while len(self._maps) > self.capacity:
                self._maps.popitem(last=False)
        return table


def placeholder_chunk_keys(plugin: Any, ids: Sequence[int], salt: str = "") -> list[str]:
    """The daemon keys of the placeholder prompt ``ids``' chunks as a request with salt prefix
    ``salt`` (``plugin_settings.salt_prefix``) names them: LMCache's chunk keys (the same
    hashing as its lookups; the plugin's LMCache config and metadata), which a salt prefixes
    and never changes otherwise (LMCache hashes tokens only)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    db = ChunkedTokenDatabase(plugin.config, plugin.metadata)
    rows = db.process_tokens(tokens=torch.tensor(list(ids)))
    return [salt + key_string(r[2]) for r in rows]
