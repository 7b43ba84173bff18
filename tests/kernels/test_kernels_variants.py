"""Variant grammar, kept counts and the exact size formula (torch-free module)."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import make_kv

from kvtierd.kernels.api import compress_dense
from kvtierd.kernels.registry import default_registry, get_method
from kvtierd.sizes import kept_token_count, variant_kept_tokens, variant_size_bytes
from kvtierd.variants import COUNT_RULES, METHOD_OPTIONS, CountRule, Variant, parse_variant


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("none", Variant()),
        ("int8", Variant(quant="int8")),
        ("none+int4", Variant(quant="int4")),
        ("knorm@0.5", Variant("knorm", 0.5)),
        ("snapkv@0.25+int8", Variant("snapkv", 0.25, "int8")),
        ("paged_eviction_block@1", Variant("paged_eviction_block", 1.0)),
        ("snapkv-window=8@0.5", Variant("snapkv", 0.5, options=(("window", 8),))),
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
    # snapkv and streamingllm keep exactly the count asked for (no window / sink minimum)
    assert variant_kept_tokens(100, "snapkv@0.01") == 1
    assert variant_kept_tokens(100, "streamingllm@0.02") == 2
    # pages of 16, N=100 = 6 full pages + 4: the 4 stay; target 50 -> 46 more -> 3 pages
    page = CountRule(page_tokens=16)
    assert kept_token_count(100, 0.5, rule=page) == 52
    assert kept_token_count(100, 0.01, rule=page) == 4
    assert kept_token_count(96, 0.01, rule=page) == 16  # no partial page: at least one page
    assert kept_token_count(96, 0.6, rule=page) == 64  # 57.6 -> 58 -> 3.6 pages -> 4
    assert kept_token_count(100, 1.0, rule=page) == 100
    assert kept_token_count(10, 0.1, rule=page) == 10
    # keep_ends: 7 pages, first 16 + last 4 forced; target 50 -> 30 more -> 2 pages
    ends = CountRule(page_tokens=16, keep_ends=True)
    assert kept_token_count(100, 0.5, rule=ends) == 52
    assert kept_token_count(100, 0.01, rule=ends) == 20
    assert kept_token_count(100, 1.0, rule=ends) == 100
    assert kept_token_count(30, 0.1, rule=ends) == 30
    assert variant_kept_tokens(100, "paged_eviction_block-keep_ends=1@0.01") == 20
    assert variant_kept_tokens(100, "paged_eviction_block-page=8@0.3") == 28
    with pytest.raises(ValueError, match="chunk_tokens"):
        kept_token_count(100, 0.5, chunk_tokens=16, rule=page)


def test_count_rules_match_registry_defaults() -> None:
    reg = default_registry()
    assert set(reg.names()) == set(COUNT_RULES) == set(METHOD_OPTIONS)
    for name in reg.names():
        assert reg.create(name).count_rule() == COUNT_RULES[name], name
        assert reg.create(name).options == ()


@pytest.mark.parametrize("name", sorted(METHOD_OPTIONS))
def test_every_option_reaches_the_constructor(name: str) -> None:
    """Each option of METHOD_OPTIONS is a keyword of the method's constructor, read back by
    option_values, and a variant name with it builds a method that names itself the same."""
    for opt in METHOD_OPTIONS[name]:
        value = opt.default + opt.step
        m = get_method(name, ((opt.name, value),))
        assert m.option_values()[opt.name] == value
        v = parse_variant(f"{name}-{opt.name}={value}@0.5")
        assert v.options == m.options == ((opt.name, value),)
        assert m.count_rule() == v.count_rule
        assert get_method(name).option_values()[opt.name] == opt.default


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("snapkv-window=64@0.5", "window at the default: leave it out"),
        ("snapkv-pool=7-window=32@0.5", "in the order window, pool"),
        ("snapkv-pool=4@0.5", "pool=4 is not allowed; pool must be an integer >= 1, odd"),
        ("snapkv-window=0@0.5", "window=0 is not allowed"),
        ("snapkv-window=032@0.5", "is not '<name>=<integer>'"),
        ("snapkv-window=-3@0.5", "is not '<name>=<integer>'"),
        ("snapkv-window=8-window=9@0.5", "given twice"),
        ("knorm-window=8@0.5", "knorm has no option 'window'; its options: none"),
        ("paged_eviction_block-keep_ends=2@0.5", "keep_ends=2 is not allowed"),
        ("streamingllm-sinks=2", "needs a ratio ('streamingllm-sinks=2@0.5')"),
    ],
)
def test_bad_method_options(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_variant(text)
    assert fragment in str(e.value)


def test_method_options_round_trip() -> None:
    for text in ("snapkv-window=32-pool=7@0.25+int8", "streamingllm-sinks=0@0.5",
                 "paged_eviction_block-page=32-keep_ends=1@0.1", "snapkv-pool=3@1"):  # fmt: skip
        assert str(parse_variant(text)) == text
    assert parse_variant("snapkv-window=32@0.5") != parse_variant("snapkv@0.5")
    with pytest.raises(ValueError, match="window=0 is not allowed"):
        get_method("snapkv", (("window", 0),))


def test_size_formula_by_hand() -> None:
    # Llama-3.1-8B geometry, 1000 tokens, bf16
    assert variant_size_bytes(32, 8, 128, 1000, 2, "none") == 2 * 32 * 8 * 1000 * 128 * 2
    assert variant_size_bytes(32, 8, 128, 1000, 2, "knorm@0.5") == 2 * 32 * 8 * 500 * 128 * 2
    codes = 2 * 32 * 8 * 1000 * 64
    params = 32 * 8 * (32 * 128 + 1000 * 4) * 4  # ceil(1000/32)=32 key groups, 4 value groups
    assert variant_size_bytes(32, 8, 128, 1000, 2, "int4") == codes + params
    with pytest.raises(ValueError, match="head_dim"):
        variant_size_bytes(32, 8, 0, 1000, 2, "none")


WITH_OPTIONS = (
    "snapkv-window=16-pool=3",
    "streamingllm-sinks=0",
    "paged_eviction-sinks=1",
    "paged_eviction_block-page=8-keep_ends=1",
    "paged_eviction_block-page=32",
)


@pytest.mark.parametrize("quant", ["", "+int8", "+int4"])
@pytest.mark.parametrize("method", [*sorted(COUNT_RULES), *WITH_OPTIONS])
def test_size_formula_matches_compressed_bytes(method: str, quant: str) -> None:
    lyr, h, n, d = 2, 2, 150, 16
    k, v = make_kv(lyr, h, n, d, torch.float16)
    queries = torch.randn(lyr, 4, 64, d, dtype=torch.float16)
    for ratio in (0.3, 0.05, 1.0):
        variant = f"{method}@{ratio}{quant}"
        out = compress_dense(k, v, variant, queries=queries, group_size=16, backend="torch")
        assert out.num_kept == variant_kept_tokens(n, variant)
        assert out.variant == str(parse_variant(variant))
        want = variant_size_bytes(lyr, h, d, n, 2, variant, group_size=16)
        assert out.payload_bytes == want, variant
