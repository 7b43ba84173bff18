"""EvicPress end to end in the engine (in-process, real tiers, real profiler, real executor):
contexts are profiled and placed by utility, DescribeContext's table explains the choice, and
when real queries drift the context is re-profiled and re-placed — but not while loads run."""

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
from kvtierd.engine.write_advice import VariantPrior
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard, model_card_key
from kvtierd.kernels.rope import RopeSpec
from kvtierd.policies.evicpress import EvicPressPlacer
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import (
    ContextKV,
    ProfilingQuery,
    QualityEvaluator,
    QualityResult,
    StoredForm,
)
from kvtierd.profiler.quality import DEFAULT_FORM, EVALUATORS
from kvtierd.types import ObjectMeta

L, H, D, T, CHUNKS = 2, 2, 32, 16, 4
CHUNK_BYTES = 2 * L * T * H * D * 2


class TailTopicEvaluator(QualityEvaluator):
    """Token-dropped variants answer 'head' questions well and 'tail' ones badly; stands in
    for a model whose answers change with the query distribution."""

    name = "engine-test-topic"

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        tail = sum("tail" in q.text for q in queries) / max(1, len(queries))
        quality = {v: 1.0 if "@" not in v else 0.95 - 0.9 * tail for v in variants}
        return QualityResult(self.name, MappingProxyType(quality), len(queries))


class LayoutEvaluator(QualityEvaluator):
    """Scores nothing; remembers the layouts it was asked to score in."""

    name = "engine-test-layout"
    seen: ClassVar[list[StoredForm]] = []

    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        self.seen.append(form)
        return QualityResult(self.name, MappingProxyType(dict.fromkeys(variants, 0.5)), 3)


@pytest.fixture(autouse=True)
def registered_evaluators() -> Iterator[None]:
    """This module's evaluators, registered while a test runs: another module importing this
    one (under another name: two copies of each class) registers its own copies in its own
    tests, and each test reads the lists of the copy it registered."""
    with EVALUATORS.registered(TailTopicEvaluator), EVALUATORS.registered(LayoutEvaluator):
        yield


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 20_000, options={"staging_bytes": "32MiB"}),
        # capacity 0: unbounded, so it keeps every original (EvicPress's remote disk)
        TierConfig("ssd", "ssd", 0, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


MODEL = "/models/test"


async def _put_context(engine: Engine, cid: str, *, tokens: bool = True) -> None:
    """A context as the LMCache plugin and the router leave it: chunks under LMCache's keys
    (model@world@worker@hash@dtype), its token ids (unless not ``tokens``) and the model's
    card known, so that its token-dropped variants can be stored in the form vLLM loads
    (engine/servable.py)."""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    g = torch.Generator().manual_seed(0)
    for i in range(CHUNKS):
        x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        data = memoryview(x.view(torch.uint8).numpy().tobytes())
        meta = ObjectMeta(
            key=f"{MODEL}@1@0@{cid}-{i}@bfloat16",
            size_bytes=len(data),
            context_id=cid,
            dtype="bfloat16",
            shape=tuple(x.shape),
            layout=layout,
            token_count=T,
        )
        await engine.put_bytes(meta, data)
    card = ModelCard(MODEL, D, RopeSpec.standard(D).inv_freq, 1000, (0,))
    engine.learn_card(ObjectMeta(key=model_card_key(MODEL), size_bytes=1), card.to_bytes())
    if tokens:
        await engine.profiling.inputs.set_tokens(cid, list(range(1, CHUNKS * T + 1)))


async def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@pytest.fixture
async def engine(tmp_path: Path):
    e = Engine(_config(tmp_path))
    await e.start()
    yield e
    await e.close()


async def _apply_knorm_policy(
    engine: Engine, profiling: str, estimator: str = "", evaluator: str = ""
) -> None:
    """EvicPress over knorm@{1.0, 0.5} with alpha from the measured tiers: keeping the original
    on SSD must cost more TTFT than a 5% quality loss is worth, and less than a 50% loss (see
    the module docstring); so the placer's margin on knorm@0.5 in cpu at quality q is
    ``q - 1 + 1/6`` (``engine/margin.py``). The estimator is ``TailTopicEvaluator`` unless
    named; nothing refines it unless ``evaluator`` is named."""
    cpu, ssd = engine.placing.tier_models()
    dt = (
        2 * CHUNKS * CHUNK_BYTES / ssd.load_bandwidth_bytes_per_s
        + ssd.load_overhead_s
        - (CHUNKS * CHUNK_BYTES / 2 / cpu.load_bandwidth_bytes_per_s + cpu.load_overhead_s)
    )
    policy = parse_policy(
        f"placer: evicpress\nalpha: {6 * dt:.9g}\nvariants:\n  methods: [knorm]\n"
        f"  ratios: [1.0, 0.5]\nprofiling:\n{profiling}",
        "test.yaml",
    )
    estimator = estimator or TailTopicEvaluator.name
    await engine.apply_policy(
        replace(policy, estimator=estimator, evaluator=evaluator or estimator)
    )


async def test_profiled_placed_and_replaced_on_drift(engine: Engine) -> None:
    # One question suffices here (the confidence rule is test_profile_confidence.py's).
    await _apply_knorm_policy(
        engine, "  reprofile_threshold: 0.05\n  interval_s: 0.2\n  min_queries: 1\n"
    )
    await _put_context(engine, "doc")
    await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=False)
    ctx = engine.contexts["doc"]
    await _until(lambda: engine.profiling.runs["ok"] >= 1 and not engine.executor.pending)
    await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
    assert engine.index.placement_of(ctx).tier == "cpu"
    table = engine.options_of(ctx)
    assert (table[0].variant, table[0].tier) == ("knorm@0.5", "cpu")
    assert "stored as knorm@0.5 in cpu" in engine.placement_reason(ctx, table)
    assert ctx.reference is not None  # the original stays on the unbounded tier

    # Real traffic now asks about the tail: quality of the placed variant drops.
    (lease,) = await engine.get([next(iter(ctx.keys))])
    tail = [f"a tail question {i}" for i in range(3)]
    await engine.profiling.inputs.add_queries("doc", tail, True)
    await asyncio.sleep(1.0)  # several drift-loop passes while a client holds a lease
    assert engine.profiling.reprofiled == 0, "re-profiling must wait while loads run"
    assert engine.index.placement_of(ctx).variant == "knorm@0.5"
    engine.release([lease.lease_id])
    await _until(lambda: engine.profiling.reprofiled >= 1)
    placed = engine.index.placement_of
    await _until(lambda: placed(ctx).variant == "none" and not engine.executor.pending)
    assert engine.index.placement_of(ctx).tier == "ssd"
    keys, _ = await engine.mover.context_tensors(ctx)
    assert keys.shape == (L, H, CHUNKS * T, D)  # the original is back, whole


