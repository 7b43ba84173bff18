"""Prompts longer than vLLM's ``max_num_batched_tokens`` through the stack (issue 18.6).

vLLM prefills such a prompt in several steps (chunked prefill) and LMCache puts each step's
chunks separately. ``kvtierd stack`` avoids it (``--max-num-batched-tokens`` = model length),
but a user running vLLM with their own flags meets it: each later put must join the context
of the request's first put, and a token-dropping store request split this way must be stored
without errors. Here vLLM prefills 4 chunks (64 tokens) per step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.servers import post, router_stack
from benchmarks._support.tiny_vllm_model import words
from kvtierd.client import KVClient
from kvtierd.router_protocol import context_digest
from tests.integrations.harness import CHUNK

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

STEP = 4 * CHUNK  # --max-num-batched-tokens
CTX = [70 + (13 * i) % 900 for i in range(10 * CHUNK)]  # 160 tokens: three prefill steps
DOC = [80 + (41 * i) % 900 for i in range(6 * CHUNK)]
SUFFIX = [500, 501, 502]


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    args = ("--max-num-batched-tokens", str(STEP), "--max-num-seqs", "4")
    with router_stack(tmp_path_factory.mktemp("chunked"), tiny_model, args) as stack:
        yield stack


def complete(
    stack: dict[str, Any], prompt: list[int], **extra: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": stack["model"], "prompt": words(prompt), "max_tokens": 4,
            "temperature": 0.0, **extra}  # fmt: skip
    return post(f"{stack['router']}/v1/completions", body)


def plugin_noise(stack: dict[str, Any]) -> list[str]:
    log = Path(stack["vllm_log"]).read_text(errors="replace").splitlines()
    return [line for line in log if "put failed" in line or "Traceback" in line]


def test_a_prompt_prefilled_in_steps_is_one_context(stack: dict[str, Any]) -> None:
    first, _ = complete(stack, CTX + SUFFIX)
    with KVClient(stack["socket"]) as c:
        contexts = [x for x in c.contexts() if x.context_id.startswith(stack["model"])]
    # 10 full chunks (the suffix is shorter than one), in one context, not one per step
    assert [x.objects for x in contexts] == [10], contexts
    again, _ = complete(stack, CTX + SUFFIX)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert plugin_noise(stack) == []


def test_a_store_request_prefilled_in_steps_is_stored_without_errors(
    stack: dict[str, Any],
) -> None:
    """The store request's first put ends inside the context (chunks 0-3 of 6): the variant
    is built at the put that carries the context's last chunk, from the chunks before it read
    back from the daemon. knorm@0.25 of 96 tokens keeps 24 -> 1.5 -> 2 chunks (32 tokens):
    the kept count is rounded to the nearest whole chunk, as documented, and the answer says
    so."""
    store = {"context_tokens": len(DOC), "variant": "knorm@0.25"}
    _, headers = complete(stack, DOC + SUFFIX, kvtierd=store)
    assert headers.get("x-kvtierd-kept-tokens") == str(2 * CHUNK)
    served, headers = complete(stack, DOC + SUFFIX)
    digest = context_digest(stack["model"], DOC)
    assert headers.get("x-kvtierd-context") == f"{digest}/knorm@0.25"
    assert served["usage"]["prompt_tokens"] == 2 * CHUNK + len(SUFFIX)
    assert plugin_noise(stack) == []
