"""A context's options for the placer, in process (no daemon, no tiers, no profiler yet): which
variants it is offered, their exact sizes, and what recomputing it costs when nothing is known
(``ContextProfile.variants``: the original only while it can be had)."""

from __future__ import annotations

from kvtierd.engine.context_options import UNKNOWN_PREFILL_S, ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.servable import Servability
from kvtierd.engine.state import ContextRecord, ObjectRecord, RunningPolicy
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.policies.loader import parse_policy
from kvtierd.sizes import count_unit, variant_size_bytes
from kvtierd.types import ObjectMeta, VariantProfile

L, T, H, D = 2, 16, 2, 32  # layers, tokens per chunk, KV heads, head dim (bf16)
CHUNK_BYTES = 2 * L * T * H * D * 2
GRID = "variants: {methods: [knorm, int8, int4, knorm+int8], ratios: [0.5]}\n"


def _options(index: ContextIndex, policy_text: str = GRID) -> ContextOptions:
    policy = RunningPolicy(parse_policy(f"placer: evicpress\n{policy_text}", "p.yaml"))
    return ContextOptions(
        index=index, policy=policy, servable=Servability({}), profiler=lambda: None
    )


def _context(index: ContextIndex, variant: str, chunks: int = 2) -> ContextRecord:
    quant = variant if variant in ("int8", "int4") else ""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H, quant).layout()
    for i in range(chunks):
        meta = ObjectMeta(key=f"doc/{i}", size_bytes=CHUNK_BYTES // (2 if quant else 1),
                          context_id="doc", variant=variant, layout=layout,
                          token_count=T)  # fmt: skip
        ctx = index.add(ObjectRecord(meta, "cpu"))
    return ctx


def _sized(name: str, quality: float = 0.0) -> VariantProfile:
    """``name`` of the two-chunk context, unprofiled (``quality``: what it is assumed)."""
    size = variant_size_bytes(L, H, D, 2 * T, 2, name, chunk_tokens=count_unit(name, T))
    return VariantProfile(name, size, quality)


def test_an_original_is_offered_first_then_the_grid_unprofiled() -> None:
    index = ContextIndex()
    options = _options(index)
    grid = options.grid(_context(index, "none"))
    assert grid[0] == VariantProfile("none", 2 * CHUNK_BYTES)
    assert [v.variant for v in grid] == ["none", "knorm@0.5", "int8", "int4", "knorm@0.5+int8"]
    assert all(v.quality == 0.0 for v in grid[1:])  # unprofiled: a quality-seeker stays away
    assert grid[1].size_bytes == _sized("knorm@0.5").size_bytes


def test_a_context_kept_only_quantized_has_no_original_among_its_options() -> None:
    """Its own form first (quality 1: what its profile is measured against), then what can be
    made from it: quantized the same or coarser, not the finer knorm@0.5."""
    index = ContextIndex()
    options = _options(index)
    ctx = _context(index, "int8")
    assert index.self_sourced(ctx)
    grid = options.grid(ctx)
    assert grid == (_sized("int8", quality=1.0), _sized("int4"), _sized("knorm@0.5+int8"))
    assert options.unchoosable(ctx) == ""  # int4 can be made from it: worth profiling


def test_a_quantized_context_with_nothing_to_make_is_not_worth_profiling() -> None:
    index = ContextIndex()
    options = _options(index, "variants: {methods: [knorm], ratios: [0.5]}\n")
    ctx = _context(index, "int8")
    assert [v.variant for v in options.grid(ctx)] == ["int8"]
    assert options.unchoosable(ctx) == (
        "not profiled: it is stored only as 'int8', its original is not kept, and the policy "
        "names no variant made from it"
    )


def test_a_token_dropped_form_without_its_original_has_only_itself() -> None:
    index = ContextIndex()
    options = _options(index)
    meta = ObjectMeta(key="doc\x00knorm@0.5\x000", size_bytes=123, context_id="doc",
                      variant="knorm@0.5")  # fmt: skip
    ctx = index.add(ObjectRecord(meta, "cpu"))
    assert options.grid(ctx) == (VariantProfile("knorm@0.5", 123),)
    assert options.unchoosable(ctx) == (
        "not profiled: it is stored only as 'knorm@0.5', its original is not kept"
    )


def test_an_eviction_only_policy_offers_the_form_the_context_has() -> None:
    index = ContextIndex()
    policy = RunningPolicy(parse_policy("placer: lru\n", "p.yaml"))
    options = ContextOptions(index=index, policy=policy, servable=Servability({}),
                             profiler=lambda: None)  # fmt: skip
    assert options.grid(_context(index, "none")) == (VariantProfile("none", 2 * CHUNK_BYTES),)


def test_without_a_profiler_nothing_is_known_and_forgetting_moves_the_version() -> None:
    index = ContextIndex()
    options = _options(index)
    ctx = _context(index, "none")
    assert options.prefill_s(ctx) == UNKNOWN_PREFILL_S
    assert options.prefill_tokens_s(1000) == UNKNOWN_PREFILL_S
    assert options.frequency("doc") is None and options.profiled("doc") == {}
    assert options.geometry_of(ctx)[1:] == (2 * T, 2 * CHUNK_BYTES)
    before = options.version
    options.changed()
    options.forget("doc")
    assert options.version == before + 2


def test_a_segment_of_a_tree_is_offered_quantization_but_no_token_dropping() -> None:
    """Issue 29: a context alone may be stored token-dropped; a parent with children and a
    child may not (positions, RoPE, the router's rewrite from token 0: ContextIndex
    .token_drop_refused); their quantized forms stay offered, per segment."""
    index = ContextIndex()
    options = _options(index)
    parent = _context(index, "none")
    alone = [v.variant for v in options.grid(parent)]
    assert "knorm@0.5" in alone and index.token_drop_refused(parent) == ""
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H, "").layout()
    meta = ObjectMeta(key="doc2/0", size_bytes=CHUNK_BYTES, context_id="doc2", layout=layout,
                      token_count=T, parent_context_id="doc")  # fmt: skip
    child = index.add(ObjectRecord(meta, "cpu"))
    assert child.parent == "doc" and index.children == {"doc": {"doc2"}}
    for ctx, why in ((parent, "1 context(s) continue it"), (child, "continues context 'doc'")):
        assert [v.variant for v in options.grid(ctx)] == ["none", "int8", "int4"]
        assert why in index.token_drop_refused(ctx)
    index.remove("doc/0")
    index.remove("doc/1")  # the parent is gone: its child is a root, offered everything again
    assert child.parent == "" and index.children == {}
    assert "knorm@0.5" in [v.variant for v in options.grid(child)]


def test_a_context_without_a_chunk_layout_keeps_no_geometry_and_one_with_it_does() -> None:
    """Issue 42: 1M one-object contexts without a layout kept a 110-byte cache entry each for
    a geometry their first object tells at once; a chunked context keeps its entry (a put of
    chunk k would re-parse k layouts) and forgetting it returns its tokens."""
    index = ContextIndex()
    options = _options(index)
    blob = index.add(ObjectRecord(ObjectMeta(key="blob", size_bytes=100), "cpu"))
    assert options.geometry_of(blob) == (None, 0, 0)
    assert options.geometry_of(blob) == (None, 0, 0)
    chunked = _context(index, "none")
    assert options.geometry_of(chunked)[1:] == (2 * T, 2 * CHUNK_BYTES)
    assert list(options._geometry_cache) == ["doc"]
    assert options.forget("blob") == 0
    assert options.forget("doc") == 2 * T
