"""Write ``kvpress_reference.npz``: kvpress 0.5.5's own scores and kept sets on a tiny model.

kvpress is not a dependency of kvtierd; this script runs it in a separate environment and
records what its presses compute, so ``test_kernels_kvpress.py`` can hold our kernels to it
without kvpress installed. Reproduce (transformers 5.19 is outside kvpress 0.5.5's range)::

    python3 -m venv /tmp/kvpvenv
    /tmp/kvpvenv/bin/pip install torch==2.13.0 "transformers>=5.0,<5.3" kvpress==0.5.5
    /tmp/kvpvenv/bin/python tests/kernels/data/make_kvpress_reference.py

What runs: a 2-layer Llama with random weights (6 query heads, 2 KV heads: GQA groups of 3
like SmolLM2-135M; head_dim 16; float32, eager attention) prefills random token ids inside
``with press(model)``. A subclass of each press records, per layer, the keys kvpress compressed,
its ``score`` output and the kept positions (read back from the keys it kept). For SnapKV it
also records the RoPE-applied queries of the window, computed the way SnapKVPress computes them
(``kvpress.utils.get_prerope_query_states`` on the window's hidden states, then the layer's
RoPE), because our kernels take queries rather than hidden states.

Arrays per case ``c`` (``L`` layers, ``H`` KV heads, ``Hq`` query heads):

* ``c/keys`` float32 ``[L, H, N, D]``, ``c/queries`` float32 ``[L, Hq, W, D]`` (snapkv only);
* ``c/scores`` float32 ``[L, H, N]``: the press's ``score`` output;
* ``c/kept`` int64 ``[L, H, M]``: kept positions, ascending;
* ``c/params`` int64 ``[N, M, window, kernel_size, n_sink]`` (0 where not applicable).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvpress import KeyDiffPress, KnormPress, SnapKVPress, StreamingLLMPress
from kvpress.utils import get_prerope_query_states
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

OUT = Path(__file__).with_name("kvpress_reference.npz")
SEED = 1234


def tiny_model() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        # large weights give peaked attention, so scores are far apart (kept sets unique)
        initializer_range=0.3,
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


def kept_positions(original: torch.Tensor, compressed: torch.Tensor) -> np.ndarray:
    """Positions of the rows kvpress kept: ``[1, H, N, D]`` and ``[1, H, M, D]`` -> ``[H, M]``."""
    rows = []
    for h in range(original.shape[1]):
        same = (compressed[0, h, :, None, :] == original[0, h, None, :, :]).all(dim=-1)
        if not bool((same.sum(dim=-1) == 1).all()):
            raise RuntimeError("a kept key matches no original key, or more than one")
        rows.append(sorted(int(i) for i in same.float().argmax(dim=-1)))
    return np.array(rows, dtype=np.int64)


def recording(press_cls: type) -> type:
    """A subclass of ``press_cls`` whose ``compress`` records its inputs and outputs."""

    @dataclasses.dataclass
    class Recording(press_cls):
        records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

        def compress(  # noqa: PLR0917 - kvpress's signature
            self, module, hidden_states, keys, values, attentions, kwargs
        ):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            kc, vc = super().compress(module, hidden_states, keys, values, attentions, kwargs)
            rec = {"keys": keys[0], "scores": scores[0], "kept": kept_positions(keys, kc)}
            if isinstance(self, SnapKVPress):
                w = self.window_size
                q = get_prerope_query_states(module, hidden_states[:, -w:])
                cos, sin = kwargs["position_embeddings"]
                rec["queries"] = apply_rotary_pos_emb(q, q, cos[:, -w:], sin[:, -w:])[0][0]
            self.records.append(rec)
            return kc, vc

    return Recording


def run_case(model: LlamaForCausalLM, press: Any, n: int, seed: int) -> dict[str, np.ndarray]:
    ids = torch.randint(
        0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad(), press(model):
        model(ids, past_key_values=DynamicCache(config=model.config))
    out = {
        name: np.stack(
            [r[name].detach().numpy() if name != "kept" else r[name] for r in press.records]
        )
        for name in press.records[0]
    }
    m = out["kept"].shape[-1]
    window = getattr(press, "window_size", 0)
    kernel = getattr(press, "kernel_size", 0)
    out["params"] = np.array([n, m, window, kernel, getattr(press, "n_sink", 0)], dtype=np.int64)
    return out


# (case name, press class, constructor arguments, N tokens, input seed)
CASES: list[tuple[str, type, dict[str, Any], int, int]] = [
    ("snapkv_w64_k5_n160", SnapKVPress, {"compression_ratio": 0.5}, 160, 1),
    ("snapkv_w16_k5_n120", SnapKVPress, {"compression_ratio": 0.7, "window_size": 16}, 120, 2),
    (
        "snapkv_w8_k3_n97",
        SnapKVPress,
        {"compression_ratio": 0.6, "window_size": 8, "kernel_size": 3},
        97,
        3,
    ),
    (
        "snapkv_w32_k7_n130",
        SnapKVPress,
        {"compression_ratio": 0.3, "window_size": 32, "kernel_size": 7},
        130,
        4,
    ),
    (
        "snapkv_w8_k1_n64",
        SnapKVPress,
        {"compression_ratio": 0.8, "window_size": 8, "kernel_size": 1},
        64,
        5,
    ),
    (
        "snapkv_w16_k5_n100_below_window",
        SnapKVPress,
        {"compression_ratio": 0.9, "window_size": 16},
        100,
        10,
    ),
    ("streamingllm_s4_n50", StreamingLLMPress, {"compression_ratio": 0.8}, 50, 6),
    ("streamingllm_s4_n50_below_sinks", StreamingLLMPress, {"compression_ratio": 0.96}, 50, 7),
    ("knorm_n90", KnormPress, {"compression_ratio": 0.5}, 90, 8),
    ("keydiff_n90", KeyDiffPress, {"compression_ratio": 0.5}, 90, 9),
]


def main() -> None:
    from importlib.metadata import version

    model = tiny_model()
    arrays: dict[str, np.ndarray] = {}
    for name, cls, kwargs, n, seed in CASES:
        for key, value in run_case(model, recording(cls)(**kwargs), n, seed).items():
            arrays[f"{name}/{key}"] = value
    arrays["versions"] = np.array(
        [f"{p}=={version(p)}" for p in ("kvpress", "transformers", "torch")]
    )
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(CASES)} cases)")


if __name__ == "__main__":
    main()
