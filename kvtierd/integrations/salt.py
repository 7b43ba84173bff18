"""vLLM's per-request ``cache_salt`` on the LMCache path (issue 41.2).

vLLM mixes a request's ``cache_salt`` into its own prefix-cache block hashes, but LMCache 0.5.6's
in-process connector (``LMCacheConnectorV1``) keys chunks by their tokens and the request's
``lmcache.*`` settings only: the salt never reaches LMCache's keys, so two users' identical
prompts would share chunks through any LMCache storage backend. ``KvtierLMCacheConnectorV1``
(``cpu_connector.py``) therefore writes :data:`SALT_TAG` into every request's LMCache settings
before LMCache looks it up (its value from :func:`salt_tag`, always overwriting what the client
sent), which puts it in LMCache's ``CacheEngineKey`` (tags are part of its equality), and the
plugin prefixes the daemon's key with it (``plugin_settings.key_string``).

The tag carries a digest of the salt, never the salt (a per-user secret: LMCache logs keys).
A salt ``<name>:<rest>`` whose ``<name>`` is a namespace name (``kvtierd.namespaces``) names
that namespace of the connection's tenant: its keys begin ``ns:<name>:``, and the daemon
charges them to the namespace's quota if its YAML configures it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kvtierd import namespaces

SALT_TAG = "kvtierd_salt"
"""``lmcache.tag.kvtierd_salt``: the request's salt as a key prefix (:func:`salt_tag`)."""
CONFIG_KEY = f"lmcache.tag.{SALT_TAG}"
_DIGEST = re.compile(r"[0-9a-f]{32}")


def salt_tag(cache_salt: str | None) -> str:
    """The tag of a request's salt: ``""`` without one, else ``[ns:<name>:]<digest>`` with
    ``<digest>`` 32 hex digits of the salt's SHA-256 (the whole salt, namespace included)."""
    if not cache_salt:
        return ""
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    name, sep, _ = cache_salt.partition(namespaces.SEPARATOR)
    if sep and namespaces.NAME.fullmatch(name):
        return namespaces.prefix(name) + digest
    return digest


def salt_key_prefix(cache_salt: str | None) -> str:
    """What the daemon keys of a request with ``cache_salt`` begin with (``""``: no salt)."""
    tag = salt_tag(cache_salt)
    return f"{tag}@" if tag else ""


def valid_tag(value: str) -> bool:
    """Whether a ``kvtierd_salt`` tag is one :func:`salt_tag` makes (a client's own is not)."""
    name = namespaces.named_in(value)
    digest = value[len(namespaces.prefix(name)) :] if name else value
    return bool(_DIGEST.fullmatch(digest))


def salt_request(request: Any) -> None:
    """Write the tag of ``request.cache_salt`` into a vLLM request's LMCache settings
    (``sampling_params.extra_args["kv_transfer_params"]``, which LMCache reads for every key
    of the request, on the scheduler and on the workers), replacing any the client sent; a
    request without a salt loses a client's tag."""
    params = request.sampling_params
    if params is None:
        return
    tag = salt_tag(getattr(request, "cache_salt", None))
    extra = params.extra_args
    transfer = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if not isinstance(transfer, dict):
        if not tag:
            return
        transfer = {}
        params.extra_args = {**(extra if isinstance(extra, dict) else {}),
                             "kv_transfer_params": transfer}  # fmt: skip
    if tag:
        transfer[CONFIG_KEY] = tag
    else:
        transfer.pop(CONFIG_KEY, None)