async def test_write_advice_follows_the_placer(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVStore.Advise: a held context's placement; for a new one the placer's first choice with
    the profiled contexts' mean profile; the original before anything is profiled."""
    await _apply_knorm_policy(engine, "  interval_s: 0.2\n  min_queries: 1\n")
    advisor = engine.write_advisor
    before = advisor.advise("new", CHUNKS * T, CHUNKS * CHUNK_BYTES)
    assert (before.variant, before.source) == ("none", "default")
    assert "no context of yours is profiled yet" in before.reason

    await _put_context(engine, "doc")
    await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=False)
    ctx = engine.contexts["doc"]
    await _until(lambda: engine.index.placement_of(ctx).variant == "knorm@0.5")
    held = advisor.advise("doc", 0, 0)
    assert (held.variant, held.tier, held.source) == ("knorm@0.5", "cpu", "placed")

    new = advisor.advise("new", CHUNKS * T, CHUNKS * CHUNK_BYTES)
    assert (new.variant, new.tier, new.source) == ("knorm@0.5", "cpu", "prior")
    assert "1 of your profiled contexts" in new.reason
    # issue 40.8: another tenant's advice reads only its own profiles (none here), and its
    # reason names no count of the first tenant's contexts
    other = advisor.advise("b/new", CHUNKS * T, CHUNKS * CHUNK_BYTES, tenant="b")
    assert (other.variant, other.source) == ("none", "default"), other
    assert "profiled contexts" not in other.reason and "1 " not in other.reason
    huge = advisor.advise("huge", CHUNKS * T, 10**9)  # fits only the unbounded, slow tier
    assert huge.tier != "cpu"
    # The room a new context takes in a full tier is priced by the placer's next operation
    # there (EvicPressPlacer.room_cost); priced above its gain, the advice goes elsewhere.
    placer = engine.placing.placer
    assert isinstance(placer, EvicPressPlacer)
    room = placer.room_cost
    monkeypatch.setattr(placer, "room_cost", lambda t, b: 1e9 if t == "cpu" else room(t, b))
    pushed = advisor.advise("new", CHUNKS * T, CHUNKS * CHUNK_BYTES)
    assert (pushed.tier, pushed.source) == ("ssd", "prior")
    assert "less the room it takes from others" in pushed.reason
    # The original is advised only where it fits as it is: a new context arrives unprofiled,
    # and shipped whole into a full tier it can only compete whole (write_advice.py). Priced
    # at almost nothing, the room for the original still rules the full tiers out for it.
    size = 8_000  # the original fits the CPU tier (20,000 bytes) as it is, once room is made
    monkeypatch.setattr(
        advisor,
        "prior",
        lambda tenant="": {
            "none": VariantPrior(1.0, 1.0, 0.0),
            "knorm@0.5": VariantPrior(0.2, 0.5, 0.0),
        },
    )
    monkeypatch.setattr(placer, "room_cost", lambda t, b: 0.0)
    whole = advisor.advise("new", CHUNKS * T, size)
    assert (whole.variant, whole.tier) == ("none", "cpu")  # the unconstrained first choice
    monkeypatch.setattr(
        placer, "room_cost", lambda t, b: 1e-9 if t == "cpu" and b > 0.75 * size else 0.0
    )
    full = advisor.advise("new", CHUNKS * T, size)
    assert (full.variant, full.tier) in {("knorm@0.5", "cpu"), ("none", "ssd")}
    monkeypatch.undo()

    await engine.apply_policy(parse_policy("placer: fixed\nvariant: int8\n", "f.yaml"))
    fixed = engine.write_advisor.advise("other", CHUNKS * T, CHUNKS * CHUNK_BYTES)
    assert (fixed.variant, fixed.source) == ("int8", "default")


