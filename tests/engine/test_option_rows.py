"""Each context's options kept between rebalances (issue 28, ``engine/option_rows.py``): a
row equals what ``ContextOptions.grid`` works out, is reused while nothing it was built from
changed, and is rebuilt when the context, the grid or a caller says it changed."""

from __future__ import annotations

from kvtierd.engine.context_options import ContextOptions
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.option_rows import OptionRows
from kvtierd.engine.servable import Servability
from kvtierd.engine.state import ContextRecord, ObjectRecord, RunningPolicy
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.policies.loader import parse_policy
from kvtierd.sizes import KvGeometry, count_unit, grid_size_bytes, variant_size_bytes
from kvtierd.types import ObjectMeta

L, T, H, D = 2, 16, 2, 32
GRID = "placer: evicpress\nvariants: {methods: [knorm, int8, int4], ratios: [0.5, 0.25]}\n"


def _setup(policy_text: str = GRID) -> tuple[ContextIndex, RunningPolicy, OptionRows]:
    index = ContextIndex()
    policy = RunningPolicy(parse_policy(policy_text, "p.yaml"))
    options = ContextOptions(
        index=index, policy=policy, servable=Servability({}), profiler=lambda: None
    )
    return index, policy, OptionRows(options)


def _chunk(index: ContextIndex, cid: str, i: int) -> ContextRecord:
    layout = ChunkFormat((2, L, T, H * D), "bfloat16", H).layout()
    meta = ObjectMeta(key=f"{cid}/{i}", size_bytes=2 * L * T * H * D * 2, context_id=cid,
                      layout=layout, token_count=T)  # fmt: skip
    return index.add(ObjectRecord(meta, "cpu"))


def test_rows_are_the_grid_as_arrays_and_are_kept_between_rebalances():
    index, _, rows = _setup()
    a = _chunk(index, "a", 0)
    b = _chunk(index, "b", 0)
    _chunk(index, "b", 1)
    got = rows.arrays([a, b])
    options = rows._options
    for i, ctx in enumerate([a, b]):
        grid = options.grid(ctx)
        k = len(grid)
        assert got.variant_names[i] == tuple(v.variant for v in grid)
        assert got.size_bytes[i, :k].tolist() == [v.size_bytes for v in grid]
        assert got.quality[i, :k].tolist() == [v.quality for v in grid]
        assert got.valid[i].sum() == k
    assert rows.rebuilt == 2
    rows.arrays([a, b])
    assert rows.rebuilt == 2  # nothing changed: no row is worked out again


def test_a_row_is_rebuilt_when_its_context_grows_or_a_caller_says_so():
    index, _, rows = _setup()
    a = _chunk(index, "a", 0)
    before = rows.arrays([a]).size_bytes[0, 0]
    _chunk(index, "a", 1)
    after = rows.arrays([a])
    assert rows.rebuilt == 2 and after.size_bytes[0, 0] == 2 * before
    rows.row(a, fresh=True)
    assert rows.rebuilt == 3


def test_a_new_policy_makes_every_row_stale():
    index, policy, rows = _setup()
    ctxs = [_chunk(index, c, 0) for c in "abc"]
    rows.arrays(ctxs)
    policy.current = parse_policy("placer: evicpress\nvariants: {methods: [int8]}\n", "q.yaml")
    got = rows.arrays(ctxs)
    assert rows.rebuilt == 6
    assert got.variant_names[0] == ("none", "int8")
    assert not got.valid[:, 2:].any()  # rows narrower than before are padded


def test_forgotten_rows_are_reused_and_pruned():
    index, _, rows = _setup()
    ctxs = [_chunk(index, c, 0) for c in "abcd"]
    rows.arrays(ctxs)
    rows.forget("a")
    assert len(rows) == 3
    assert rows.prune(["b"]) == 2 and len(rows) == 1
    e = _chunk(index, "e", 0)
    rows.arrays([e])
    assert len(rows) == 2


def test_rows_are_taken_released_first_then_fresh_in_order_with_no_list_of_free_ones():
    """Issue 42: growing to a million rows made a list of the half million not taken yet
    (36 bytes each, ~19 B an object at 1M); the rows never taken are a count instead."""
    index, _, rows = _setup()
    ctxs = [_chunk(index, c, 0) for c in "abcde"]
    rows.arrays(ctxs)
    assert [rows._slot[c] for c in "abcde"] == [0, 1, 2, 3, 4]
    assert rows.count.size == 16 and rows._free == []  # 11 rows not taken: no list of them
    rows.forget("b")
    rows.forget("d")
    rows.arrays([_chunk(index, c, 0) for c in "fgh"])
    assert [rows._slot[c] for c in "fgh"] == [3, 1, 5]  # released ones first, the last first


def test_grid_sizes_are_each_variants_exact_size():
    geometry = KvGeometry(L, H, D, 3 * T, 2, T)
    names = ("knorm@0.5", "int8", "int4", "knorm@0.25+int8")
    want = [variant_size_bytes(L, H, D, 3 * T, 2, n, chunk_tokens=count_unit(n, T)) for n in names]
    assert list(grid_size_bytes(geometry, names)) == want


