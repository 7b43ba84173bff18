"""Every bad input raises a ValueError that names the bad value."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import make_kv

from kvtierd.kernels.api import compress_dense, compress_kv
from kvtierd.kernels.base import gather_kv, select_kept
from kvtierd.kernels.knorm import KnormMethod
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.quant import quantize
from kvtierd.kernels.registry import METHODS, get_method
from kvtierd.kernels.rope import RopeSpec


def test_unknown_method_lists_known() -> None:
    with pytest.raises(ValueError, match="unknown compression method 'nope'; known: keydiff"):
        get_method("nope")


def test_a_registered_method_without_options_builds() -> None:
    class Half(KnormMethod):
        name = "half_knorm"  # not a built-in: no options, the plain count rule

    with METHODS.registered(Half):
        m = get_method("half_knorm")
        assert m.options == () and m.kept_count(10, 0.5) == 5
        with pytest.raises(ValueError, match="half_knorm has no option 'x'; its options: none"):
            get_method("half_knorm", (("x", 1),))
    with pytest.raises(ValueError, match="unknown compression method 'half_knorm'"):
        get_method("half_knorm")


def test_a_built_in_name_cannot_be_registered_again() -> None:
    with pytest.raises(ValueError, match="compression method 'knorm' is built in"):
        METHODS.register(KnormMethod)
    with pytest.raises(TypeError):
        METHODS.register(int)  # type: ignore[arg-type]


def test_snapkv_without_queries_says_so() -> None:
    k, v = make_kv(1, 1, 100, 16, torch.float16)
    with pytest.raises(ValueError, match="snapkv needs the queries"):
        compress_dense(k, v, "snapkv@0.5")
    with pytest.raises(ValueError, match="the snapkv window is 64 \\(needs the last 64\\)"):
        compress_dense(k, v, "snapkv@0.5", queries=torch.randn(1, 1, 8, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="Hq=G"):
        compress_dense(k, v, "snapkv@0.5", queries=torch.randn(1, 1, 64, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="snapkv: pool=2 is not allowed"):
        get_method("snapkv", (("pool", 2),))


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (
            lambda: KVSource.from_contiguous(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)),
            "[L, H, N, D]",
        ),
        (
            lambda: KVSource.from_contiguous(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 5, 2)),
            "differ",
        ),
        (
            lambda: KVSource.from_contiguous(*[torch.zeros(1, 1, 4, 2, dtype=torch.int8)] * 2),
            "dtype",
        ),
        (
            lambda: KVSource.from_contiguous(
                torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2).half()
            ),
            "differs",
        ),
        (lambda: KVSource.from_kv_2ltd(torch.zeros(3, 1, 4, 8), 2), "KV_2LTD"),
        (lambda: KVSource.from_kv_2ltd(torch.zeros(2, 1, 4, 9), 2), "num_kv_heads=2"),
        (
            lambda: KVSource.from_vllm_paged(
                [torch.zeros(2, 4, 8, 1, 2)], torch.tensor([0, 9], dtype=torch.int32), 10
            ),
            "block_table entries",
        ),
        (
            lambda: KVSource.from_vllm_paged(
                [torch.zeros(2, 4, 8, 1, 2)], torch.tensor([0], dtype=torch.int32), 10
            ),
            "need 2",
        ),
        (
            lambda: KVSource.from_vllm_paged(
                [torch.zeros(2, 4, 8, 1, 2)], torch.tensor([0, 1]), 10
            ),
            "int32",
        ),
        (
            lambda: KVSource.from_vllm_paged(
                [torch.zeros(4, 8, 1, 2)], torch.tensor([0], dtype=torch.int32), 4
            ),
            "flash layout",
        ),
        (
            lambda: KVSource.from_vllm_paged(
                [torch.zeros(4, 1, 8, 3)], torch.tensor([0], dtype=torch.int32), 4, kv_layout="cpu"
            ),
            "cpu layout",
        ),
    ],
)
def test_bad_sources(make: object, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        make()  # type: ignore[operator]
    assert fragment in str(e.value)


def test_bad_kept_scores_rope_quant() -> None:
    k, v = make_kv(1, 2, 10, 8, torch.float32)
    src = KVSource.from_contiguous(k, v)
    with pytest.raises(ValueError, match="int32"):
        gather_kv(src, torch.zeros(1, 2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, N=10\)"):
        gather_kv(src, torch.full((1, 2, 3), 10, dtype=torch.int32), backend="triton")
    with pytest.raises(ValueError, match="rope head_dim"):
        gather_kv(src, torch.zeros(1, 2, 1, dtype=torch.int32), rope=RopeSpec.standard(16))
    with pytest.raises(ValueError, match="NaN"):
        select_kept(torch.tensor([[[0.0, float("nan")]]]), 1, backend="triton")
    with pytest.raises(ValueError, match="num_kept=3"):
        select_kept(torch.zeros(1, 1, 2), 3)
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeSpec.standard(8, rotary_dim=12)
    with pytest.raises(ValueError, match="even"):
        quantize(torch.zeros(1, 1, 4, 7), 4)
    with pytest.raises(ValueError, match="power of two"):
        quantize(torch.zeros(1, 1, 4, 8), 8, group_size=12)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(1, 1, 4, 8), 2)
    with pytest.raises(ValueError, match="backend"):
        compress_dense(k, v, "knorm@0.5", backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="KVSource"):
        compress_kv(k, "none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad variant"):
        compress_dense(k, v, "knorm@2")
