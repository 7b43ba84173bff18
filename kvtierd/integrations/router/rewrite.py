"""Which stored compressed context a prompt starts with, and the request that loads it.

The router tokenizes the prompt, derives the digest of every chunk-aligned prefix, asks the
daemon for their manifests in one Lookup, and takes the longest stored one. It then holds the
placeholder chunks (Lookup with ``hold_s``) so they cannot be evicted before vLLM loads them;
if any is missing the request goes out unchanged (fail closed: a placeholder prompt must never
be prefilled from its ids).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.client import AsyncKVClient
from kvtierd.errors import NotFoundError
from kvtierd.kernels.placeholder import Manifest, manifest_key
from kvtierd.router_protocol import context_digest


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A request's prompt as placeholder ids + suffix, and the tags that name its context."""

    prompt_ids: list[int]
    manifest: Manifest
    manifest_key: str

    @property
    def kv_transfer_params(self) -> dict[str, str]:
        """The context and variant, and how many leading tokens are placeholders: the plugin
        reports those chunks as stored even when one is missing, so that vLLM's load fails
        (and the request with it) instead of prefilling placeholder ids; and the manifest,
        whose ``chunk_keys`` the plugin loads the placeholder chunks from."""
        return {
            "lmcache.tag.kvtierd_manifest": self.manifest_key,
            "lmcache.tag.kvtierd_context": self.manifest.digest,
            "lmcache.tag.kvtierd_variant": self.manifest.variant,
            "lmcache.tag.kvtierd_placeholder_tokens": str(len(self.manifest.placeholder_ids)),
        }


async def find_rewrite(
    client: AsyncKVClient,
    model: str,
    token_ids: list[int],
    chunk_tokens: int,
    hold_s: float,
    *,
    scope: str = "",
    variant: str = "",
    salt: str = "",
) -> Rewrite | None:
    """The rewrite of ``token_ids`` through its longest stored compressed prefix, or None:
    production (``scope`` ``""``) through whichever variant a prefix is stored in, a scoped
    request only through ``variant`` of a prefix stored in its scope (``router_protocol``).
    ``salt``: the key prefix of the request's ``cache_salt`` (``salt.salt_key_prefix``): only
    a variant stored under the same salt is found (the plugin stores a salted store request's
    manifest under it)."""
    lengths = list(range(chunk_tokens, len(token_ids), chunk_tokens))  # >= 1 suffix token
    if not lengths:
        return None
    digests = [context_digest(model, token_ids[:n], scope) for n in lengths]
    keys = [salt + manifest_key(d, variant) for d in digests]
    found = await client.lookup(keys)
    for n, key, ok in sorted(zip(lengths, keys, found.found, strict=True), reverse=True):
        if not ok:
            continue
        manifest = await read_manifest(client, key)
        if manifest is None or manifest.num_tokens != n:
            continue
        if variant and manifest.variant != variant:
            continue
        held = await client.lookup(list(manifest.chunk_keys), hold_s=hold_s)
        if held.prefix_hits != len(manifest.chunk_keys):
            continue  # partly evicted: serve the real prompt
        return Rewrite(list(manifest.placeholder_ids) + token_ids[n:], manifest, key)
    return None


async def read_manifest(client: AsyncKVClient, key: str) -> Manifest | None:
    """The manifest stored under ``key``, or ``None``."""
    if not (await client.lookup([key])).found[0]:
        return None
    try:
        return Manifest.from_bytes(bytes(await client.get(key)))
    except NotFoundError:
        return None  # evicted between the two calls
