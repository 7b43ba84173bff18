"""cache_salt -> LMCache tag -> daemon key (issue 41.2), without vLLM: the tag the connector
writes, what it overwrites, the namespace a salt names, and tags the plugin refuses. The same
path through real vLLM + LMCache is ``test_vllm_lmcache.py::test_cache_salts_*``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.integrations.placeholder_serve import PlaceholderKeys
from kvtierd.integrations.plugin_settings import key_string
from kvtierd.integrations.salt import CONFIG_KEY, salt_key_prefix, salt_request, salt_tag
from kvtierd.integrations.store_request import StoreRequest
from kvtierd.kernels.placeholder import manifest_key


@dataclass
class Params:
    extra_args: Any = None


@dataclass
class Request:
    cache_salt: str | None
    sampling_params: Params = field(default_factory=Params)


@dataclass
class Key:
    tags: tuple[tuple[str, str], ...] | None = None
    model_name: str = "m"
    world_size: int = 1
    worker_id: int = 0
    chunk_hash_hex: str = "ab"
    _dtype_str: str = "float32"


def test_a_salt_becomes_a_digest_and_names_its_namespace() -> None:
    assert salt_tag(None) == salt_tag("") == ""
    plain, named = salt_tag("user-7"), salt_tag("team-a:user-7")
    assert len(plain) == 32 and "user" not in plain
    assert named.startswith("ns:team-a:") and len(named) == len("ns:team-a:") + 32
    assert named[-32:] != salt_tag("team-b:user-7")[-32:]  # the whole salt is hashed
    # no namespace: a name out of the alphabet or too long, or no separator
    for salt in ("team/a:x", "a" * 65 + ":x", ":x", "x"):
        assert not salt_tag(salt).startswith("ns:"), salt
    assert salt_key_prefix("team-a:u") == f"{salt_tag('team-a:u')}@"


def test_the_connector_overwrites_a_clients_tag() -> None:
    forged = {CONFIG_KEY: salt_tag("team-a:alice"), "lmcache.tag.kvtierd_variant": "int8"}
    bob = Request("team-a:bob", Params({"kv_transfer_params": dict(forged)}))
    salt_request(bob)
    params = bob.sampling_params.extra_args["kv_transfer_params"]
    assert params == {CONFIG_KEY: salt_tag("team-a:bob"), "lmcache.tag.kvtierd_variant": "int8"}
    unsalted = Request(None, Params({"kv_transfer_params": dict(forged)}))
    salt_request(unsalted)
    assert CONFIG_KEY not in unsalted.sampling_params.extra_args["kv_transfer_params"]
    fresh = Request("u", Params({"other": 1}))
    salt_request(fresh)
    expected = {"other": 1, "kv_transfer_params": {CONFIG_KEY: salt_tag("u")}}
    assert fresh.sampling_params.extra_args == expected
    bare = Request(None)
    salt_request(bare)
    assert bare.sampling_params.extra_args is None


def test_the_daemon_key_carries_the_salt_and_refuses_a_forged_tag() -> None:
    base = key_string(Key())
    assert base == "m@1@0@ab@float32"
    tag = salt_tag("team-a:alice")
    assert key_string(Key((("kvtierd_salt", tag),))) == f"{tag}@{base}"
    assert key_string(Key((("kvtierd_variant", "int8"),))) == base  # other tags: same KV
    for forged in ("ns:team-a:", "x" * 32, "ns:team-a:" + "0" * 31, "0" * 32 + "@m"):
        with pytest.raises(InvalidArgumentError, match="not a salt tag"):
            key_string(Key((("kvtierd_salt", forged),)))


def test_a_salted_store_request_keeps_to_its_salt_and_a_rewrite_to_its_own_manifests() -> None:
    """A router store request under a salt names its context within the salt (two salts'
    stores of the same tokens are two daemon contexts). A rewritten request is translated only
    through a manifest of its own salt: through another's (a client's forged tag), its
    placeholder chunk keys would name that salt's chunks; refused without reading it."""
    tag = salt_tag("team-a:alice")
    store = {"kvtierd_context": "d" * 32, "kvtierd_context_tokens": "64",
             "kvtierd_variant": "knorm@0.5"}  # fmt: skip
    request = StoreRequest.of(Key((*store.items(), ("kvtierd_salt", tag))))
    assert request is not None and request.context_id == f"{tag}@{'d' * 32}"
    assert StoreRequest.of(Key(tuple(store.items()))).context_id == "d" * 32  # type: ignore[union-attr]
    keys = PlaceholderKeys(plugin=None)  # a refused manifest reads nothing (no plugin needed)
    names = ["n0", "n1"]
    for mine, named in ((tag, manifest_key("d" * 32)), ("", f"{tag}@{manifest_key('d' * 32)}"),
                        (salt_tag("team-a:bob"), f"{tag}@{manifest_key('d' * 32)}")):  # fmt: skip
        salt = (("kvtierd_salt", mine),) if mine else ()
        key = Key((*salt, ("kvtierd_manifest", named)))
        assert keys.translate([key], names) == names, (mine, named)
