"""A child context is profiled as it is served (issue 29): after its ancestors' stored KV, and on
the part of a routed prompt that is its own (in-process engine, real tiers, real profiler)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

import pytest
import torch

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import ContextKV, ProfilingQuery, QualityEvaluator, QualityResult, StoredForm
from kvtierd.profiler.quality import DEFAULT_FORM, EVALUATORS
from kvtierd.types import ObjectMeta

L, H, D, T = 2, 2, 32, 16
MODEL = "/models/test"


class PrefixSeenEvaluator(QualityEvaluator):
    """Scores nothing; keeps the KV it was given, to check what a profile reads."""

    name = "engine-test-prefix"
    seen: ClassVar[list[ContextKV]] = []

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        self.seen.append(kv)
        return QualityResult(self.name, MappingProxyType(dict.fromkeys(variants, 0.9)), 1)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    PrefixSeenEvaluator.seen.clear()
    with EVALUATORS.registered(PrefixSeenEvaluator):
        yield


@pytest.fixture
async def engine(tmp_path: Path):
    tiers = (
        TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 0, str(tmp_path / "ssd")),
    )
    e = Engine(DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "d"),
                            tiers=tiers))  # fmt: skip
    await e.start()
    yield e
    await e.close()


async def put_chunks(
    engine: Engine, cid: str, count: int, *, parent: str = "", seed: int = 0, first: int = 0
) -> None:
    """``count`` LMCache chunks of context ``cid`` (below ``parent``), from chunk ``first``."""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    g = torch.Generator().manual_seed(seed)
    for i in range(first, first + count):
        x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        data = memoryview(x.view(torch.uint8).numpy().tobytes())
        meta = ObjectMeta(
            key=f"{MODEL}@1@0@{cid}-{i}@bfloat16", size_bytes=len(data), context_id=cid,
            dtype="bfloat16", shape=tuple(x.shape), layout=layout, token_count=T,
            parent_context_id=parent,
        )  # fmt: skip
        await engine.put_bytes(meta, data)


async def until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def use_estimator(engine: Engine) -> None:
    policy = parse_policy(
        "placer: evicpress\nalpha: 1000\nvariants:\n  methods: [int8]\n  ratios: [1.0]\n"
        "profiling:\n  interval_s: 0.2\n  min_queries: 1\n",
        "test.yaml",
    )
    name = PrefixSeenEvaluator.name
    await engine.apply_policy(replace(policy, estimator=name, evaluator=name))


async def test_a_child_is_profiled_after_its_ancestors_kv(engine: Engine) -> None:
    await use_estimator(engine)
    await put_chunks(engine, "sys", 3)
    await put_chunks(engine, "doc", 2, parent="sys", seed=1)
    await put_chunks(engine, "leaf", 1, parent="doc", seed=2)
    await until(lambda: len(PrefixSeenEvaluator.seen) >= 3)
    by_tokens = {kv.num_tokens: kv for kv in PrefixSeenEvaluator.seen}
    system_kv = await engine.mover.context_tensors(engine.contexts["sys"])
    doc_kv = await engine.mover.context_tensors(engine.contexts["doc"])
    assert by_tokens[3 * T].prefix_keys is None  # the root: alone
    doc = by_tokens[2 * T]  # after the system prompt
    assert doc.prefix_tokens == 3 * T
    assert doc.prefix_keys is not None and doc.prefix_values is not None
    assert torch.equal(doc.prefix_keys, system_kv[0])
    assert torch.equal(doc.prefix_values, system_kv[1])
    leaf = by_tokens[T]  # after both, root first
    assert leaf.prefix_tokens == 5 * T and leaf.prefix_keys is not None
    assert torch.equal(leaf.prefix_keys, torch.cat([system_kv[0], doc_kv[0]], dim=2))


async def test_siblings_reuse_the_prefix_read_once(engine: Engine) -> None:
    """The prefix is read from storage once for the siblings profiled after each other, and
    again once an ancestor changed."""
    await put_chunks(engine, "sys", 2)
    await put_chunks(engine, "a", 1, parent="sys", seed=1)
    await put_chunks(engine, "b", 1, parent="sys", seed=2)
    prefixes = engine.profiling.ancestors
    first = await prefixes.prefix_of(engine.contexts["a"])
    second = await prefixes.prefix_of(engine.contexts["b"])
    assert first is not None and second is first and prefixes.reads == 1
    assert await prefixes.prefix_of(engine.contexts["sys"]) is None  # a root has none
    await put_chunks(engine, "sys", 1, first=2)  # the system prompt grew by a chunk
    third = await prefixes.prefix_of(engine.contexts["b"])
    assert third is not None and third[0].shape[2] == 3 * T and prefixes.reads == 2


async def test_a_routed_prompt_gives_a_child_its_own_tokens_and_its_query(engine: Engine) -> None:
    """A prompt starts at token 0: a child's tokens are those after its ancestors', and the
    question is what follows its own end."""
    await use_estimator(engine)
    await put_chunks(engine, "sys", 2)
    await put_chunks(engine, "doc", 1, parent="sys", seed=1)
    prompt = list(range(1000, 1000 + 3 * T + 5))
    inputs = engine.profiling.inputs
    inputs.note_prompt("", "r1", prompt)
    await inputs.link_prompt("doc", "r1")
    profiler = engine.profiling.profiler
    assert profiler is not None
    assert profiler.queries.tokens("doc", T) == tuple(prompt[2 * T : 3 * T])
    _, queries = profiler.queries.profiling_set("doc")
    assert ProfilingQuery(token_ids=tuple(prompt[3 * T :])) in queries
