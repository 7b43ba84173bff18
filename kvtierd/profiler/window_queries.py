"""The RoPE-applied queries of a context's last ``W`` tokens, captured during its prefill.

``snapkv`` scores keys by the attention of the context's last window of queries (Li et al. 2024;
kvpress ``SnapKVPress`` takes them the same way, from the prefill). A stored KV cache keeps no
queries, so they are captured while the model prefills the context: every Hugging Face model
that dispatches attention through transformers' ``AttentionInterface`` hands the attention
function its queries after RoPE, so a function registered there sees exactly what the model
attends with, for any architecture using the interface, without re-implementing its projection,
normalisation or rotary embedding. It records the window and then runs the model's usual
attention (``sdpa``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from kvtierd.errors import InvalidArgumentError

CAPTURE = "kvtierd_window_capture"
# layer index -> [Hq, W, D] queries of the prefill under way (one dict per capture)
_recording: contextvars.ContextVar[tuple[int, dict[int, torch.Tensor]] | None] = (
    contextvars.ContextVar("kvtierd_window_queries", default=None)
)


def _capture_attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec = _recording.get()
    if rec is not None:
        window, store = rec
        store[int(module.layer_idx)] = query[0, :, -window:].detach().clone()
    return sdpa_attention_forward(module, query, *args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    if CAPTURE not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAPTURE, _capture_attention)


@contextlib.contextmanager
def _capturing(model: Any, window: int) -> Iterator[dict[int, torch.Tensor]]:
    _register()
    config = model.config
    before = config._attn_implementation
    store: dict[int, torch.Tensor] = {}
    token = _recording.set((window, store))
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
