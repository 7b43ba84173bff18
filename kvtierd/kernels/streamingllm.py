"""``streamingllm``: the first ``sinks`` tokens plus the most recent ones (Xiao et al. 2023;
kvpress StreamingLLMPress).

The structured baseline. Score: ``+inf`` for the sinks, the position otherwise, so the top-M
are the sinks and the ``M - sinks`` latest tokens. ``M`` is exactly the count asked for: below
the sink count, the first ``M`` sinks (kvpress keeps ``M`` of its tied sinks in ``topk``'s
order). Reads no KV, so both backends score in torch.
"""

from __future__ import annotations

import torch

from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.layout import KVSource
from kvtierd.variants import canonical_options, option_default


def positional_scores(
    num_layers: int, num_kv_heads: int, num_tokens: int, sinks: int, device: torch.device
) -> torch.Tensor:
    s = torch.arange(num_tokens, dtype=torch.float32, device=device)
    s[: min(sinks, num_tokens)] = float("inf")
    return s.expand(num_layers, num_kv_heads, num_tokens).contiguous()


class StreamingLLMMethod(TokenDropMethod):
    name = "streamingllm"

    def __init__(self, sinks: int = option_default("streamingllm", "sinks")) -> None:
        canonical_options(self.name, {"sinks": sinks})
        self.sinks = sinks

    def option_values(self) -> dict[str, int]:
        return {"sinks": self.sinks}

    def score_reference(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None
    ) -> torch.Tensor:
        lyr, h, n, _ = keys.shape
        return positional_scores(lyr, h, n, self.sinks, keys.device)

    def score_triton(self, source: KVSource, queries: torch.Tensor | None) -> torch.Tensor:
        return positional_scores(
            source.num_layers, source.num_kv_heads, source.num_tokens, self.sinks, source.device
        )