async def test_grid_counts_chunks_added_in_compressed_form(engine: Engine) -> None:
    """A compressed context that a client extended with int8 chunks (the LMCache plugin on the
    write advice's word) is sized as the original of all its chunks, not of the first ones."""
    from kvtierd.kernels.chunk_codec import chunk_format, encode_chunk

    policy = parse_policy(
        "placer: evicpress\nvariants:\n  methods: [knorm, int8]\n  ratios: [0.5]\n",
        "test.yaml",
    )
    await engine.apply_policy(
        replace(policy, estimator=TailTopicEvaluator.name, evaluator=TailTopicEvaluator.name)
    )
    await _put_context(engine, "doc")
    ctx = engine.contexts["doc"]
    await engine.executor.idle()
    await engine.variants.compress_context(ctx, "int8", "cpu")
    assert ctx.variant == "int8"
    g = torch.Generator().manual_seed(1)
    for i in range(CHUNKS, CHUNKS + 2):
        x = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        fmt = chunk_format(x, H, "int8")
        data = encode_chunk(x, fmt)
        meta = ObjectMeta(key=f"doc/{i}", size_bytes=data.nbytes, context_id="doc",
                          variant="int8", layout=fmt.layout(), token_count=T)  # fmt: skip
        await engine.put_bytes(meta, memoryview(data.numpy().tobytes()))
    sizes = {v.variant: v.size_bytes for v in engine.profiling.options.grid(ctx)}
    assert sizes["none"] == (CHUNKS + 2) * CHUNK_BYTES


async def test_profiles_score_and_size_the_kept_counts_the_daemon_stores(engine: Engine) -> None:
    """Variants of a context of 16-token chunks keep whole chunks (``encode_variant``): the
    profile scores and sizes knorm@0.3 of 64 tokens as 16 kept tokens, not 19."""
    policy = parse_policy(
        "placer: evicpress\nvariants:\n  methods: [knorm]\n  ratios: [1.0, 0.3]\n", "t.yaml"
    )
    await engine.apply_policy(
        replace(policy, estimator=LayoutEvaluator.name, evaluator=LayoutEvaluator.name)
    )
    seen = LayoutEvaluator.seen  # the copy registered_evaluators registered for this test
    seen.clear()
    await _put_context(engine, "doc")
    ctx = engine.contexts["doc"]
    assert await engine.profiling.profile_context(ctx)
    # On a loaded machine the daemon's own loop may profile the settled context first (the
    # test's call then reuses that profile): every evaluation, whoever ran it, saw chunks
    assert seen and {x.chunk_tokens for x in seen} == {T}
    grid = {v.variant: v.size_bytes for v in engine.profiling.options.grid(ctx)}
    record = engine.profiling.record("doc")
    assert record is not None
    profiled = {v.variant: v.size_bytes for v in record.profile.variants}
    assert profiled == grid
    assert grid["knorm@0.3"] == CHUNK_BYTES  # one chunk of the four


async def test_a_first_profile_without_room_in_the_arena_waits_and_is_not_an_error(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 42: with puts outrunning the moves down, the arena had no room to read contexts
    in, and each first profile failed with an ERROR, one after another without a pause. Now
    the context is profiled again once there is room, the pass waits, and the log says so
    once, at WARNING."""
    from kvtierd.errors import CapacityError

    await _apply_knorm_policy(engine, "")
    tensors, refused = engine.mover.context_tensors, []

    async def full_twice(ctx):  # the arena full for the first two reads, as in the bench
        if len(refused) < 2:
            refused.append(ctx.context_id)
            raise CapacityError("shared-memory arena full: no free block of 8192 bytes")
        return await tensors(ctx)

    engine.mover.context_tensors = full_twice  # type: ignore[method-assign]
    with caplog.at_level("DEBUG", logger="kvtierd.engine.profiling.profiling_service"):
        await _put_context(engine, "doc")
        await _until(lambda: engine.profiling.runs["ok"] >= 1)
    assert refused == ["doc", "doc"] and engine.profiling.runs["no room"] == 2
    assert engine.profiling.runs["failed"] == 0
    assert "doc" not in engine.profiling.failed_why
    waits = [r for r in caplog.records if "waits for room in the arena" in r.getMessage()]
    assert [r.levelname for r in waits] == ["WARNING", "DEBUG"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
