"""The same comparisons on real CUDA (compiled Triton, not the interpreter); skipped without CUDA.

Run compiled: ``TRITON_INTERPRET=0 .venv/bin/pytest -m gpu tests/kernels`` (conftest only
defaults the variable to 1, which would interpret these too).

On a GPU, Triton may contract multiply-adds into FMAs and rounds bf16 to nearest, so float
outputs are compared with the tolerance table; kept sets and copies stay exact.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DTYPES, SCORE_TOL, TOL, assert_same_kept, make_kv

from kvtierd.kernels.api import compress_dense, dense_kv
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.registry import METHODS, get_method
from kvtierd.kernels.rope import RopeSpec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", METHODS.names())
def test_cuda_methods_match_reference(name: str, dtype: torch.dtype) -> None:
    k, v = make_kv(2, 8, 1000, 128, dtype)
    k, v = k.cuda(), v.cuda()
    q = torch.randn(2, 32, 64, 128, device="cuda").to(dtype)
    src = KVSource.from_contiguous(k, v)
    m = get_method(name)
    ref = m.score(src, q, backend="torch")
    torch.testing.assert_close(m.score(src, q, backend="triton"), ref, **SCORE_TOL)
    assert_same_kept(
        m.select(src, 0.3, queries=q, backend="triton"),
        m.select(src, 0.3, queries=q, backend="torch"),
        ref,
    )


@pytest.mark.parametrize("variant", ["knorm@0.5", "int8", "keydiff@0.25+int4"])
def test_cuda_compress_matches_reference(variant: str) -> None:
    k, v = make_kv(2, 8, 777, 128, torch.bfloat16)
    k, v = k.cuda(), v.cuda()
    rope = RopeSpec.standard(128, theta=500000.0)
    a = compress_dense(k, v, variant, rope=rope, backend="torch")
    b = compress_dense(k, v, variant, rope=rope, backend="triton")
    assert torch.equal(a.kept, b.kept)
    for x, y in zip(dense_kv(a, "torch"), dense_kv(b, "triton"), strict=True):
        torch.testing.assert_close(y, x, atol=0.05, rtol=TOL[torch.bfloat16]["rtol"])
