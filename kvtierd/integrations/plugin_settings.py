"""The plugin's settings (LMCache ``extra_config`` entries ``kvtierd.*``), counters and keys."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtierd.errors import ConfigError, InvalidArgumentError
from kvtierd.integrations.salt import SALT_TAG, valid_tag
from kvtierd.variants import parse_variant

logger = logging.getLogger(__name__)

_KNOWN = ("socket_path", "variant", "hold_s", "durable", "timeout_s")


def _bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


PROMPT_TAG = "kvtierd_request"
"""``lmcache.tag.kvtierd_request``: the id under which ``kvtierd router`` registered the request's
prompt with the daemon (``KVStore.SetContextTokens``); the plugin names the context the prompt
made or read (``prompt_links.py``)."""

ADVISED = "advised"
"""``kvtierd.variant: advised``: ask the daemon's write advice (``KVStore.Advise``) for every
put (``put_decision.py``)."""

ADVISED_BEFORE = "plan"
"""``advised``'s name before issue 17, accepted one release with a logged warning."""


def _variant(value: Any) -> str:
    """``kvtierd.variant``, with the old name of ``advised`` read as it (and logged)."""
    variant = str(value)
    if variant != ADVISED_BEFORE:
        return variant
    logger.warning(
        "LMCache extra_config kvtierd.variant: %r is deprecated, use %r (the daemon's write "
        "advice per put, the default); %r will be refused from the next release",
        ADVISED_BEFORE, ADVISED, ADVISED_BEFORE,
    )  # fmt: skip
    return ADVISED


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """``socket_path``: the daemon; ``variant``: the form of stored chunks — ``advised`` (the
    daemon's write advice per put, the default), or a fixed ``none``, ``int8`` or ``int4`` (a
    token-dropping variant is only ever a ``kvtierd router`` store request's, which names it in
    its own tag); ``hold_s``: how long a pinned lookup holds the objects for the load;
    ``durable``: commit to disk-backed tiers before acknowledging a put."""

    socket_path: str = ""
    variant: str = ADVISED
    hold_s: float = 30.0
    durable: bool = False
    timeout_s: float = 30.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> PluginSettings:
        given = {
            k.removeprefix("kvtierd."): v for k, v in extra.items() if k.startswith("kvtierd.")
        }
        unknown = sorted(set(given) - set(_KNOWN))
        if unknown:
            raise ConfigError(
                f"LMCache extra_config: unknown kvtierd settings {unknown}; known: "
                + ", ".join(f"kvtierd.{k}" for k in _KNOWN)
            )
        s = cls(
            socket_path=str(given.get("socket_path", "")),
            variant=_variant(given.get("variant", ADVISED)),
            hold_s=float(given.get("hold_s", 30.0)),
            durable=_bool(given.get("durable", False)),
            timeout_s=float(given.get("timeout_s", 30.0)),
        )
        try:
            drops_tokens = s.variant != ADVISED and parse_variant(s.variant).drops_tokens
        except ValueError as e:
            raise ConfigError(f"LMCache extra_config kvtierd.variant: {e} (or '{ADVISED}')") from e
        if drops_tokens:
            # Every put would store the original and then fail: dropping tokens needs a
            # router store request (its context and token count), which tags its own variant.
            raise ConfigError(
                f"LMCache extra_config kvtierd.variant {s.variant!r} drops tokens, which only a "
                "`kvtierd router` store request can ask for (its request field names the "
                f"variant); use {ADVISED}, none, int8 or int4"
            )
        if s.hold_s < 0:
            raise ConfigError(f"LMCache extra_config kvtierd.hold_s must be >= 0, got {s.hold_s}")
        return s


@dataclass(slots=True)
class PluginStats:
    """Counters a test (or an operator) reads to see that the cache is really used."""

    lookups: int = 0
    hit_chunks: int = 0
    put_chunks: int = 0
    put_bytes: int = 0
    advised_puts: int = 0  # puts whose form came from the daemon's write advice
    advised_chunks: int = 0  # chunks quantized on the device because the advice said so
    continued_puts: int = 0  # puts that joined the context of the prefix they extend
    branched_puts: int = 0  # puts that started a child context after a shared prefix (issue 29)
    claimed_chunks: int = 0  # missing placeholder chunks reported as hits (their load fails)
    get_chunks: int = 0
    placeholder_variants: int = 0
    held_chunks: int = 0  # context chunks a variant was built from that were read from the daemon
    prompt_links: int = 0  # (request, context) pairs reported to the daemon (prompt_links.py)
    prompt_link_errors: int = 0  # of those, the daemon refused or could not be reached
    errors: int = 0
    last_error: str = ""
    unreachable: int = 0  # calls that found the daemon gone (daemon_link: one WARNING each outage)
    # calls answered without the daemon while it was unreachable, by kind (lookups/puts/gets)
    offline: dict[str, int] = field(default_factory=dict)


def key_string(key: Any) -> str:
    """An LMCache ``CacheEngineKey`` as a daemon key, without its tags (a request's tags name
    what to do with it, not a different KV) but for the request's ``cache_salt``, which does
    (``salt.py``: ``[ns:<name>:]<digest>@`` first). A salt tag ``salt.salt_tag`` did not make
    (a client's own, through a connector that does not write it) raises
    :class:`InvalidArgumentError`: the plugin answers it as a miss, never as another's key."""
    base = (
        f"{key.model_name}@{key.world_size}@{key.worker_id}@{key.chunk_hash_hex}@{key._dtype_str}"
    )
    return salt_prefix(key) + base


def salt_prefix(key: Any) -> str:
    """What every daemon key of a key's request begins with: ``<salt tag>@`` (``""`` without
    a salt). Everything the plugin writes for a salted request carries it: its chunks, and
    a store request's variant, manifest and context ids (so a salt reads only its own).
    ``InvalidArgumentError`` for a tag the connector did not make (:func:`key_string`)."""
    salt = tag(key, SALT_TAG)
    if not salt:
        return ""
    if not valid_tag(salt):
        raise InvalidArgumentError(
            f"lmcache.tag.{SALT_TAG} {salt[:80]!r} is not a salt tag of KvtierLMCacheConnectorV1 "
            "([ns:<namespace>:]<32 hex digits>); use that connector, which writes it from the "
            "request's cache_salt"
        )
    return f"{salt}@"


def tag(key: Any, name: str) -> str:
    """The value of ``lmcache.tag.<name>`` on a key, or ``""``."""
    for k, v in key.tags or ():
        if k == name:
            return str(v)
    return ""


def is_rewritten(key: Any) -> bool:
    """Whether a key's request is a rewritten placeholder request (``[M placeholder ids] +
    suffix``, tagged by the router with its placeholder token count)."""
    return bool(tag(key, "kvtierd_placeholder_tokens"))


def placeholder_chunks(key: Any, chunk_tokens: int) -> int:
    """How many chunks of a rewritten request are placeholders (``kvtierd_placeholder_tokens``,
    set by the router); 0 for any other request."""
    tokens = tag(key, "kvtierd_placeholder_tokens")
    return int(tokens) // chunk_tokens if tokens else 0
