"""Compression methods: torch references (the spec) and Triton kernels (issue 3).

Importing this package loads nothing heavy and exports nothing: the variant grammar and the
size formulas are torch-free and live in the bottom layer (:mod:`kvtierd.variants`,
:mod:`kvtierd.sizes`); everything here is imported from its module:

* ``kvtierd.kernels.api`` — ``compress_kv``, ``compress_dense``, ``dense_kv``, ``to_kv_2ltd``;
* ``kvtierd.kernels.layout`` — ``KVSource`` (contiguous ``[L, H, N, D]``, LMCache ``KV_2LTD``,
  vLLM paged), the layout every kernel reads through;
* ``kvtierd.kernels.registry`` — ``METHODS``, ``get_method``;
* ``kvtierd.kernels.window_methods`` — which methods read window queries (torch-free);
* one module per method (``knorm``, ``keydiff``, ``snapkv``, ``paged_eviction``,
  ``streamingllm``), ``quant`` (``int8``/``int4``), ``rope`` (delta rotation);
* ``_tl_*`` — the Triton kernels, imported only when a Triton backend runs.
"""
