"""The compression-method registry: :data:`METHODS`, name -> :class:`TokenDropMethod` subclass.

Every method is constructed the same way: ``cls(**options)``, the options of its variant name
(``kvtierd.variants.METHOD_OPTIONS``; none = the defaults). Methods are imported on first
lookup (:class:`kvtierd.registry.Registry`); an unknown name or option raises
``InvalidArgumentError`` listing the known ones. ``int8``/``int4`` are quantizers
(``quant.py``), not methods.
"""

from __future__ import annotations

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.base import TokenDropMethod
from kvtierd.registry import Registry
from kvtierd.variants import Options, canonical_options

METHODS: Registry[TokenDropMethod] = Registry(
    "compression method",
    TokenDropMethod,
    {
        "knorm": "kvtierd.kernels.knorm:KnormMethod",
        "keydiff": "kvtierd.kernels.keydiff:KeyDiffMethod",
        "snapkv": "kvtierd.kernels.snapkv:SnapKVMethod",
        "paged_eviction": "kvtierd.kernels.paged_eviction:PagedEvictionMethod",
        "paged_eviction_block": "kvtierd.kernels.paged_eviction:PagedEvictionBlockMethod",
        "streamingllm": "kvtierd.kernels.streamingllm:StreamingLLMMethod",
    },
    error=InvalidArgumentError,
)


def get_method(name: str, options: Options = ()) -> TokenDropMethod:
    """A fresh method ``name`` with ``options`` (``(name, value)`` pairs, e.g. a
    ``Variant``'s); raises ``InvalidArgumentError`` for an unknown method or a bad option."""
    cls = METHODS.get(name)
    try:
        canonical_options(name, dict(options))
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from e
    return cls(**dict(options))
