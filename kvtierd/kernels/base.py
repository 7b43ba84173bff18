"""The shared half of every token-dropping method: kept count, top-k, kept indices, gather.

A method only says how to score tokens (``score_reference`` in torch — the spec — and
``score_triton``); :class:`TokenDropMethod` owns the rest, once (kvpress's ``ScorerPress`` idea).

Selection rule (identical in both backends): keep the ``M`` highest scores of each (layer, KV
head); among equal scores the earlier position wins; kept positions are returned ascending.
A score of ``+inf`` marks a token that is kept before any finite score (the ``sinks`` of
streamingllm and paged_eviction, paged_eviction_block's partial last page or its end pages); when
fewer tokens are kept than score ``+inf``, the earliest of them are kept. NaN scores are an
error, never silently ranked.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.layout import KVSource
from kvtierd.kernels.results import CompressedKV
from kvtierd.kernels.rope import RopeSpec, rotate_keys
from kvtierd.sizes import kept_token_count
from kvtierd.variants import CountRule, Options, Variant, canonical_options, count_rule

Backend = Literal["auto", "torch", "triton"]
ResolvedBackend = Literal["torch", "triton"]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: Backend, device: torch.device) -> ResolvedBackend:
    """``auto``: Triton on CUDA when installed, torch otherwise (and on CPU, where Triton only
    runs under ``TRITON_INTERPRET=1`` — that is for tests, chosen explicitly)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in ("torch", "triton"):
        raise InvalidArgumentError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton" and not triton_available():
        raise InvalidArgumentError("backend='triton' but triton is not installed")
    return backend


def check_scores(scores: torch.Tensor, num_kept: int) -> None:
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise InvalidArgumentError(
            f"scores must be float32 [L, H, N], got {tuple(scores.shape)} {scores.dtype}"
        )
    if not 1 <= num_kept <= scores.shape[-1]:
        raise InvalidArgumentError(f"num_kept={num_kept} outside [1, N={scores.shape[-1]}]")
    if bool(torch.isnan(scores).any()):
        raise InvalidArgumentError("scores contain NaN (NaN or inf in the keys/values/queries?)")


