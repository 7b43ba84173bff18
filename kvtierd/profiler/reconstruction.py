"""Reconstruction probes: a context's own spans, read again after it, as query-agnostic probes
(issue 39; the idea of KVzip, Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with
Context Reconstruction": a KV entry matters if the model needs it to restate the context).

At a context's first put no question is known. Its last tokens' queries (``window``) look
only at what the context's end attends to; what a later question will need is some fact
anywhere in it. Teacher-forcing spans of the context after the context itself makes the model
retrieve each span from where it stands (copying heads attend to the span's first occurrence,
or to any repeat of it): a variant that dropped those entries changes the attention output,
one that kept a copy elsewhere changes it less. The spans are spread evenly over the context
(deterministic, so a profile is reproducible), ``spans * span_tokens`` tokens in all: a pass
of that many tokens after the stored KV, a few % of the context's own prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.errors import InvalidArgumentError

SPANS = 4
SPAN_TOKENS = 16


def reconstruction_ids(
    token_ids: Sequence[int], spans: int = SPANS, span_tokens: int = SPAN_TOKENS
) -> list[int]:
    """``spans`` spans of ``span_tokens`` ids of ``token_ids``, evenly spaced from its start
    to its end, concatenated (fewer, shorter ones for a context shorter than that)."""
    if spans < 1 or span_tokens < 1:
        raise InvalidArgumentError(
            f"spans and span_tokens must be >= 1, got {spans} and {span_tokens}"
        )
    n = len(token_ids)
    if n == 0:
        raise InvalidArgumentError("reconstruction probes need the context's token ids")
    width = min(span_tokens, n)
    count = min(spans, max(1, n // width))
    last_start = n - width
    starts = [round(i * last_start / max(count - 1, 1)) for i in range(count)]
    return [t for s in starts for t in token_ids[s : s + width]]
