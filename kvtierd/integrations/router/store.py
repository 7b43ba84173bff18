"""Store requests: ``"kvtierd": {"context_tokens": N, "variant": v}`` on a completion request
(``"scope": s`` too for a scoped context, ``kvtierd.router_protocol``).

The LMCache plugin builds the variant while vLLM serves the request (``store_request.py``);
the router checks what it can before vLLM prefills — the variant, ``N`` a multiple of LMCache's
``chunk_size``, a kept count of whole chunks, no other variant already stored for the context —
tags the request, and after vLLM answers checks that the variant's manifest is in the daemon.
A token-dropping store that built nothing is answered as an error naming the likely causes,
never as a plain success. Quantization-only variants (``int8``) are only tagged: the plugin
stores the chunks it puts in that form, under their own LMCache keys (no manifest to check);
a scope refuses them, since a scoped store writes nothing under keys production loads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtierd.client import AsyncKVClient
from kvtierd.errors import AlreadyExistsError, InvalidArgumentError
from kvtierd.integrations.router.rewrite import read_manifest
from kvtierd.kernels.placeholder import kept_tokens, manifest_key
from kvtierd.router_protocol import ContextRequest, context_digest, loaded_value
from kvtierd.variants import Variant, option_default, parse_variant

KEPT_HEADER = "x-kvtierd-kept-tokens"
"""On a stored token-dropping variant's answer: the entries it keeps, ``M``."""


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """What a store request asks for: ``variant`` of the first ``num_tokens`` tokens, named
    ``digest``."""

    digest: str
    variant: Variant
    num_tokens: int
    scope: str = ""
    kept_tokens: int = 0  # M of a token-dropping variant (placeholder.kept_tokens)
    # snapkv: the context's last ``window`` token ids, whose queries the plugin recomputes
    window_ids: tuple[int, ...] = ()
    salt: str = ""  # the key prefix of the request's cache_salt (salt.salt_key_prefix)

    @property
    def manifest_key(self) -> str:
        """One manifest per production context, one per (context, variant) in a scope; within
        the request's salt (the plugin stores a salted request's variant under it)."""
        return self.salt + manifest_key(self.digest, str(self.variant) if self.scope else "")

    def context_id(self, variant: str) -> str:
        """The daemon context of ``variant`` of this context (``kvtierctl evict`` takes it)."""
        return self.salt + loaded_value(self.digest, variant)

    @property
    def tags(self) -> dict[str, str]:
        """``kv_transfer_params`` that make the request a store request for the plugin."""
        tags = {
            "lmcache.tag.kvtierd_context": self.digest,
            "lmcache.tag.kvtierd_variant": str(self.variant),
            "lmcache.tag.kvtierd_context_tokens": str(self.num_tokens),
        }
        if self.window_ids:
            tags["lmcache.tag.kvtierd_window"] = " ".join(map(str, self.window_ids))
        return tags | ({"lmcache.tag.kvtierd_scope": self.scope} if self.scope else {})


async def prepare_store(
    client: AsyncKVClient,
    model: str,
    token_ids: list[int],
    spec: ContextRequest,
    chunk_tokens: int,
    *,
    salt: str = "",
) -> StoreTarget:
    """Check a request's ``"kvtierd"`` store field before vLLM prefills anything: raises
    :class:`InvalidArgumentError` for what cannot be built, :class:`AlreadyExistsError` when a
    production context is stored as another token-dropped variant (one manifest per context).
    ``salt``: the key prefix of the request's ``cache_salt``."""
    n = spec.context_tokens
    if not 0 < n <= len(token_ids):
        raise InvalidArgumentError(
            f"kvtierd.context_tokens={n} outside the prompt's {len(token_ids)} tokens"
        )
    variant = checked_variant(spec.variant)
    digest = context_digest(model, token_ids[:n], spec.scope)
    target = StoreTarget(digest, variant, n, spec.scope, salt=salt)
    if not variant.drops_tokens:
        if spec.scope:
            raise InvalidArgumentError(
                f"kvtierd.variant {variant} in a scope: a scoped store writes only a "
                "token-dropped variant (a quantized one would go under the chunks' own keys, "
                "which production prompts load)"
            )
        return target
    if variant.method == "snapkv":
        window = dict(variant.options).get("window", option_default("snapkv", "window"))
        target = replace(target, window_ids=tuple(token_ids[max(0, n - window) : n]))
    if n % chunk_tokens:
        raise InvalidArgumentError(
            f"kvtierd.context_tokens={n}: must be a multiple of LMCache's chunk_size "
            f"{chunk_tokens} (the router's --chunk-size)"
        )
    kept = kept_tokens(n, variant, chunk_tokens)
    if kept % chunk_tokens:  # a page method's whole pages (kept_tokens)
        raise InvalidArgumentError(
            f"kvtierd.context_tokens={n} as {variant} keeps {kept} tokens (whole pages), not "
            f"a multiple of LMCache's chunk_size {chunk_tokens}: choose another ratio or method"
        )
    target = replace(target, kept_tokens=kept)
    stored = await read_manifest(client, target.manifest_key)
    if stored is not None and stored.variant != str(variant):
        raise AlreadyExistsError(
            f"context {target.digest} is already stored as {stored.variant}; evict it first "
            f"(kvtierctl evict {target.context_id(stored.variant)})"
        )
    return target


def checked_variant(text: str) -> Variant:
    """``text`` parsed, or :class:`InvalidArgumentError` naming the field."""
    try:
        return parse_variant(text)
    except ValueError as e:
        raise InvalidArgumentError(f"kvtierd.variant: {e}") from e


async def store_failure(client: AsyncKVClient, target: StoreTarget) -> str:
    """Why ``target`` is not stored after vLLM answered its request, ``""`` when it is."""
    if not target.variant.drops_tokens:
        return ""
    stored = await read_manifest(client, target.manifest_key)
    if stored is not None and (stored.variant, stored.num_tokens) == (
        str(target.variant),
        target.num_tokens,
    ):
        return ""
    return (
        f"vLLM answered, but {loaded_value(target.digest, str(target.variant))} "
        f"({target.num_tokens} tokens) is not stored: the kvtierd LMCache plugin did not build "
        "it and logged why in vLLM's log ('kvtierd plugin: put failed'). Likely causes: vLLM "
        "runs without the kvtierd plugin, the request set lmcache.skip_save (LMCache then puts "
        "nothing), the model's position encoding does not allow token dropping, or the daemon "
        "lost the context's chunks before the plugin read them"
    )
