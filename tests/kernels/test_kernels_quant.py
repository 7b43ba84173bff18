"""int8 / int4: Triton codes bit-equal to the reference, round-trip error bounds, composition."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DTYPES, TOL, make_kv

from kvtierd.kernels.api import compress_dense, dense_kv
from kvtierd.kernels.quant import dequantize, quantize, unpack_codes
from kvtierd.kernels.results import QuantizedTensor


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(2, 3, 77, 24), (1, 2, 5, 64), (1, 1, 33, 30)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_quant_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int, int, int], bits: int, axis: str
) -> None:
    x, _ = make_kv(*shape, dtype=dtype)
    ref = quantize(x, bits, 16, axis, backend="torch")  # type: ignore[arg-type]
    tri = quantize(x, bits, 16, axis, backend="triton")  # type: ignore[arg-type]
    assert torch.equal(tri.codes, ref.codes)
    assert torch.equal(tri.scale, ref.scale) and torch.equal(tri.zero, ref.zero)
    d_ref, d_tri = dequantize(ref, "torch"), dequantize(tri, "triton")
    torch.testing.assert_close(d_tri, d_ref, **TOL[dtype])
    _check_error_bound(x, ref, d_ref)


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("shape", "group"),
    [
        ((1, 2, 9, 24), 2),
        ((1, 2, 70, 128), 32),
        ((1, 1, 40, 24), 64),
        ((2, 1, 33, 48), 128),
        ((1, 1, 40, 160), 32),  # keys: two channel blocks (KEY_CHANNELS)
    ],
    ids=str,
)
def test_triton_quant_group_sizes(
    shape: tuple[int, int, int, int], group: int, bits: int, axis: str
) -> None:
    """Groups smaller than, equal to and larger than the padded head dim (the values kernel
    views a row as ``[BLOCK_D / GB, GB]``), partial groups, the real head_dim and G = 32."""
    x, _ = make_kv(*shape, dtype=torch.bfloat16)
    x = x.transpose(0, 1).contiguous().transpose(0, 1)  # strides other than contiguous
    ref = quantize(x, bits, group, axis, backend="torch")  # type: ignore[arg-type]
    tri = quantize(x, bits, group, axis, backend="triton")  # type: ignore[arg-type]
    assert torch.equal(tri.codes, ref.codes)
    assert torch.equal(tri.scale, ref.scale) and torch.equal(tri.zero, ref.zero)
    d_ref, d_tri = dequantize(ref, "torch"), dequantize(tri, "triton")
    torch.testing.assert_close(d_tri, d_ref, **TOL[torch.bfloat16])


def _check_error_bound(x: torch.Tensor, q: QuantizedTensor, deq: torch.Tensor) -> None:
    """|x - x'| <= scale/2 + fp16 rounding of zero and scale + output dtype rounding."""
    g, n, d = q.group_size, x.shape[2], x.shape[3]
    if q.axis == "channel":
        s = q.scale.float().repeat_interleave(g, dim=2)[:, :, :n]
        z = q.zero.float().repeat_interleave(g, dim=2)[:, :, :n]
    else:
        s = q.scale.float().repeat_interleave(g, dim=3)[..., :d]
        z = q.zero.float().repeat_interleave(g, dim=3)[..., :d]
    qmax = 2**q.bits - 1
    xf = x.float()
    bound = 0.5 * s + 2**-10 * (z.abs() + qmax * s) + 1e-6
    eps = torch.finfo(x.dtype).eps
    err = (deq.float() - xf).abs()
    assert bool((err <= bound + eps * xf.abs()).all()), float((err - bound).max())
    assert bool((unpack_codes(q) <= qmax).all())


def test_constant_group_is_exact() -> None:
    x = torch.full((1, 1, 32, 16), 0.75)
    for axis in ("channel", "token"):
        q = quantize(x, 4, 16, axis, backend="triton")  # type: ignore[arg-type]
        assert torch.equal(dequantize(q, "triton"), x)


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_codes_at_extreme_scales(bits: int, axis: str) -> None:
    """The kernel divides by a group's scale as ``a * (1/scale)`` plus one fma correction
    (``_tl_quant._codes``), not ``div.rn``: its codes stay bit-equal to the reference's
    division where that is most fragile: scales that overflow fp16 to inf (quotient 0, the
    correction's remainder NaN), fp16-subnormal scales (tiny ranges), constant groups
    (scale 0) and a wide spread of magnitudes, with quotients landing on ``k + 0.5``."""
    gen = torch.Generator().manual_seed(7)
    n, d, g = 64, 32, 16
    x = torch.randn(4, 1, n, d, generator=gen) * torch.logspace(-6, 4, d)
    x[0] = torch.rand(n, d, generator=gen) * 1e8  # range / qmax > 65504: fp16 inf scale
    x[1] = 0.5 + torch.randint(0, 3, (n, d), generator=gen) * 1e-6  # fp16-subnormal scales
    x[2, :, :16] = 3.0  # constant channel groups
    x[2, 0, 16:] = 3.0  # ... and constant token groups
    x[3] = torch.randint(0, 31, (n, d), generator=gen) / 2.0  # quotients on k + 0.5
    x = x.to(torch.bfloat16)
    ref = quantize(x, bits, g, axis, backend="torch")  # type: ignore[arg-type]
    tri = quantize(x, bits, g, axis, backend="triton")  # type: ignore[arg-type]
    assert bool(torch.isinf(ref.scale.float()).any())  # the case is really there
    assert torch.equal(tri.codes, ref.codes)
    assert torch.equal(tri.scale, ref.scale) and torch.equal(tri.zero, ref.zero)


@pytest.mark.parametrize("variant", ["int8", "int4", "knorm@0.5+int8", "snapkv@0.3+int4"])
def test_composed_variants(variant: str) -> None:
    k, v = make_kv(2, 2, 96, 32, torch.bfloat16)
    q = torch.randn(2, 4, 64, 32, dtype=torch.bfloat16)
    ref = compress_dense(k, v, variant, queries=q, backend="torch")
    tri = compress_dense(k, v, variant, queries=q, backend="triton")
    assert isinstance(ref.keys, QuantizedTensor) and isinstance(tri.keys, QuantizedTensor)
    assert ref.keys.axis == "channel" and isinstance(ref.values, QuantizedTensor)
    assert ref.values.axis == "token"
    assert torch.equal(tri.kept, ref.kept)
    assert torch.equal(tri.keys.codes, ref.keys.codes)
    dk, dv = dense_kv(ref, "torch")
    assert dk.shape == (2, 2, ref.num_kept, 32) and dk.dtype == torch.bfloat16
    idx = ref.kept.long().unsqueeze(-1).expand(-1, -1, -1, 32)
    assert (dv.float() - v.gather(2, idx).float()).abs().max() < (
        0.3 if "int4" in variant else 0.03
    )