def test_frequency_and_prefill_arrays_are_the_per_context_values_bit_for_bit():
    """The rebalance's frequencies and recompute times, read as arrays (issue 28), equal
    what each context's own path gives: the decayed count (else its hits, at least 1) and
    ``TtftModel.prefill_s`` of its tokens."""
    import numpy as np

    from kvtierd.profiler import Profiler, TtftModel, make_evaluator

    profiler = Profiler(make_evaluator("attention"), TtftModel(prefill_tokens_per_s=1234.567),
                        policy=parse_policy(GRID, "p.yaml"))  # fmt: skip
    index = ContextIndex()
    options = ContextOptions(index=index, policy=RunningPolicy(parse_policy(GRID, "p.yaml")),
                             servable=Servability({}), profiler=lambda: profiler)  # fmt: skip
    rows = OptionRows(options)
    rng = np.random.default_rng(3)
    ctxs = []
    for i in range(300):
        cid = f"c{i}"
        for k in range(int(rng.integers(1, 5))):
            ctx = _chunk(index, cid, k)
        ctx.hits = int(rng.integers(0, 4))
        if i % 3:  # a third never accessed: their hits count
            for t in rng.uniform(0.0, 1e5, 2).tolist():
                profiler.frequency.record(cid, t, float(rng.uniform(0.5, 2.0)))
        ctxs.append(ctx)
    now = 1.2e5 + 0.5
    got = rows._frequencies(ctxs, now)
    want = []
    for ctx in ctxs:
        f = profiler.frequency.frequency(ctx.context_id, now)
        want.append(f if f > 0 else float(max(ctx.hits, 1)))
    assert got.tobytes() == np.array(want).tobytes()
    prefill = rows.arrays(ctxs).prefill_s
    tokens = [options.tokens_of(ctx) for ctx in ctxs]
    assert prefill.tobytes() == np.array([profiler.ttft.prefill_s(t) for t in tokens]).tobytes()
    assert len(set(tokens)) > 1


def test_unprofiled_contexts_alike_share_one_stamp_and_a_grown_one_gets_its_own():
    """Issue 42: a stamp tuple a row was 80 bytes an object at 1M one-object contexts; equal
    stamps without a profile record are one tuple, compared by value as before."""
    index, _, rows = _setup()
    a, b = _chunk(index, "a", 0), _chunk(index, "b", 0)
    rows.arrays([a, b])
    assert rows._stamp[rows._slot["a"]] is rows._stamp[rows._slot["b"]]
    _chunk(index, "b", 1)
    rows.arrays([a, b])
    assert rows.rebuilt == 3  # b's row was rebuilt: its stamp (two chunks) is not a's
    assert rows._stamp[rows._slot["a"]] != rows._stamp[rows._slot["b"]]


def _plain(index: ContextIndex, cid: str, size: int) -> ContextRecord:
    """A context of one object without a chunk layout: one option, itself as stored."""
    return index.add(ObjectRecord(ObjectMeta(key=cid, size_bytes=size, context_id=cid), "cpu"))


def test_one_variant_rows_take_no_wide_row_and_read_back_beside_wide_ones():
    """Issue 42: rows were as wide as the widest grid, 744 bytes a context for 31 variants
    where a context without a chunk layout has one. Now a one-variant row keeps its three
    numbers in ``first``; only wider rows take a row of ``wide``, given back when forgotten."""
    index, _, rows = _setup()
    plain = [_plain(index, f"p{i}", 1000 + i) for i in range(40)]
    wide = [_chunk(index, f"w{i}", 0) for i in range(3)]
    mixed = [*plain[:20], *wide, *plain[20:]]
    got = rows.arrays(mixed)
    options = rows._options
    for i, ctx in enumerate(mixed):
        grid = options.grid(ctx)
        k = len(grid)
        assert got.variant_names[i] == tuple(v.variant for v in grid)
        assert got.size_bytes[i, :k].tolist() == [v.size_bytes for v in grid]
        assert got.quality[i, :k].tolist() == [v.quality for v in grid]
        assert got.restore_s[i, :k].tolist() == [v.restore_s for v in grid]
        assert got.size_bytes[i, k:].tolist() == [0.0] * (got.size_bytes.shape[1] - k)
        assert rows.profile(ctx).variants == tuple(grid)
    assert len(plain[0].keys) == 1 and len(options.grid(plain[0])) == 1
    assert (rows.wide_at[[rows.row(c) for c in plain]] == -1).all()
    assert len({int(rows.wide_at[rows.row(c)]) for c in wide}) == 3
    assert rows.wide.shape[0] - len(rows._wide_free) == 3  # rows of wide taken: one each
    rows.forget("w1")
    assert rows.wide.shape[0] - len(rows._wide_free) == 2
    again = _chunk(index, "w3", 0)
    assert rows.profile(again).variants == tuple(options.grid(again))
    assert rows.wide.shape[0] - len(rows._wide_free) == 3
