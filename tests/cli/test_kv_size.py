"""``kv-size``: exact bytes from presets and config.json; held equal to kernels.variants."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtierd.cli.kvsize import PRESETS, geometry, kept_tokens, variant_bytes
from kvtierd.kernels import variants
from kvtierd.policy_config import load_policy
from tests.cli.conftest import Ctl

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policies"


@pytest.mark.parametrize(
    ("preset", "per_token"),
    [
        ("Llama-3.1-8B", 2 * 32 * 8 * 128 * 2),  # 128 KiB
        ("Mistral-7B", 2 * 32 * 8 * 128 * 2),
        ("Qwen2.5-14B", 2 * 48 * 8 * 128 * 2),  # 192 KiB
        ("Qwen3-30B-A3B", 2 * 48 * 4 * 128 * 2),  # 96 KiB
    ],
)
def test_presets(ctl: Callable, preset: str, per_token: int) -> None:
    r = ctl(None)("kv-size", preset, "--tokens", "1000", "--json", "--variant", "none")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["bytes_per_token"] == per_token
    assert doc["variants"] == [
        {"variant": "none", "kept_tokens": 1000, "size_bytes": 1000 * per_token, "ratio": 1.0}
    ]


def test_model_dir_config_json(ctl: Callable, tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 64, "torch_dtype": "float32",
    }))  # fmt: skip
    run: Ctl = ctl(None)
    r = run("kv-size", str(model), "--tokens", "100", "--json", "--variant", "knorm@0.5",
            "--variant", "int8")  # fmt: skip
    assert r.code == 0, r.err
    doc = r.json()
    # 2 (K, V) * 2 layers * 2 kv heads * head_dim 16 * 4 bytes
    assert (doc["model"], doc["head_dim"], doc["bytes_per_token"]) == ("tiny-llama", 16, 512)
    sizes = {v["variant"]: v["size_bytes"] for v in doc["variants"]}
    assert sizes["knorm@0.5"] == 50 * 512
    assert sizes["int8"] == variants.variant_size_bytes(2, 2, 16, 100, 4, "int8")
    human = run("kv-size", str(model), "--tokens", "100")
    assert human.code == 0 and "512 B per token" in human.out
    nested = tmp_path / "vlm"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 3, "num_attention_heads": 8, "head_dim": 32, "dtype": "bfloat16",
    }}))  # fmt: skip
    assert run("kv-size", str(nested), "--tokens", "1", "--json").json()["bytes_per_token"] == (
        2 * 3 * 8 * 32 * 2
    )


def test_bad_inputs_exit_5(ctl: Callable, tmp_path: Path) -> None:
    run: Ctl = ctl(None)
    r = run("kv-size", "GPT-5", "--tokens", "10")
    assert r.code == 5 and "Llama-3.1-8B" in r.err
    assert run("kv-size", "Mistral-7B", "--tokens", "0").code == 5
    assert run("kv-size", "Mistral-7B", "--tokens", "10", "--variant", "knorm").code == 5
    assert run("kv-size", "Mistral-7B", "--tokens", "10", "--dtype", "int3").code == 5
    (tmp_path / "config.json").write_text("{}")
    r = run("kv-size", str(tmp_path), "--tokens", "10")
    assert r.code == 5 and "num_hidden_layers" in r.err


@pytest.mark.parametrize("tokens", [1, 7, 16, 33, 64, 65, 100, 257, 1000, 4097])
def test_sizes_equal_the_kernel_arithmetic(tokens: int) -> None:
    """kvsize repeats kernels.variants' arithmetic (the CLI may not import kernels)."""
    g = PRESETS["qwen3-30b-a3b"]
    names = set(load_policy(POLICIES / "evicpress.yaml").variants)
    names |= {f"{m}@{r}" for m in variants.COUNT_RULES for r in (0.05, 0.3, 0.77)}
    names |= {"streamingllm@0.01+int4", "paged_eviction_block@0.5+int8"}
    names |= {f"{m}@{r}" for r in (0.05, 0.3, 0.77) for m in (
        "paged_eviction_block-page=8", "paged_eviction_block-keep_ends=1",
        "paged_eviction_block-page=32-keep_ends=1", "snapkv-window=8-pool=3",
        "streamingllm-sinks=0")}  # fmt: skip
    for v in sorted(names):
        want = variants.variant_size_bytes(
            g.num_layers, g.num_kv_heads, g.head_dim, tokens, g.dtype_bytes, v
        )
        assert variant_bytes(g, tokens, v) == want, v
        assert kept_tokens(tokens, v) == variants.variant_kept_tokens(tokens, v), v


def test_policy_grid(ctl: Callable) -> None:
    r = ctl(None)("kv-size", "Mistral-7B", "--tokens", "512", "--json",
                  "--policy", str(POLICIES / "fixed-knorm-0.5.yaml"))  # fmt: skip
    assert [v["variant"] for v in r.json()["variants"]] == ["none", "knorm@0.5"]
    assert geometry("mistralai/Mistral-7B").name == "Mistral-7B"
