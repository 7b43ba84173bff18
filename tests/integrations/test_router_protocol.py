"""What the router and its clients agree on (``kvtierd.router_protocol``), without a stack:
context digests with and without a scope, the request's ``"kvtierd"`` field, and manifests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.placeholder import Manifest, kept_key, manifest_key
from kvtierd.router_protocol import ContextRequest, context_digest

TOKENS = list(range(10, 42))


def test_production_digests_are_what_they_were_before_scopes() -> None:
    """Manifests stored before scopes existed keep their names."""
    assert context_digest("/models/llama", TOKENS) == "8dd6c6cff40016407215da22bd1b10ad"
    assert context_digest("m", [0, 2**40, 7]) == "522156ef144649948de28d3363f112e0"


def test_a_scope_is_another_identity() -> None:
    digests = {context_digest("m", TOKENS, s) for s in ("", "a", "b", "ab", "x" * 64)}
    assert len(digests) == 5
    assert context_digest("m", TOKENS, "a") == context_digest("m", TOKENS, "a")


def test_manifest_keys_per_context_or_per_variant() -> None:
    assert manifest_key("d") == "kvtierd-ph@d"
    assert manifest_key("d", "knorm@0.5") == "kvtierd-ph@d/knorm@0.5"
    assert kept_key("d") == "kvtierd-ph@d@kept"
    assert kept_key("d", "knorm@0.5") == "kvtierd-ph@d/knorm@0.5@kept"


@pytest.mark.parametrize(
    ("field", "want"),
    [
        ({"context_tokens": 64, "variant": "knorm@0.5"}, ContextRequest(64, "knorm@0.5")),
        ({"context_tokens": 64, "variant": "knorm@1", "scope": "p-1"},
         ContextRequest(64, "knorm@1", "p-1")),
        ({"scope": "p.1_x", "variant": "knorm@1"}, ContextRequest(0, "knorm@1", "p.1_x")),
        ({"scope": "p"}, ContextRequest(0, "", "p")),
    ],
)  # fmt: skip
def test_the_field_round_trips(field: dict[str, Any], want: ContextRequest) -> None:
    got = ContextRequest.from_json(field)
    assert got == want
    assert got.to_json() == field
    assert got.is_store == ("context_tokens" in field)


@pytest.mark.parametrize(
    ("field", "match"),
    [
        ([64], "must be an object"),
        ({"context_tokens": 64, "variant": "knorm@0.5", "ratio": 1}, r"unknown keys \['ratio'\]"),
        ({"context_tokens": "many", "variant": "knorm@0.5"}, "context_tokens"),
        ({"context_tokens": -1, "variant": "knorm@0.5"}, ">= 0"),
        ({"context_tokens": 64}, "needs kvtierd.variant"),
        ({"variant": "knorm@0.5"}, "needs kvtierd.scope"),
        ({"scope": "a/b", "variant": "knorm@0.5"}, "kvtierd.scope 'a/b'"),
        ({"scope": "x" * 65}, "1-64 characters"),
    ],
)
def test_bad_fields_are_named(field: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ContextRequest.from_json(field)


def test_a_manifest_round_trips_and_an_older_one_has_no_source_context() -> None:
    m = Manifest("d", "knorm@0.5", 64, 32, -32, (7, 8), ("k0", "k1"), source_context="ctx")
    assert Manifest.from_bytes(m.to_bytes()) == m
    older = {k: v for k, v in json.loads(m.to_bytes()).items() if k != "source_context"}
    assert Manifest.from_bytes(json.dumps(older).encode()).source_context == ""
