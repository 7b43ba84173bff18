"""Our methods against kvpress 0.5.5's own outputs (``data/kvpress_reference.npz``).

The vectors come from running real kvpress on a tiny random Llama (``data/
make_kvpress_reference.py`` says how); kvpress itself is not needed here. Scores must agree
within float32 rounding, kept sets exactly where kvpress's are unique (no tie at the cut);
where kvpress's pick is a tie (fewer kept than snapkv's window or streamingllm's sinks) the
count must agree and the positions lie in the tied set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.registry import get_method
from kvtierd.kernels.snapkv import SnapKVMethod
from kvtierd.kernels.streamingllm import StreamingLLMMethod

DATA = np.load(Path(__file__).parent / "data" / "kvpress_reference.npz")
CASES = sorted({k.split("/")[0] for k in DATA.files if "/" in k})
BACKENDS = ("torch", "triton")
RTOL = 2e-6  # float32 rounding of a softmax, a mean and a pool in another order
ULPS = 4  # ... and of a sum near zero (keydiff's cosines): a few float32 ulps of the largest score


def _case(name: str) -> tuple[KVSource, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    keys = torch.from_numpy(DATA[f"{name}/keys"])
    queries = torch.from_numpy(DATA[f"{name}/queries"]) if f"{name}/queries" in DATA else None
    scores = torch.from_numpy(DATA[f"{name}/scores"])
    kept = torch.from_numpy(DATA[f"{name}/kept"]).to(torch.int32)
    # none of these methods reads values; KVSource needs some
    return KVSource.from_contiguous(keys, torch.zeros_like(keys)), queries, scores, kept


def _method(name: str) -> TokenDropMethod:
    _, _, window, kernel, sinks = (int(x) for x in DATA[f"{name}/params"])
    if name.startswith("snapkv"):
        return SnapKVMethod(window=window, pool=kernel)
    if name.startswith("streamingllm"):
        return StreamingLLMMethod(sinks=sinks)
    return get_method(name.split("_", maxsplit=1)[0])


def _unique_at_cut(scores: torch.Tensor, m: int) -> torch.Tensor:
    """Per (layer, head): is kvpress's kept set determined (no tie at the m-th score)?"""
    top = torch.sort(scores, dim=-1, descending=True).values
    gap = top[..., m - 1] - top[..., m]
    return gap > 1e-5 * top[..., m - 1].abs().clamp_min(1e-6)


def test_reference_file_is_kvpress_055() -> None:
    assert "kvpress==0.5.5" in DATA["versions"].tolist()
    assert len(CASES) >= 10


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_scores_match_kvpress(name: str, backend: str) -> None:
    src, queries, want, _ = _case(name)
    n, _, window, _, _ = (int(x) for x in DATA[f"{name}/params"])
    got = _method(name).score(src, queries, backend=backend)  # type: ignore[arg-type]
    if name.startswith("streamingllm"):
        # kvpress scores by 1/0 masks, we by position: compare what they rank (the sets, below)
        return
    prefix = n - window  # snapkv: kvpress pads the window with max + 1, we rank it above
    atol = ULPS * torch.finfo(torch.float32).eps * float(want[..., :prefix].abs().max())
    torch.testing.assert_close(got[..., :prefix], want[..., :prefix], rtol=RTOL, atol=atol)
    if window:
        assert bool((got[..., prefix:] > got[..., :prefix].amax(dim=-1, keepdim=True)).all())
        layer_max = want[..., :prefix].amax(dim=(1, 2))  # kvpress: max over the layer's heads
        assert torch.equal(want[..., prefix:], (layer_max + 1)[:, None, None].expand_as(
            want[..., prefix:]))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_kept_sets_match_kvpress(name: str, backend: str) -> None:
    src, queries, scores, want = _case(name)
    n, m, window, _, sinks = (int(x) for x in DATA[f"{name}/params"])
    method = _method(name)
    # kvpress keeps int(N * (1 - compression_ratio)) = m; our count of ratio m / N is m
    got = method.select(src, m / n, queries=queries, backend=backend)  # type: ignore[arg-type]
    assert got.shape == want.shape
    unique = _unique_at_cut(scores, m)
    assert torch.equal(got[unique], want[unique])
    tied = ~unique
    if bool(tied.any()):
        # the tie is among always-kept tokens: snapkv's window, streamingllm's sinks
        first = n - window if window else 0
        last = n if window else sinks
        for row in torch.cat([got[tied], want[tied]]).tolist():
            assert all(first <= p < last for p in row), (name, row)
    if m < window:  # below the window: the most recent window tokens
        assert got.unique().tolist() == list(range(n - m, n))
    if m < sinks:  # below the sinks: the first ones
        assert got.unique().tolist() == list(range(m))


def test_every_snapkv_case_has_unique_kept_sets_above_the_window() -> None:
    for name in CASES:
        _, m, window, _, _ = (int(x) for x in DATA[f"{name}/params"])
        if name.startswith("snapkv") and m >= window:
            assert bool(_unique_at_cut(torch.from_numpy(DATA[f"{name}/scores"]), m).all()), name
