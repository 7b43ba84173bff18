"""``kv-size``: exact bytes from presets and config.json, the daemon's own size formulas."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtierd import sizes
from kvtierd.cli.kvsize import PRESETS, geometry
from kvtierd.variants import COUNT_RULES
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
    got = {v["variant"]: v["size_bytes"] for v in doc["variants"]}
    assert got["knorm@0.5"] == 50 * 512
    assert got["int8"] == sizes.variant_size_bytes(2, 2, 16, 100, 4, "int8")
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


@pytest.mark.parametrize("tokens", [1, 7, 65, 1000, 4097])
def test_every_row_is_the_daemons_size(ctl: Callable, tokens: int) -> None:
    """The table shows what the daemon stores: :mod:`kvtierd.sizes` for every variant asked,
    method options and page methods included (kvsize once kept a copy of this arithmetic)."""
    g = PRESETS["qwen3-30b-a3b"]
    names = {f"{m}@{r}" for m in COUNT_RULES for r in (0.05, 0.77)}
    names |= {"streamingllm@0.01+int4", "paged_eviction_block@0.5+int8", "int8", "none"}
    names |= {"paged_eviction_block-page=8@0.3", "paged_eviction_block-page=32-keep_ends=1@0.3",
              "snapkv-window=8-pool=3@0.3", "streamingllm-sinks=0@0.3"}  # fmt: skip
    args = [a for v in sorted(names) for a in ("--variant", v)]
    r = ctl(None)("kv-size", g.name, "--tokens", str(tokens), "--json", *args)
    assert r.code == 0, r.err
    for row in r.json()["variants"]:
        v = row["variant"]
        want = sizes.variant_size_bytes(
            g.num_layers, g.num_kv_heads, g.head_dim, tokens, g.dtype_bytes, v
        )
        assert (row["size_bytes"], row["kept_tokens"]) == (
            want,
            sizes.variant_kept_tokens(tokens, v),
        ), v
    assert len(r.json()["variants"]) == len(names)


def test_dtype_aliases(ctl: Callable) -> None:
    r = ctl(None)("kv-size", "Mistral-7B", "--tokens", "1", "--json", "--dtype", "fp8")
    assert r.code == 0, r.err
    assert r.json()["dtype_bytes"] == 1


def test_policy_grid(ctl: Callable) -> None:
    r = ctl(None)("kv-size", "Mistral-7B", "--tokens", "512", "--json",
                  "--policy", str(POLICIES / "fixed-knorm-0.5.yaml"))  # fmt: skip
    assert [v["variant"] for v in r.json()["variants"]] == ["none", "knorm@0.5"]
    assert geometry("mistralai/Mistral-7B").name == "Mistral-7B"