def select_reference(scores: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Kept positions, int32 ``[L, H, M]`` ascending (module docstring's rule)."""
    check_scores(scores, num_kept)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :num_kept]
    return order.sort(dim=-1).values.to(torch.int32)


def select_kept(scores: torch.Tensor, num_kept: int, backend: Backend = "auto") -> torch.Tensor:
    if resolve_backend(backend, scores.device) == "torch":
        return select_reference(scores, num_kept)
    from kvtierd.kernels import _tl_select

    check_scores(scores, num_kept)
    return _tl_select.select_kept(scores, num_kept)


def gather_reference(
    source: KVSource, kept: torch.Tensor, rope: RopeSpec | None = None, delta: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[L, H, M, D]`` keys (rotated by ``delta`` when ``rope`` is given) and values."""
    check_kept(source, kept)
    keys, values = source.to_dense()
    idx = kept.to(torch.int64).unsqueeze(-1).expand(-1, -1, -1, source.head_dim)
    k, v = keys.gather(2, idx), values.gather(2, idx)
    if rope is not None and delta != 0:
        k = rotate_keys(k, rope, delta)
    return k, v


def gather_kv(
    source: KVSource,
    kept: torch.Tensor,
    *,
    rope: RopeSpec | None = None,
    delta: int = 0,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact the kept tokens into dense ``[L, H, M, D]`` keys and values, rotating keys by
    ``delta`` positions on the way when ``rope`` is given (one pass over the kept bytes)."""
    if rope is not None and rope.head_dim != source.head_dim:
        raise InvalidArgumentError(
            f"rope head_dim {rope.head_dim} != KV head_dim {source.head_dim}"
        )
    if resolve_backend(backend, source.device) == "torch":
        return gather_reference(source, kept, rope, delta)
    from kvtierd.kernels import _tl_gather

    check_kept_shape(source, kept)
    out = _tl_gather.gather(source, kept, rope, delta)  # skips positions out of range
    # checked after the launch: its wait for the device then overlaps the kernel, where before
    # the launch the device idled through it (two syncs, min and max; with the rest of the host
    # work the call took 810 us by events at 8k tokens on an H200, its kernel 264 us)
    check_kept_range(source, kept)
    return out


def check_kept(source: KVSource, kept: torch.Tensor) -> None:
    check_kept_shape(source, kept)
    check_kept_range(source, kept)


def check_kept_shape(source: KVSource, kept: torch.Tensor) -> None:
    lyr, h = source.num_layers, source.num_kv_heads
    if kept.dim() != 3 or kept.shape[:2] != (lyr, h) or kept.dtype != torch.int32:
        raise InvalidArgumentError(
            f"kept must be int32 [L={lyr}, H={h}, M], got {tuple(kept.shape)} {kept.dtype}"
        )
    if kept.device != source.device:
        raise InvalidArgumentError(f"kept is on {kept.device}, KV on {source.device}")


def check_kept_range(source: KVSource, kept: torch.Tensor) -> None:
    """Every kept position in ``[0, N)``: one reduction and one wait for the device."""
    if not kept.numel():
        return
    lo, hi = torch.stack(torch.aminmax(kept)).tolist()
    if lo < 0 or hi >= source.num_tokens:
        raise InvalidArgumentError(f"kept positions must be in [0, N={source.num_tokens})")


class TokenDropMethod(ABC):
    """A context-level token-dropping method. Subclasses set ``name`` and implement scoring.

    A method with options (``variants.METHOD_OPTIONS[name]``) takes them as keyword arguments
    of the same names and returns their values from :meth:`option_values`.

    Scores: float32 ``[L, H, N]``, higher = more important, ``+inf`` = kept first.
    """

    name: ClassVar[str]
    needs_queries: ClassVar[bool] = False

    def option_values(self) -> dict[str, int]:
        """This instance's option values (every option of the method, defaults included)."""
        return {}

    @property
    def options(self) -> Options:
        """The options as a variant name writes them (canonical: defaults left out)."""
        return canonical_options(self.name, self.option_values())

    def count_rule(self) -> CountRule:
        return count_rule(self.name, self.options)

    def kept_count(self, num_tokens: int, ratio: float, chunk_tokens: int = 1) -> int:
        return kept_token_count(
            num_tokens, ratio, chunk_tokens=chunk_tokens, rule=self.count_rule()
        )

    def check_queries(self, source: KVSource, queries: torch.Tensor | None) -> None:  # noqa: B027
        """Methods without queries ignore them; snapkv overrides to require them."""

    @abstractmethod
    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        """Torch spec: ``keys``/``values`` dense ``[L, H, N, D]`` -> float32 ``[L, H, N]``."""

    @abstractmethod
    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        """Triton scores straight from ``source`` (any layout) -> float32 ``[L, H, N]``."""

    def score(
        self, source: KVSource, queries: torch.Tensor | None = None, backend: Backend = "auto"
    ) -> torch.Tensor:
        self.check_queries(source, queries)
        if resolve_backend(backend, source.device) == "torch":
            keys, values = source.to_dense()
            return self.score_reference(keys, values, queries)
        return self.score_triton(source, queries)

    def select(
        self,
        source: KVSource,
        ratio: float,
        *,
        queries: torch.Tensor | None = None,
        chunk_tokens: int = 1,
        backend: Backend = "auto",
    ) -> torch.Tensor:
        """Kept positions, int32 ``[L, H, M]`` ascending; ``M = N`` returns ``arange(N)``."""
        self.check_queries(source, queries)
        m = self.kept_count(source.num_tokens, ratio, chunk_tokens)
        if m == source.num_tokens:
            full = torch.arange(m, dtype=torch.int32, device=source.device)
            return full.expand(source.num_layers, source.num_kv_heads, m).contiguous()
        return select_kept(self.score(source, queries, backend), m, backend)

    def compress(
        self,
        source: KVSource,
        ratio: float,
        *,
        queries: torch.Tensor | None = None,
        chunk_tokens: int = 1,
        rope: RopeSpec | None = None,
        backend: Backend = "auto",
    ) -> CompressedKV:
        """Score, select and gather; keys rotated by ``M - N`` when ``rope`` is given."""
        kept = self.select(
            source, ratio, queries=queries, chunk_tokens=chunk_tokens, backend=backend
        )
        delta = int(kept.shape[-1]) - source.num_tokens if rope is not None else 0
        keys, values = gather_kv(source, kept, rope=rope, delta=delta, backend=backend)
        return CompressedKV(
            keys=keys,
            values=values,
            kept=kept,
            num_tokens=source.num_tokens,
            variant=str(Variant(method=self.name, ratio=ratio, options=self.options)),
            rope_delta=delta,
        )
