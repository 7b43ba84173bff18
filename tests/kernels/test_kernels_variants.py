"""Variant grammar, kept counts and the exact size formula (torch-free module)."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import make_kv

from kvtierd.kernels import COUNT_RULES, Variant, kept_token_count, parse_variant
from kvtierd.kernels.api import compress_dense
from kvtierd.kernels.registry import default_registry
from kvtierd.kernels.variants import CountRule, variant_kept_tokens, variant_size_bytes


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("none", Variant()),
        ("int8", Variant(quant="int8")),
        ("none+int4", Variant(quant="int4")),
        ("knorm@0.5", Variant("knorm", 0.5)),
        ("snapkv@0.25+int8", Variant("snapkv", 0.25, "int8")),
        ("paged_eviction_block@1", Variant("paged_eviction_block", 1.0)),
    ],
)
def test_parse_variant(text: str, want: Variant) -> None:
    assert parse_variant(text) == want
    assert parse_variant(str(want)) == want


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("knorm", "needs a ratio"),
        ("knorm@0", "outside (0, 1]"),
        ("knorm@1.5", "outside (0, 1]"),
        ("knorm@abc", "not a number"),
        ("knorm@nan", "outside"),
        ("bogus@0.5", "unknown method 'bogus'"),
        ("knorm@0.5+int3", "unknown quantization 'int3'"),
        ("int3", "unknown method"),
    ],
)
def test_parse_variant_errors(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="knorm") as e:
        parse_variant(text)
    assert fragment in str(e.value)


def test_kept_counts() -> None:
    assert kept_token_count(100, 0.5) == 50
    assert kept_token_count(5, 0.5) == 3  # round half up, not banker's (2)
    assert kept_token_count(100, 0.001) == 1
    assert kept_token_count(100, 0.3, chunk_tokens=16) == 32
    assert kept_token_count(100, 0.05, chunk_tokens=16) == 16
    assert kept_token_count(100, 1.0, chunk_tokens=16) == 100
    assert kept_token_count(100, 0.01, rule=CountRule(min_kept=64)) == 64
    assert kept_token_count(10, 0.01, rule=CountRule(min_kept=64)) == 10
    # pages of 16, N=100: 7 pages, first 16 + last 4 forced; target 50 -> 30 more -> 2 pages
    assert kept_token_count(100, 0.5, rule=CountRule(page_tokens=16)) == 52
    assert kept_token_count(100, 0.01, rule=CountRule(page_tokens=16)) == 20
    assert kept_token_count(100, 1.0, rule=CountRule(page_tokens=16)) == 100
    assert kept_token_count(30, 0.1, rule=CountRule(page_tokens=16)) == 30
    with pytest.raises(ValueError, match="chunk_tokens"):
        kept_token_count(100, 0.5, chunk_tokens=16, rule=CountRule(page_tokens=16))


def test_count_rules_match_registry_defaults() -> None:
    reg = default_registry()
    assert set(reg.names()) == set(COUNT_RULES)
    for name in reg.names():
        assert reg.create(name).count_rule() == COUNT_RULES[name], name


def test_size_formula_by_hand() -> None:
    # Llama-3.1-8B geometry, 1000 tokens, bf16
    assert variant_size_bytes(32, 8, 128, 1000, 2, "none") == 2 * 32 * 8 * 1000 * 128 * 2
    assert variant_size_bytes(32, 8, 128, 1000, 2, "knorm@0.5") == 2 * 32 * 8 * 500 * 128 * 2
    codes = 2 * 32 * 8 * 1000 * 64
    params = 32 * 8 * (32 * 128 + 1000 * 4) * 4  # ceil(1000/32)=32 key groups, 4 value groups
    assert variant_size_bytes(32, 8, 128, 1000, 2, "int4") == codes + params
    with pytest.raises(ValueError, match="head_dim"):
        variant_size_bytes(32, 8, 0, 1000, 2, "none")


@pytest.mark.parametrize("quant", ["", "+int8", "+int4"])
@pytest.mark.parametrize("method", sorted(COUNT_RULES))
def test_size_formula_matches_compressed_bytes(method: str, quant: str) -> None:
    lyr, h, n, d = 2, 2, 150, 16
    k, v = make_kv(lyr, h, n, d, torch.float16)
    queries = torch.randn(lyr, 4, 64, d, dtype=torch.float16)
    for ratio in (0.3, 1.0):
        variant = f"{method}@{ratio}{quant}"
        out = compress_dense(k, v, variant, queries=queries, group_size=16, backend="torch")
        assert out.num_kept == variant_kept_tokens(n, variant)
        want = variant_size_bytes(lyr, h, d, n, 2, variant, group_size=16)
        assert out.payload_bytes == want, variant
