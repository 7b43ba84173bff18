"""A context kept only quantized (the LMCache plugin stored int8 chunks on the write advice's
word, and no unbounded tier keeps a reference copy of its original) is its own source: the
daemon builds the variants quantized the same or coarser from its dequantized chunks, and
EvicPress profiles it against them, never offering the original it cannot restore
(``ContextIndex.sources``, docs/daemon.md). In process: real tiers, profiler and executor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.kernels.chunk_codec import ChunkFormat, chunk_format, decode_chunk, encode_chunk
from kvtierd.kernels.placeholder import ModelCard, manifest_key, model_card_key
from kvtierd.kernels.rope import RopeSpec, rotate_keys
from kvtierd.policies.loader import parse_policy
from kvtierd.router_protocol import context_digest
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta, Operation, OpKind, Placement
from tests.daemon.test_profiling_engine import (  # registered_evaluators: a fixture
    CHUNKS,
    MODEL,
    D,
    H,
    L,
    T,
    TailTopicEvaluator,
    _put_context,
    _until,
    registered_evaluators,  # noqa: F401
)

pytestmark = pytest.mark.usefixtures("registered_evaluators")


def _config(tmp: Path) -> DaemonConfig:
    """Two bounded tiers: no reference copy of any original is kept."""
    tiers = (
        TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 8 << 20, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "data"), tiers=tiers)


@pytest.fixture
async def engine(tmp_path: Path):
    e = Engine(_config(tmp_path))
    await e.start()
    yield e
    await e.close()


async def _put_int8_context(engine: Engine, cid: str) -> torch.Tensor:
    """A context as the plugin stores it when the write advice says int8: int8 chunks under
    LMCache's keys, the model's card and the context's token ids known. Returns the KV it was
    computed as, ``[2, L, N, H*D]``."""
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16) for _ in range(CHUNKS)]
    for i, x in enumerate(chunks):
        fmt = chunk_format(x, H, "int8")
        data = encode_chunk(x, fmt).contiguous().view(-1).numpy().tobytes()
        meta = ObjectMeta(key=f"{MODEL}@1@0@{cid}-{i}@bfloat16", size_bytes=len(data),
                          context_id=cid, variant="int8", layout=fmt.layout(),
                          token_count=T)  # fmt: skip
        await engine.put_bytes(meta, memoryview(data))
    card = ModelCard(MODEL, D, RopeSpec.standard(D).inv_freq, 1000, (0,))
    engine.learn_card(ObjectMeta(key=model_card_key(MODEL), size_bytes=1), card.to_bytes())
    await engine.profiling.inputs.set_tokens(cid, list(range(1, CHUNKS * T + 1)))
    return torch.cat(chunks, dim=2)


async def _decoded(engine: Engine, key: str) -> tuple[torch.Tensor, np.ndarray]:
    """A stored chunk decoded by its layout, and its kept positions ``[L, H, T]``."""
    obj = engine.index.objects[key]
    fmt = ChunkFormat.parse(obj.meta.layout)
    out = torch.empty(fmt.shape, dtype=torch.bfloat16)
    data = await engine.mover.copy_out(obj)
    decode_chunk(torch.frombuffer(bytearray(data), dtype=torch.uint8), fmt, out)
    kept = np.frombuffer(obj.meta.kept_indices, "<i4").reshape(L, H, T)
    return out.float(), kept


async def test_fixed_keydiff_int8_is_made_from_int8_chunks(engine: Engine) -> None:
    """fixed keydiff@0.5+int8 over a context put as int8: stored as keydiff@0.5+int8, half the
    bytes, whose chunks decode to the kept tokens' KV (keys rotated by M - N). Before, the
    executor kept the int8 form: "its original is gone"."""
    kv = await _put_int8_context(engine, "doc")
    ctx = engine.contexts["doc"]
    int8_bytes = ctx.size_bytes
    await engine.apply_policy(parse_policy("placer: fixed\nvariant: keydiff@0.5+int8\n", "f.yaml"))
    await _until(lambda: ctx.variant == "keydiff@0.5+int8" and not engine.executor.pending)
    assert not engine.executor.failed
    assert 2 * ctx.size_bytes == int8_bytes  # half the chunks, each as large
    n = CHUNKS * T
    assert ctx.marker is not None
    assert ctx.marker[0].key == manifest_key(context_digest(MODEL, list(range(1, n + 1))))
    k_all = kv[0].float().reshape(L, n, H, D).permute(0, 2, 1, 3)
    v_all = kv[1].float().reshape(L, n, H, D).permute(0, 2, 1, 3)
    rope = ModelCard(MODEL, D, RopeSpec.standard(D).inv_freq, 1000, (0,)).rope()
    for key in ctx.keys:
        got, kept = await _decoded(engine, key)
        assert (np.diff(kept, axis=2) > 0).all() and kept.max() < n
        idx = torch.from_numpy(kept.astype(np.int64))[..., None].expand(L, H, T, D)
        keys = got[0].reshape(L, T, H, D).permute(0, 2, 1, 3)
        values = got[1].reshape(L, T, H, D).permute(0, 2, 1, 3)
        want_k = rotate_keys(k_all.gather(2, idx), rope, -n // 2)
        # int8 twice (the plugin's, then the variant's) and bf16: well under 0.1 here
        assert (keys - want_k).abs().max().item() < 0.1, key
        assert (values - v_all.gather(2, idx)).abs().max().item() < 0.1, key


async def test_evicpress_profiles_an_int8_only_context(engine: Engine) -> None:
    """The profiler reads the int8 chunks dequantized; the placer is offered the int8 form
    and the variants made from it (same or coarser quantization), never the original or an
    unquantized token-dropped form, and what it places is made. Before, the context was
    never profiled ("stored only as 'int8', its original is not kept")."""
    policy = parse_policy(
        "placer: evicpress\nvariants:\n  methods: [knorm, knorm+int8, int4]\n"
        "  ratios: [0.5]\nprofiling:\n  min_queries: 1\n",
        "e.yaml",
    )
    await engine.apply_policy(
        replace(policy, estimator=TailTopicEvaluator.name, evaluator=TailTopicEvaluator.name)
    )
    await _put_int8_context(engine, "doc")
    await engine.executor.idle()
    ctx = engine.contexts["doc"]
    options = [v.variant for v in engine.placing.profile(ctx).variants]
    assert options == ["int8", "knorm@0.5+int8", "int4"]  # not none, not knorm@0.5
    await engine.profiling.inputs.add_queries("doc", ["a head question"], from_traffic=False)
    await _until(lambda: engine.profiling.runs["ok"] >= 1 and not engine.executor.pending)
    assert engine.profiling.runs["failed"] == 0
    profiled = engine.profiling.options.profiled("doc")
    assert profiled["knorm@0.5+int8"].quality == pytest.approx(0.95)
    assert profiled["int8"].quality == 1.0  # its own form, scored against itself
    assert profiled["int8"].restore_s > 0  # dequantizing it is timed like any int8
    await engine.executor.idle()
    assert ctx.variant == engine.placing.target("doc").variant  # what it placed was made
    assert ctx.variant in options and not engine.executor.failed


async def test_a_crash_before_the_int8_chunks_went_leaves_the_variant(tmp_path: Path) -> None:
    """A crash after keydiff@0.5+int8's manifest, before the int8 chunks it was made from were
    deleted: at start they are superseded leftovers (settle_variants), not chunks added in
    form, and the context is its variant alone."""
    from kvtierd.storage import create_tier

    config = replace(_config(tmp_path), tiers=(
        TierConfig("cpu", "cpu", 4096, options={"staging_bytes": "32MiB"}),  # too small: SSD
        TierConfig("ssd", "ssd", 8 << 20, str(tmp_path / "ssd")),
    ))  # fmt: skip
    engine = Engine(config)
    await engine.start()
    try:
        await _put_int8_context(engine, "doc")
        ctx = engine.contexts["doc"]
        left = [(engine.index.objects[k].meta, await engine.mover.copy_out(engine.index.objects[k]))
                for k in ctx.keys]  # fmt: skip
        await engine.apply_policy(parse_policy("placer: fixed\nvariant: keydiff@0.5+int8\n", "f"))
        await _until(lambda: ctx.variant == "keydiff@0.5+int8" and not engine.executor.pending)
        assert engine.index.placement_of(ctx).tier == "ssd"
    finally:
        await engine.close()
    ssd = create_tier(config.tier("ssd"))
    await ssd.start()
    for meta, data in left:  # the deletion cut short
        await ssd.put(meta, memoryview(data))
    await ssd.close()
    engine = Engine(config)
    await engine.start()
    try:
        ctx = engine.contexts["doc"]
        assert (ctx.variant, len(ctx.keys)) == ("keydiff@0.5+int8", CHUNKS // 2)
        assert {m.key for m in engine.tiers["ssd"].metas()} & {m.key for m, _ in left} == set()
    finally:
        await engine.close()


async def test_a_compression_to_the_form_it_has_is_a_move(engine: Engine) -> None:
    """A plan queued before the context took its form asks to compress it to that form in
    another tier (e2e EvicPress run: "object '<ctx>\\0int8' is already in tier 'cpu'", or an
    int8 context quantized twice). The executor moves it, bytes unchanged."""
    await _put_context(engine, "doc")
    await engine.executor.idle()
    ctx = engine.contexts["doc"]
    where = engine.index.placement_of(ctx)
    other = "ssd" if where.tier == "cpu" else "cpu"
    original = Placement(ORIGINAL_VARIANT, where.tier)
    await engine.executor.apply(Operation(OpKind.COMPRESS, "doc", original,
                                          Placement("int8", where.tier)))  # fmt: skip
    assert ctx.variant == "int8" and not engine.executor.failed
    before = {k: bytes(await engine.mover.copy_out(engine.index.objects[k])) for k in ctx.keys}
    for tier in (where.tier, other):  # where it is (the error), and elsewhere (quantized again)
        stale = Operation(OpKind.COMPRESS, "doc", original, Placement("int8", tier))
        await engine.executor.apply(stale)
        assert engine.index.placement_of(ctx) == Placement("int8", tier)
        got = {k: bytes(await engine.mover.copy_out(engine.index.objects[k])) for k in ctx.keys}
        assert got == before and not engine.executor.failed
