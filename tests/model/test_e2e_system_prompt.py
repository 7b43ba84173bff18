"""bench_e2e's ``--system-prompt-tokens N`` (issue 29 item 5) on the real tokenizer: every prompt
starts with the same N tokens and the document follows unchanged; 0 leaves every prompt as it
was; counts the template cannot make or the model cannot fit are refused, naming the limit."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.e2e.bench_e2e import MAX_MODEL_LEN, _same_system_prompt
from benchmarks.e2e.e2e_workload import (
    Outcome,
    Prompt,
    check_fits,
    distinct_context_tokens,
    make_contexts,
    prompts,
)
from benchmarks.e2e.system_prompt import head_ids, system_prompt

REPO = Path(__file__).resolve().parents[2]

DEFAULT_DIGEST = "135b4a62b08f568a420730fc5fd9c348906e71a36044a6e9880a125f57a249a8"
"""sha256 of ``[[ids, context_tokens], ...]`` for 5 contexts of 1,024 tokens, chunk 256, as
commit 83c2355 (before the option) built them."""


@pytest.fixture(scope="module")
def tokenizer(real_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


@pytest.fixture(scope="module")
def contexts(tokenizer: Any) -> Any:
    return make_contexts(tokenizer, 5, [1024], 0)


def digest(table: list[list[Prompt]]) -> str:
    rows = [[list(p.ids), p.context_tokens] for row in table for p in row]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


@pytest.mark.model
def test_no_system_prompt_leaves_every_prompt_as_it_was(tokenizer: Any, contexts: Any) -> None:
    assert digest(prompts(tokenizer, contexts, 256)) == DEFAULT_DIGEST
    assert digest(prompts(tokenizer, contexts, 256, 0)) == DEFAULT_DIGEST
    assert system_prompt(tokenizer, 0) is None


@pytest.mark.model
@pytest.mark.parametrize("n", [9, 300, 1024])
def test_every_prompt_starts_with_the_same_n_tokens_then_its_document(
    tokenizer: Any, contexts: Any, n: int
) -> None:
    plain = prompts(tokenizer, contexts, 256)
    shared = prompts(tokenizer, contexts, 256, n)
    system = system_prompt(tokenizer, n)
    assert system is not None and len(system.ids) == n
    assert system == system_prompt(tokenizer, n)  # deterministic
    default_head = len(head_ids(tokenizer, ""))  # the template's default system line + user
    assert default_head == 24
    for row_plain, row_shared in zip(plain, shared, strict=True):
        for a, b in zip(row_plain, row_shared, strict=True):
            assert b.ids[:n] == system.ids  # the same n tokens before every document
            assert b.ids[n:] == a.ids[default_head:]  # document, question, template unchanged
            assert b.answers == a.answers
            # the context still runs through the document, whole chunks, prefix counted
            assert b.context_tokens % 256 == 0
            assert b.context_tokens - n <= a.context_tokens - default_head + 256
            assert b.context_tokens >= n // 256 * 256
    firsts = {p.ids[: n // 256 * 256] for row in shared for p in row}
    assert len(firsts) == 1  # the whole chunks of the prefix are the same everywhere
    if n >= 256:  # without the option the first chunks differ: every context its own
        assert len({p.ids[:256] for row in plain for p in row}) == len(plain)
    text = tokenizer.decode(system.ids)
    assert text.startswith("<|im_start|>system\nYou")  # "You are a careful assistant ..."
    assert text.endswith("<|im_end|>\n<|im_start|>user\n")


@pytest.mark.model
@pytest.mark.parametrize("bad", [-5, 1, 8])
def test_a_count_the_template_cannot_make_is_refused(tokenizer: Any, bad: int) -> None:
    with pytest.raises(ValueError, match=f"0 \\(no system prompt\\) or more than 8 .* got {bad}"):
        system_prompt(tokenizer, bad)


@pytest.mark.model
def test_prompts_that_do_not_fit_the_model_are_refused(tokenizer: Any) -> None:
    long = make_contexts(tokenizer, 1, [4096], 0)
    fits = prompts(tokenizer, long, 256, 1024)
    check_fits(fits, max_model_len=MAX_MODEL_LEN, max_tokens=24, system_tokens=1024)
    table = prompts(tokenizer, long, 256, 4500)
    longest = max(len(p.ids) for p in table[0])
    room = MAX_MODEL_LEN - 24 - (longest - 4500)
    with pytest.raises(ValueError, match=f"more than the 8192 tokens of max_model_len .* at most "
                       f"{room} tokens"):  # fmt: skip
        check_fits(table, max_model_len=MAX_MODEL_LEN, max_tokens=24, system_tokens=4500)
    # a prompt and its answer that fill max_model_len exactly fit; one token more does not
    check_fits(table, max_model_len=longest + 24, max_tokens=24, system_tokens=4500)
    with pytest.raises(ValueError, match="more than the 8000 tokens"):
        check_fits(table, max_model_len=8000, max_tokens=longest - 8000 + 1, system_tokens=4500)


@pytest.mark.model
def test_bench_e2e_refuses_before_starting_anything(tmp_path: Path) -> None:
    argv = ["--contexts", "1", "--lengths", "1024", "--system-prompt-tokens", "8000",
            "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e.bench_e2e", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "more than the 8192 tokens of max_model_len" in done.stderr
    assert not list(tmp_path.iterdir())  # no system was started, nothing written


def test_a_run_of_another_system_prompt_is_not_resumed(tmp_path: Path) -> None:
    old = tmp_path / "lru.json"
    old.write_text(json.dumps({"outcomes": []}))  # before the option: no system prompt
    _same_system_prompt(old, 0)
    _same_system_prompt(tmp_path / "absent.json", 1024)
    with pytest.raises(SystemExit, match="measured with --system-prompt-tokens 0, not 1024"):
        _same_system_prompt(old, 1024)
    old.write_text(json.dumps({"system_prompt_tokens": 1024, "outcomes": []}))
    _same_system_prompt(old, 1024)


def test_the_shared_prefix_is_counted_once() -> None:
    table = [[Prompt((1,), 1280, ())], [Prompt((2,), 2304, ())]]
    assert distinct_context_tokens(table, 0) == 1280 + 2304
    assert distinct_context_tokens(table, 1024) == 1024 + 256 + 1280


def test_a_request_that_loaded_only_the_system_prompt_is_told_apart() -> None:
    def out(cached: int, prompt: int = 2000, served: str = "") -> Outcome:
        return Outcome(0, 0, 0, 0.0, 1.0, 1.0, "", served, "", prompt, cached)

    assert out(1024).kind == "hit"  # 1,024 of 2,000 cached: without the prefix, a hit
    assert out(1024).kind_behind(1024) == "prefix"  # only the system prompt came from cache
    assert out(1024 + 900).kind_behind(1024) == "hit"
    assert out(512).kind_behind(1024) == "miss"  # not even the whole prefix
    assert out(0).kind_behind(1024) == out(0).kind == "miss"
    assert out(1900, served="ctx").kind_behind(1024) == "variant"
    assert out(-1).kind_behind(1024) == "unknown"
    assert [out(c).kind_behind(0) for c in (0, 600, 1900)] == ["miss", "hit", "hit"]


def test_tiers_are_sized_in_the_dtype_vllm_keeps_kv_in(tmp_path: Path) -> None:
    """float32 KV (what the stack serves on an AMX CPU) takes twice bf16's bytes: sizing the
    tiers for bf16 gave them half the share asked for."""
    import json

    from benchmarks.e2e.bench_e2e import kv_bytes_per_token

    cfg = {"hidden_size": 576, "num_attention_heads": 9, "num_hidden_layers": 30,
           "num_key_value_heads": 3}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(tmp_path, "float32") == 2 * kv_bytes_per_token(tmp_path, "bfloat16")
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        kv_bytes_per_token(tmp_path, "int3")
