"""Every registered method: Triton (interpreter) against the torch reference, plus exact sets.

The matrix is generated from the registry, so a new method is tested without new test code.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DTYPES, SCORE_TOL, assert_same_kept, make_kv, paged_source

from kvtierd.kernels import registry
from kvtierd.kernels.base import TokenDropMethod, select_kept, select_reference
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.snapkv import SnapKVMethod

METHODS = registry.METHODS.names()
SHAPES = [(2, 2, 77, 24, 2), (1, 3, 130, 32, 1), (1, 1, 5, 16, 3)]  # L, H, N, D, GQA group


def _method(name: str) -> TokenDropMethod:
    # snapkv at window 8 keeps the interpreter runs small; its default (64) is tested below
    return SnapKVMethod(window=8) if name == "snapkv" else get_method(name)


def _queries(m: TokenDropMethod, lyr: int, hq: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    w = m.window if isinstance(m, SnapKVMethod) else 8
    return torch.randn(lyr, hq, w, d, generator=torch.Generator().manual_seed(7)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", METHODS)
def test_triton_matches_reference(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    lyr, h, n, d, g = shape
    k, v = make_kv(lyr, h, n, d, dtype)
    src = KVSource.from_contiguous(k, v)
    m = _method(name)
    q = _queries(m, lyr, h * g, d, dtype)
    ref = m.score(src, q, backend="torch")
    tri = m.score(src, q, backend="triton")
    assert ref.shape == tri.shape == (lyr, h, n) and tri.dtype == torch.float32
    torch.testing.assert_close(tri, ref, **SCORE_TOL)
    for ratio in (0.1, 0.37, 0.8):
        want = m.select(src, ratio, queries=q, backend="torch")
        got = m.select(src, ratio, queries=q, backend="triton")
        assert want.shape[-1] == m.kept_count(n, ratio)
        assert_same_kept(got, want, ref)


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("name", METHODS)
def test_paged_layout_scores_like_contiguous(name: str, layout: str) -> None:
    k, v = make_kv(2, 2, 61, 16, torch.bfloat16)
    m = _method(name)
    q = _queries(m, 2, 4, 16, torch.bfloat16)
    want = m.select(KVSource.from_contiguous(k, v), 0.4, queries=q, backend="torch")
    paged = paged_source(k, v, block_size=8, layout=layout)
    ref_scores = m.score(KVSource.from_contiguous(k, v), q, backend="torch")
    assert_same_kept(m.select(paged, 0.4, queries=q, backend="triton"), want, ref_scores)
    assert torch.equal(m.select(paged, 0.4, queries=q, backend="torch"), want)


@pytest.mark.parametrize("name", METHODS)
def test_ratio_one_is_identity(name: str) -> None:
    k, v = make_kv(1, 2, 33, 16, torch.float16)
    m = _method(name)
    q = _queries(m, 1, 2, 16, torch.float16)
    out = m.compress(KVSource.from_contiguous(k, v), 1.0, queries=q, backend="triton")
    assert torch.equal(out.kept, torch.arange(33, dtype=torch.int32).expand(1, 2, 33))
    assert torch.equal(out.keys, k) and torch.equal(out.values, v)


@pytest.mark.parametrize("name", METHODS)
def test_kept_is_ascending_unique_and_same_count_everywhere(name: str) -> None:
    k, v = make_kv(3, 2, 90, 16, torch.float32)
    m = _method(name)
    kept = m.select(
        KVSource.from_contiguous(k, v), 0.3, queries=_queries(m, 3, 2, 16, torch.float32)
    )
    assert kept.shape[:2] == (3, 2)
    assert bool((kept[..., 1:] > kept[..., :-1]).all())


def test_knorm_exact_kept_set() -> None:
    norms = torch.tensor([5.0, 1.0, 3.0, 1.0, 0.5, 9.0, 2.0])
    k = torch.zeros(1, 1, 7, 4)
    k[..., 0] = norms
    src = KVSource.from_contiguous(k, torch.ones_like(k))
    for backend in ("torch", "triton"):
        kept = get_method("knorm").select(src, 3 / 7, backend=backend)  # type: ignore[arg-type]
        assert kept.flatten().tolist() == [1, 3, 4]
        kept2 = get_method("knorm").select(src, 2 / 7, backend=backend)  # type: ignore[arg-type]
        assert kept2.flatten().tolist() == [1, 4]  # tie 1 vs 3: the earlier position wins


def test_ties_broken_by_position_in_both_backends() -> None:
    scores = torch.tensor([[[1.0, 2.0, 2.0, 0.0, 2.0, 2.0, 1.0]]])
    assert select_reference(scores, 3).flatten().tolist() == [1, 2, 4]
    assert select_kept(scores, 3, backend="triton").flatten().tolist() == [1, 2, 4]
    assert select_kept(scores, 5, backend="triton").flatten().tolist() == [0, 1, 2, 4, 5]
    inf = float("inf")
    scores = torch.tensor([[[inf, 0.0, 0.0, inf]]])
    assert select_kept(scores, 3, backend="triton").flatten().tolist() == [0, 1, 3]


def test_streamingllm_exact() -> None:
    k, v = make_kv(1, 2, 50, 8, torch.float16)
    kept = get_method("streamingllm").select(KVSource.from_contiguous(k, v), 0.2)
    assert kept[0, 0].tolist() == [0, 1, 2, 3, *range(44, 50)]
    # below the sink count: exactly the count asked for, the first sinks (kvpress keeps 2 too)
    tiny = get_method("streamingllm").select(KVSource.from_contiguous(k, v), 0.04)
    assert tiny[0, 1].tolist() == [0, 1]
    no_sinks = get_method("streamingllm", (("sinks", 0),))
    assert no_sinks.select(KVSource.from_contiguous(k, v), 0.1)[0, 0].tolist() == [*range(45, 50)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_snapkv_below_the_window_keeps_the_latest_window_tokens(backend: str) -> None:
    k, v = make_kv(1, 1, 100, 16, torch.float32)
    q = torch.randn(1, 2, 64, 16)
    src = KVSource.from_contiguous(k, v)
    kept = get_method("snapkv").select(src, 0.1, queries=q, backend=backend)  # type: ignore[arg-type]
    assert kept[0, 0].tolist() == list(range(90, 100))  # exactly 10, not the 64 of the window
    at_window = get_method("snapkv").select(src, 0.64, queries=q, backend=backend)  # type: ignore[arg-type]
    assert at_window[0, 0].tolist() == list(range(36, 100))


def test_snapkv_options_window_and_pool() -> None:
    k, v = make_kv(1, 1, 100, 16, torch.float32)
    q = torch.randn(1, 2, 64, 16)  # more queries than the window: the last 16 are used
    src = KVSource.from_contiguous(k, v)
    m = get_method("snapkv", (("window", 16), ("pool", 1)))
    assert (m.window, m.pool) == (16, 1)
    ref = SnapKVMethod(window=16, pool=1).score(src, q[:, :, -16:], backend="torch")
    assert torch.equal(m.score(src, q, backend="torch"), ref)
    pooled = SnapKVMethod(window=16, pool=7).score(src, q, backend="torch")
    raw = torch.nn.functional.avg_pool1d(ref[..., :84], 7, stride=1, padding=3)
    torch.testing.assert_close(pooled[..., :84], raw)  # pool = kvpress's kernel_size
    c = m.compress(src, 0.5, queries=q)
    assert c.variant == "snapkv-window=16-pool=1@0.5" and c.num_kept == 50


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_eviction_block_keeps_whole_pages_none_forced(backend: str) -> None:
    k, v = make_kv(2, 2, 100, 16, torch.float16)
    src = KVSource.from_contiguous(k, v)
    token = get_method("paged_eviction").score(src, backend="torch")
    kept = get_method("paged_eviction_block").select(src, 0.5, backend=backend)  # type: ignore[arg-type]
    assert kept.shape[-1] == 52  # the 4 tokens past the last full page + 3 of the 6 full pages
    for lyr, h in ((a, b) for a in range(2) for b in range(2)):
        row = kept[lyr, h].tolist()
        assert row[-4:] == [96, 97, 98, 99]
        pages = sorted({p // 16 for p in row[:-4]})
        means = token[lyr, h, :96].view(6, 16).mean(dim=-1)
        assert pages == sorted(means.topk(3).indices.tolist())  # the paper's rule: top page means


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_eviction_block_keep_ends_option(backend: str) -> None:
    k, v = make_kv(2, 2, 100, 16, torch.float16)
    src = KVSource.from_contiguous(k, v)
    m = get_method("paged_eviction_block", (("keep_ends", 1),))
    kept = m.select(src, 0.5, backend=backend)  # type: ignore[arg-type]
    assert kept.shape[-1] == 52
    for row in kept.reshape(-1, 52).tolist():
        pages = sorted({p // 16 for p in row})
        assert pages[0] == 0 and pages[-1] == 6
        assert len(row) == sum(min(16, 100 - 16 * p) for p in pages)
    small = get_method("paged_eviction_block", (("page", 8),)).select(src, 0.3, backend=backend)  # type: ignore[arg-type]
    assert small.shape[-1] == 4 + 8 * 3  # 100 = 12 pages of 8 + 4


def test_paged_eviction_token_score_by_hand() -> None:
    k = torch.zeros(1, 1, 4, 2)
    v = torch.zeros(1, 1, 4, 2)
    k[..., 0] = torch.tensor([1.0, 2.0, 4.0, 1.0])
    v[..., 0] = torch.tensor([1.0, 1.0, 1.0, 3.0])
    for backend in ("torch", "triton"):
        s = get_method("paged_eviction").score(KVSource.from_contiguous(k, v), backend=backend)  # type: ignore[arg-type]
        assert s.flatten().tolist() == [1.0, 0.5, 0.25, 3.0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_eviction_sinks_option(backend: str) -> None:
    k, v = make_kv(1, 2, 40, 8, torch.float32)
    v[..., :3, :] *= 1e-3  # tiny values: the paper's rule evicts the first tokens
    src = KVSource.from_contiguous(k, v)
    plain = get_method("paged_eviction").select(src, 0.25, backend=backend)  # type: ignore[arg-type]
    assert not bool((plain < 3).any())
    sunk = get_method("paged_eviction", (("sinks", 2),)).select(src, 0.25, backend=backend)  # type: ignore[arg-type]
    assert sunk[..., :2].tolist() == [[[0, 1], [0, 1]]] and sunk.shape[-1] == 10
    rest = get_method("paged_eviction").score(src, backend="torch")[..., 2:]
    for h in range(2):  # the other 8 are the best of the rest
        want = (rest[0, h].topk(8).indices + 2).sort().values.tolist()
        assert sunk[0, h, 2:].tolist() == want


def test_keydiff_keeps_the_outlier() -> None:
    k = torch.ones(1, 1, 6, 4)
    k[0, 0, 3] = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    src = KVSource.from_contiguous(k, k.clone())
    for backend in ("torch", "triton"):
        kept = get_method("keydiff").select(src, 1 / 6, backend=backend)  # type: ignore[arg-type]
        assert kept.flatten().tolist() == [3]


@pytest.mark.parametrize("name", registry.METHODS.names())
def test_window_methods_agree_with_each_method(name: str) -> None:
    """The torch-free table of window-query methods (kernels/window_methods.py) says of every
    registered method what its class says (``needs_queries``), and names one of its options."""
    from kvtierd.kernels.window_methods import window_option
    from kvtierd.variants import METHOD_OPTIONS

    cls = registry.METHODS.get(name)
    assert bool(window_option(name)) == cls.needs_queries
    if cls.needs_queries:
        assert window_option(name) in {o.name for o in METHOD_OPTIONS[name]}
