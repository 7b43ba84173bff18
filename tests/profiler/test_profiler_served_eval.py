"""The ``served`` evaluator without a serving stack: options, what it refuses before any request,
a missing router, the policy keys that configure it, and the daemon refusing it per context.
The real stack (vLLM + router + daemon) is in tests/integrations/test_served_evaluator.py."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.errors import ConfigError, InvalidArgumentError, UnavailableError
from kvtierd.integrations.served_eval import ServedEvaluator, scorable_variant
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import ContextKV, ProfilingQuery, evaluator_class, make_evaluator

ROOT = Path(__file__).resolve().parents[2]
TOKENS = tuple(range(10, 42))
QUERY = ProfilingQuery(token_ids=(5, 6, 7))


def _kv(n: int = len(TOKENS), token_ids: tuple[int, ...] = TOKENS) -> ContextKV:
    k = torch.zeros(2, 2, n, 8)
    return ContextKV(keys=k, values=k.clone(), token_ids=token_ids)


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A router URL whose port stays bound but never listens for the test's length: a connect
    is refused at once, and no other process can take the port meanwhile (a port closed
    after picking it could be anyone's by the time the test connects)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def evaluator(dead_url: str) -> ServedEvaluator:
    ev = make_evaluator("served", {"router_url": dead_url, "timeout_s": 5})
    assert isinstance(ev, ServedEvaluator)
    return ev


def test_registered_and_needs_token_ids() -> None:
    assert evaluator_class("served") is ServedEvaluator
    assert ServedEvaluator.needs_token_ids
    assert not evaluator_class("attention").needs_token_ids


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "bad options for quality evaluator 'served'.*router_url"),
        ({"router_url": ""}, "needs router_url"),
        ({"router_url": "127.0.0.1:8100"}, "router_url must be an http"),
        ({"router_url": "http://r", "vllm_url": "ftp://v"}, "vllm_url must be an http"),
        ({"router_url": "http://r", "max_new_tokens": 0}, "max_new_tokens"),
        ({"router_url": "http://r", "max_concurrency": 0}, "max_concurrency"),
        ({"router_url": "http://r", "timeout_s": 0}, "timeout_s"),
        ({"router_url": "http://r", "model_path": "/m"}, "bad options.*model_path"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        make_evaluator("served", options)


def test_urls_lose_their_trailing_slash() -> None:
    ev = ServedEvaluator("http://127.0.0.1:8100/", vllm_url="https://v:8000/")
    assert (ev.router_url, ev.vllm_url) == ("http://127.0.0.1:8100", "https://v:8000")


def test_which_variants_it_can_score() -> None:
    assert scorable_variant("knorm@1.0") == "knorm@1"
    assert scorable_variant("streamingllm@0.10") == "streamingllm@0.1"
    assert scorable_variant("knorm@0.5+int8") == "knorm@0.5+int8"
    assert scorable_variant("none") == "none"
    for quant in ("int8", "int4"):
        with pytest.raises(InvalidArgumentError, match=rf"cannot score '{quant}'.*chunk keys"):
            scorable_variant(quant)
    # the plugin recomputes snapkv's window queries from the model (test_snapkv_served.py)
    assert scorable_variant("snapkv-window=32@0.50") == "snapkv-window=32@0.5"
    with pytest.raises(InvalidArgumentError, match="unknown method 'zip'"):
        scorable_variant("zip@0.5")


def test_refusals_come_before_any_request(evaluator: ServedEvaluator) -> None:
    """Each of these names what is missing, and none reaches for the (dead) router."""
    with pytest.raises(InvalidArgumentError, match=r"token ids \(ContextKV.token_ids\)"):
        evaluator.evaluate(_kv(token_ids=()), ["knorm@0.5"], [QUERY])
    with pytest.raises(InvalidArgumentError, match="32 token ids for 40 KV entries"):
        evaluator.evaluate(_kv(n=40), ["knorm@0.5"], [QUERY])
    with pytest.raises(InvalidArgumentError, match="at least one profiling query"):
        evaluator.evaluate(_kv(), ["knorm@0.5"], [])
    with pytest.raises(InvalidArgumentError, match="cannot score 'int8'"):
        evaluator.evaluate(_kv(), ["knorm@0.5", "int8"], [QUERY])
    text = ProfilingQuery(text="what is it?")
    with pytest.raises(InvalidArgumentError, match=r"\['what is it\?'\] have no token_ids.*vllm"):
        evaluator.evaluate(_kv(), ["knorm@0.5"], [QUERY, text])


def test_a_missing_router_is_a_clear_error(evaluator: ServedEvaluator) -> None:
    with pytest.raises(UnavailableError, match=rf"cannot reach {evaluator.router_url}/v1/models"):
        evaluator.evaluate(_kv(), ["knorm@0.5"], [QUERY])


# -- the policy keys --------------------------------------------------------------------------


def test_policy_served_keys() -> None:
    p = parse_policy(
        "placer: evicpress\nvariants: {methods: [knorm]}\nprofiling:\n  evaluator: served\n"
        "  router_url: http://127.0.0.1:8100/\n  vllm_url: http://127.0.0.1:8000\n",
        "p.yaml",
    )
    assert (p.evaluator, p.evaluator_router_url, p.evaluator_vllm_url) == (
        "served", "http://127.0.0.1:8100", "http://127.0.0.1:8000",
    )  # fmt: skip
    plain = parse_policy("placer: evicpress\n", "p.yaml")
    assert (plain.evaluator, plain.evaluator_router_url, plain.evaluator_vllm_url) == (
        "query_attention", "", "",  # the default estimator (issue 26)
    )  # fmt: skip


@pytest.mark.parametrize(
    ("profiling", "match"),
    [
        ("  evaluator: served\n", r"p.yaml:3: profiling.evaluator: .*requires .*router_url"),
        ("  evaluator: served\n  router_url: localhost:8100\n", r"p.yaml:4: profiling.router_url"),
        ("  evaluator: served\n  router_url: 8100\n", r"p.yaml:4: profiling.router_url: expected"),
        ("  evaluator: attention\n  vllm_url: ftp://x\n", r"p.yaml:4: profiling.vllm_url: .*http"),
        ("  evaluator: vllm\n", r"p.yaml:3: profiling.evaluator: .*attention, answer, served"),
        # the old name is no alias: refused with the new one (issue 17)
        (
            "  evaluator: engine\n  router_url: http://r:1\n",
            r"^p.yaml:3: profiling.evaluator: 'engine' was renamed to 'served'; allowed values: "
            r"attention, answer, served, query_attention$",
        ),
    ],
)
def test_policy_served_errors_name_line_and_key(profiling: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_policy(f"placer: evicpress\nprofiling:\n{profiling}", "p.yaml")


def test_policy_served_keys_are_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for key in ("profiling.evaluator", "profiling.router_url", "profiling.vllm_url"):
        assert f"`{key}`" in doc, key
    assert "`served`" in doc


# -- the daemon refuses it per context --------------------------------------------------------


async def test_daemon_refuses_served_per_context_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvtierd.engine import Engine
    from kvtierd.kernels.chunk_codec import ChunkFormat
    from kvtierd.types import ObjectMeta

    tiers = (TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "8MiB"}),)
    engine = Engine(DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "d"),
                                 tiers=tiers))  # fmt: skip
    await engine.start()
    try:
        policy = parse_policy(
            "placer: evicpress\nvariants: {methods: [knorm]}\nprofiling:\n  evaluator: served\n"
            "  router_url: http://r:1\n",
            "p.yaml",
        )
        with caplog.at_level(logging.WARNING, logger="kvtierd.engine.profiling"):
            await engine.apply_policy(policy)
        assert "needs the context's token ids" in caplog.text
        x = torch.zeros(2, 2, 16, 2 * 32, dtype=torch.bfloat16)
        layout = ChunkFormat(tuple(x.shape), "bfloat16", 2).layout()
        data = memoryview(x.view(torch.uint8).numpy().tobytes())
        meta = ObjectMeta(key="doc/0", size_bytes=len(data), context_id="doc", dtype="bfloat16",
                          shape=tuple(x.shape), layout=layout, token_count=16)  # fmt: skip
        await engine.put_bytes(meta, data)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvtierd.engine.profiling"):
            ok = await engine.profiling.profile_context(engine.contexts["doc"])
        assert not ok
        assert engine.profiling.runs["failed"] >= 1
        assert "evaluator 'served' needs the context's token ids" in engine.profiling.last_error
        assert "chunk hashes, never tokens" in caplog.text
    finally:
        await engine.close()


@pytest.mark.parametrize(
    "methods",
    [["knorm"], ["int8"], ["int4"], ["knorm+int8"], ["keydiff+int4"], ["snapkv", "knorm"],
     ["streamingllm", "paged_eviction_block"]],
)  # fmt: skip
@pytest.mark.parametrize("ratios", [[1.0, 0.5], [0.5, 0.25]])
def test_policy_validation_refuses_exactly_what_the_served_evaluator_cannot_score(
    methods: list[str], ratios: list[float]
) -> None:
    """``policy_config`` (bottom layer: it cannot import this module) refuses a ``served``
    policy whose grid holds a variant :func:`scorable_variant` refuses, and only such a one
    (snapkv needs ``model_dir``, which the daemon builds it with)."""

    text = (f"placer: evicpress\nvariants: {{methods: {methods}, ratios: {ratios}}}\n"
            "profiling: {evaluator: served, router_url: 'http://127.0.0.1:1',\n"
            "            model_dir: /m}\n")  # fmt: skip
    grid = parse_policy(text.replace("served", "attention"), "p.yaml").variants
    refused = []
    for v in grid:
        try:
            scorable_variant(v)
        except InvalidArgumentError:
            refused.append(v)
    if refused:
        with pytest.raises(ConfigError, match=f"cannot score {', '.join(refused)} "):
            parse_policy(text, "p.yaml")
    else:
        assert parse_policy(text, "p.yaml").evaluator == "served"


def test_exact_match_scoring_counts_unchanged_answers(
    monkeypatch: pytest.MonkeyPatch, dead_url: str
) -> None:
    """``scoring="exact_match"`` (issue 26): a variant scores the share of queries whose served
    answer text equals the full KV's; the stack's answers are stood in for here."""
    from kvtierd.integrations import served_eval

    ev = make_evaluator("served", {"router_url": dead_url, "scoring": "exact_match"})
    assert isinstance(ev, ServedEvaluator)
    monkeypatch.setattr(ev, "_stack", lambda: served_eval._Stack("m", "/m"))
    monkeypatch.setattr(ev, "_reference", lambda run: ["Paris", "1867"])
    answers = {"knorm@0.5": ["Paris", "1868"], "streamingllm@0.1": ["Lyon", "no"]}
    monkeypatch.setattr(ev, "_variant_answers", lambda run, names: answers)
    queries = [ProfilingQuery(token_ids=(1, 2)), ProfilingQuery(token_ids=(3,))]
    res = ev.evaluate(_kv(), ["knorm@0.5", "streamingllm@0.1"], queries)
    assert (res["knorm@0.5"], res["streamingllm@0.1"]) == (0.5, 0.0)
    with pytest.raises(InvalidArgumentError, match="scoring must be one of"):
        make_evaluator("served", {"router_url": dead_url, "scoring": "bleu"})
