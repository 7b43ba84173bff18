"""The RoPE-applied queries of a context's last ``W`` tokens, captured during its prefill.

``snapkv`` scores keys by the attention of the context's last window of queries (Li et al. 2024;
kvpress ``SnapKVPress`` takes them the same way, from the prefill). A stored KV cache keeps no
queries, so they are captured while the model prefills the context: every Hugging Face model
that dispatches attention through transformers' ``AttentionInterface`` hands the attention
function its queries after RoPE, so a function registered there sees exactly what the model
attends with, for any architecture using the interface, without re-implementing its projection,
normalisation or rotary embedding. It records the window and then runs the model's usual
attention (``sdpa``).

Where the prefill is over — vLLM's paged cache and the daemon keep keys and values, never
queries — :func:`window_queries_after_prefix` recomputes them from the model's weights: the
stored KV of the first ``N - W`` tokens as ``past_key_values`` and the last ``W`` token ids as
input give each layer the same hidden states, hence the same queries, as the full prefill
(equal up to the rounding of a different matmul shape).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtierd.errors import InvalidArgumentError

CAPTURE = "kvtierd_window_capture"


@dataclass(frozen=True, slots=True, eq=False)
class _Recording:
    """A capture under way: ``store`` maps a layer index to its ``[Hq, W, D]`` queries; with
    ``last``, the pass stops once that layer's queries are kept (:class:`_PassDoneError`)."""

    window: int
    store: dict[int, torch.Tensor]
    last: int | None = None


class _PassDoneError(Exception):
    """Raised out of the model's forward once the last wanted layer is captured: the layers
    after it would cost their whole compute for nothing read."""


_recording: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar(
    "kvtierd_window_queries", default=None
)


def _capture_attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec = _recording.get()
    if rec is not None:
        layer = int(module.layer_idx)
        rec.store[layer] = query[0, :, -rec.window :].detach().clone()
        if layer == rec.last:  # its keys and values are in the cache already
            raise _PassDoneError
    return sdpa_attention_forward(module, query, *args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if CAPTURE not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAPTURE, _capture_attention)
    if CAPTURE not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # sdpa's masks too: an attention name with no mask function gets no mask, and sdpa then
        # falls back to is_causal, whose diagonal is top-left: queries after a cache would
        # see only the first keys of it
        ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE, sdpa_mask)


@contextlib.contextmanager
def _capturing(
    model: Any, window: int, last: int | None = None
) -> Iterator[dict[int, torch.Tensor]]:
    _register()
    config = model.config
    before = config._attn_implementation
    store: dict[int, torch.Tensor] = {}
    token = _recording.set(_Recording(window, store, last))
    config._attn_implementation = CAPTURE
    try:
        yield store
    finally:
        config._attn_implementation = before
        _recording.reset(token)


