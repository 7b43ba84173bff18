# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# Triton kernels: upper-case constexpr names and long positional argument lists are the
# Triton idiom; their parameters cannot carry Python type annotations.
"""Triton window attention for ``snapkv`` (spec: ``snapkv.py``), read through the block table.

Per layer, two kernels (the paged attention score of Zipage App. C.2, with queries given):

1. ``_row_stats``: per query head, online softmax max ``m`` and sum ``l`` of each window
   query's logits over every key it sees in the prefill (window query ``i``: keys
   ``t <= N - W + i``, the causal mask);
2. ``_window_probs``: per (KV head, block of the ``N - W`` prefix keys, which every window
   query sees), ``exp(logit - m) / l`` summed over the window queries (/ W) and over the GQA
   group's query heads (/ G).

Logits are float32 (``input_precision="ieee"``: no TF32). Pooling then runs in torch on the
small ``[L, H, N - W]`` score tensor.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtierd.kernels._tl_common import block_d, check_device, token_offset
from kvtierd.kernels.layout import KVSource

BLOCK_N = 32


@triton.jit
def _logits(
    q_ptr, k_ptr, bt_ptr, qh, h, t, W, D, N_KEYS, block_size, scale,
    qs_h, qs_w, qs_d, ks_blk, ks_slot, ks_h, ks_d,
    BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    w = tl.arange(0, BLOCK_W)
    d = tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    qm = (w < W)[:, None] & (d < D)[None, :]
    q_off = qh * qs_h + w.to(tl.int64)[:, None] * qs_w + d64[None, :] * qs_d
    q = tl.load(q_ptr + q_off, mask=qm, other=0.0).to(tl.float32)
    tm = t < N_KEYS
    row = token_offset(bt_ptr, t, tm, block_size, ks_blk, ks_slot) + h * ks_h
    km = (d < D)[:, None] & tm[None, :]
    k = tl.load(k_ptr + row[None, :] + d64[:, None] * ks_d, mask=km, other=0.0).to(tl.float32)
    s = tl.dot(q, k, input_precision="ieee") * scale
    return tl.where(tm[None, :], s, float("-inf"))


@triton.jit
def _row_stats(
    q_ptr, k_ptr, bt_ptr, m_ptr, l_ptr, G, W, D, N_CTX, block_size, scale,
    qs_h, qs_w, qs_d, ks_blk, ks_slot, ks_h, ks_d,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    qh = tl.program_id(0).to(tl.int64)
    h = qh // G
    w = tl.arange(0, BLOCK_W)
    m_i = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_W], tl.float32)
    # every window query sees the first key, so no row is all -inf (padding rows w >= W too)
    for start in range(0, N_CTX + W, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        s = _logits(
            q_ptr, k_ptr, bt_ptr, qh, h, t, W, D, N_CTX + W, block_size, scale,
            qs_h, qs_w, qs_d, ks_blk, ks_slot, ks_h, ks_d, BLOCK_W, BLOCK_D,
        )  # fmt: skip
        s = tl.where(t[None, :] <= N_CTX + w[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(m_ptr + qh * W + w, m_i, mask=w < W)
    tl.store(l_ptr + qh * W + w, l_i, mask=w < W)


@triton.jit
def _window_probs(
    q_ptr, k_ptr, bt_ptr, m_ptr, l_ptr, out_ptr, G, W, D, N_CTX, block_size, scale,
    qs_h, qs_w, qs_d, ks_blk, ks_slot, ks_h, ks_d,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(G):
        qh = h * G + g
        s = _logits(
            q_ptr, k_ptr, bt_ptr, qh, h, t, W, D, N_CTX, block_size, scale,
            qs_h, qs_w, qs_d, ks_blk, ks_slot, ks_h, ks_d, BLOCK_W, BLOCK_D,
        )  # fmt: skip
        m_i = tl.load(m_ptr + qh * W + w, mask=w < W, other=0.0)
        l_i = tl.load(l_ptr + qh * W + w, mask=w < W, other=1.0)
        p = tl.exp(s - m_i[:, None]) / l_i[:, None]
        p = tl.where((w < W)[:, None], p, 0.0)
        acc += tl.sum(p, axis=0) / W
    tl.store(out_ptr + h * N_CTX + t, acc / G, mask=t < N_CTX)


def window_attention(source: KVSource, queries: torch.Tensor) -> torch.Tensor:
    """Mean window attention (softmax over all keys under the causal mask) on the prefix keys,
    averaged over each GQA group: float32 ``[L, H, N - W]`` (before pooling); ``W`` = the
    queries' third dimension. Requires ``N > W`` (checked by the caller)."""
    check_device(source.layer_keys[0], queries)
    lyr, h, n, d = source.num_layers, source.num_kv_heads, source.num_tokens, source.head_dim
    hq, w = int(queries.shape[1]), int(queries.shape[2])
    g, n_ctx = hq // h, n - w
    scale = 1.0 / math.sqrt(d)
    out = torch.empty((lyr, h, n_ctx), dtype=torch.float32, device=source.device)
    m = torch.empty((hq, w), dtype=torch.float32, device=source.device)
    lsum = torch.empty_like(m)
    blocks = {"BLOCK_W": max(16, int(triton.next_power_of_2(w))), "BLOCK_D": block_d(d)}
    for layer in range(lyr):
        k, q = source.layer_keys[layer], queries[layer]
        common = (g, w, d, n_ctx, source.block_size, scale, *q.stride(), *k.stride())
        _row_stats[(hq,)](q, k, source.block_table, m, lsum, *common, BLOCK_N=BLOCK_N, **blocks)
        _window_probs[(h, triton.cdiv(n_ctx, BLOCK_N))](
            q, k, source.block_table, m, lsum, out[layer], *common, BLOCK_N=BLOCK_N, **blocks
        )
    return out
