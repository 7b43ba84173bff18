"""Compression methods: torch references (the spec) and Triton kernels (issue 3).

Importing this package loads nothing heavy: the torch-free variant grammar and size formulas
are re-exported here (``kvtierd.policies`` may use them without torch); everything else is
imported from its module:

* ``kvtierd.kernels.api`` — ``compress_kv``, ``compress_dense``, ``dense_kv``, ``to_kv_2ltd``;
* ``kvtierd.kernels.layout`` — ``KVSource`` (contiguous ``[L, H, N, D]``, LMCache ``KV_2LTD``,
  vLLM paged), the layout every kernel reads through;
* ``kvtierd.kernels.registry`` — ``default_registry``, ``get_method``;
* one module per method (``knorm``, ``keydiff``, ``snapkv``, ``paged_eviction``,
  ``streamingllm``), ``quant`` (``int8``/``int4``), ``rope`` (delta rotation);
* ``_tl_*`` — the Triton kernels, imported only when a Triton backend runs.
"""

from kvtierd.kernels.variants import (
    COUNT_RULES,
    CountRule,
    Variant,
    kept_token_count,
    parse_variant,
    variant_kept_tokens,
    variant_size_bytes,
)

__all__ = [
    "COUNT_RULES",
    "CountRule",
    "Variant",
    "kept_token_count",
    "parse_variant",
    "variant_kept_tokens",
    "variant_size_bytes",
]