@torch.inference_mode()
def prefill_with_window_queries(
    model: Any, input_ids: torch.Tensor, window: int
) -> tuple[Any, torch.Tensor]:
    """Prefill ``input_ids`` (``[1, N]``) and return ``(past_key_values, queries)``; queries are
    ``[L, Hq, W, D]`` for the last ``W = min(window, N)`` tokens, RoPE applied, in the model's
    dtype."""
    if window < 1:
        raise InvalidArgumentError(f"window must be >= 1, got {window}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InvalidArgumentError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    with _capturing(model, window) as store:
        out = model(input_ids=input_ids, use_cache=True)
    layers = model.config.get_text_config().num_hidden_layers
    if sorted(store) != list(range(layers)):
        raise InvalidArgumentError(
            f"captured queries of layers {sorted(store)}, expected 0..{layers - 1}: the model "
            "does not dispatch attention through transformers' AttentionInterface"
        )
    return out.past_key_values, torch.stack([store[i] for i in range(layers)])


@torch.inference_mode()
def window_queries_after_prefix(
    model: Any, keys: torch.Tensor, values: torch.Tensor, window_ids: torch.Tensor
) -> torch.Tensor:
    """The RoPE-applied queries ``[L, Hq, W, D]`` of the ``W`` tokens ``window_ids`` (``[1, W]``)
    that follow a prefix whose stored KV is ``keys``/``values`` ``[L, H, P, D]`` (RoPE applied,
    as the model cached them; ``P`` may be 0): the window runs through the model at positions
    ``P .. P + W - 1`` with the prefix as its cache (module docstring)."""
    return pass_after_prefix(model, keys, values, window_ids).queries


@dataclass(frozen=True, slots=True, eq=False)
class WindowPass:
    """What one pass of ``W`` tokens after a stored prefix saw, per layer: their RoPE-applied
    queries ``[L, Hq, W, D]`` and their own keys/values ``[L, H, W, D]`` (keys RoPE-applied)."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


@torch.inference_mode()
def pass_after_prefix(
    model: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    window_ids: torch.Tensor,
    *,
    lm_head: bool = False,
    layers: Sequence[int] | None = None,
) -> WindowPass:
    """:func:`window_queries_after_prefix`, also returning the window's own keys and values
    (an estimator attends with the window's queries over the prefix *and* the window).
    ``layers``: only these layers' (ascending, distinct), stacked in that order; the pass stops
    after the last of them (the layers after it are never run, nor given the prefix's KV).
    ``lm_head``: also compute the logits nobody reads (the cost before issue 26's speed-up, for
    the benchmark's comparison)."""
    from transformers import DynamicCache

    if window_ids.dim() != 2 or window_ids.shape[0] != 1 or window_ids.shape[1] < 1:
        raise InvalidArgumentError(f"window_ids must be [1, W >= 1], got {tuple(window_ids.shape)}")
    count = model.config.get_text_config().num_hidden_layers
    if keys.dim() != 4 or keys.shape != values.shape or keys.shape[0] != count:
        raise InvalidArgumentError(
            f"prefix keys and values must be equal [L={count}, H, P, D], got "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    wanted = list(range(count)) if layers is None else [int(i) for i in layers]
    if not wanted or wanted != sorted(set(wanted)) or not 0 <= wanted[0] <= wanted[-1] < count:
        raise InvalidArgumentError(
            f"layers must be distinct ascending indices in [0, {count}), got {wanted}"
        )
    last = wanted[-1] if not lm_head and wanted[-1] < count - 1 else None
    cache = DynamicCache(config=model.config)
    weight = next(model.parameters())
    if keys.shape[2] > 0:
        for i in range(wanted[-1] + 1):
            k, v = (x[i][None].to(weight.device, weight.dtype) for x in (keys, values))
            cache.update(k, v, i)
    window = int(window_ids.shape[1])
    # the decoder alone: the LM head's logits are never read (a fifth of a 135M model's weights)
    decoder = model if lm_head or not hasattr(model, "get_decoder") else model.get_decoder()
    with _capturing(model, window, last) as store, contextlib.suppress(_PassDoneError):
        decoder(input_ids=window_ids.to(weight.device), past_key_values=cache, use_cache=True)
    if sorted(store) != list(range(wanted[-1] + 1)):
        raise InvalidArgumentError(
            f"captured queries of layers {sorted(store)}, expected 0..{wanted[-1]}: the model "
            "does not dispatch attention through transformers' AttentionInterface"
        )
    stored: Any = cache.layers  # full-attention layers: each holds its keys and values
    own_k = torch.stack([stored[i].keys[0, :, -window:] for i in wanted])
    own_v = torch.stack([stored[i].values[0, :, -window:] for i in wanted])
    return WindowPass(torch.stack([store[i] for i in wanted]), own_k, own_v)


_load_lock = threading.Lock()
_run_lock = threading.Lock()


@functools.cache
def _cached_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    from kvtierd.profiler.checkpoint import load_causal_lm

    model: Any = load_causal_lm(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def window_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The model in ``model_dir`` (a local Hugging Face checkpoint: the one vLLM serves), loaded
    once per process, dtype and device; its weights recompute window queries."""
    with _load_lock:
        return _cached_model(model_dir, dtype, device)


def queries_for_context(
    model_dir: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_ids: Sequence[int],
    window: int,
) -> torch.Tensor:
    """The window queries ``[L, Hq, W, D]`` of a context whose stored KV is ``keys``/``values``
    ``[L, H, N, D]`` (RoPE applied) and whose last ``W = min(window, N)`` token ids are the last
    of ``token_ids``: the model in ``model_dir`` runs them after the stored KV of the first
    ``N - W`` tokens (:func:`window_queries_after_prefix`), in the KV's dtype and device."""
    if keys.dim() != 4 or keys.shape != values.shape:
        raise InvalidArgumentError(
            f"keys and values must be equal [L, H, N, D], got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    n = int(keys.shape[2])
    w = min(window, n)
    if w < 1 or len(token_ids) < w:
        raise InvalidArgumentError(f"{len(token_ids)} token ids for a window of {w} tokens")
    model = window_model(model_dir, keys.dtype, keys.device)
    _check_geometry(model, model_dir, keys)
    ids = torch.tensor([list(token_ids[len(token_ids) - w :])], dtype=torch.long)
    # One pass at a time: a capture switches the shared model's attention function, and a
    # second thread's pass ending first would switch it back under the first (the daemon
    # profiles on one thread and builds variants on another)
    with _run_lock:
        return window_queries_after_prefix(model, keys[:, :, : n - w], values[:, :, : n - w], ids)


def pass_for_context(
    model_dir: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_ids: Sequence[int],
    *,
    lm_head: bool = False,
    layers: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> WindowPass:
    """The tokens ``token_ids`` (a question) run through the model in ``model_dir`` after a
    context whose stored KV is ``keys``/``values`` ``[L, H, N, D]`` (RoPE applied), at positions
    ``N ..``: their queries and own keys/values (:func:`pass_after_prefix`, of ``layers`` only
    when given), in ``dtype`` (default: the KV's) on the KV's device."""
    if keys.dim() != 4 or keys.shape != values.shape:
        raise InvalidArgumentError(
            f"keys and values must be equal [L, H, N, D], got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    if not token_ids:
        raise InvalidArgumentError("a pass after the context needs at least one token id")
    model = window_model(model_dir, dtype or keys.dtype, keys.device)
    _check_geometry(model, model_dir, keys)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with _run_lock:  # as queries_for_context: one capture at a time on the shared model
        return pass_after_prefix(model, keys, values, ids, lm_head=lm_head, layers=layers)


def _check_geometry(model: Any, model_dir: str, keys: torch.Tensor) -> None:
    """The KV must come from this model: a checkpoint of another geometry would fail deep in
    its attention, or give queries of another model."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    have = (int(keys.shape[0]), int(keys.shape[1]), int(keys.shape[3]))
    if want != have:
        raise InvalidArgumentError(
            f"the KV has (layers, kv heads, head dim) {have}, the model in {model_dir!r} "
            f"{want}: window queries must come from the model that computed the KV"
        )


def queries_for_kv_2ltd(
    model_dir: str, kv: torch.Tensor, num_kv_heads: int, token_ids: Sequence[int], window: int
) -> torch.Tensor:
    """:func:`queries_for_context` of a context stored as LMCache's ``KV_2LTD``
    ``[2, L, N, H*D]`` (what a KV connector sees)."""
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[3] % num_kv_heads:
        raise InvalidArgumentError(
            f"kv must be KV_2LTD [2, L, N, H*D] with H={num_kv_heads}, got {tuple(kv.shape)}"
        )
    _, layers, n, width = (int(s) for s in kv.shape)
    split = kv.reshape(2, layers, n, num_kv_heads, width // num_kv_heads).permute(0, 1, 3, 2, 4)
    keys, values = split.unbind(0)
    return queries_for_context(model_dir, keys, values, token_ids, window)
