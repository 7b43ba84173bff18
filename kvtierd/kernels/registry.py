"""The method registry: one dict from name to :class:`TokenDropMethod` subclass.

Every method is constructed the same way: ``cls(**options)``, the options of its variant name
(``variants.METHOD_OPTIONS``; none = the defaults). Duplicate names raise; an unknown name or
option raises ``ValueError`` listing the known ones.
"""

from __future__ import annotations

from kvtierd.errors import InvalidArgumentError
from kvtierd.kernels.base import TokenDropMethod
from kvtierd.kernels.keydiff import KeyDiffMethod
from kvtierd.kernels.knorm import KnormMethod
from kvtierd.kernels.paged_eviction import PagedEvictionBlockMethod, PagedEvictionMethod
from kvtierd.kernels.snapkv import SnapKVMethod
from kvtierd.kernels.streamingllm import StreamingLLMMethod
from kvtierd.variants import Options, canonical_options


class MethodRegistry:
    """Name -> method class. Built explicitly (nothing registers itself at import time)."""

    def __init__(self) -> None:
        self._methods: dict[str, type[TokenDropMethod]] = {}

    def register(self, cls: type[TokenDropMethod]) -> None:
        if not (isinstance(cls, type) and issubclass(cls, TokenDropMethod)):
            raise TypeError(f"{cls!r} is not a TokenDropMethod subclass")
        if cls.name in self._methods:
            raise ValueError(
                f"method {cls.name!r} already registered by {self._methods[cls.name].__name__}"
            )
        self._methods[cls.name] = cls

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._methods))

    def create(self, name: str, options: Options = ()) -> TokenDropMethod:
        """A fresh ``name`` with ``options`` (``(name, value)`` pairs, e.g. a ``Variant``'s)."""
        try:
            cls = self._methods[name]
        except KeyError as e:
            raise InvalidArgumentError(
                f"unknown compression method {name!r}; known: {', '.join(self.names())}"
            ) from e
        try:
            canonical_options(name, dict(options))
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from e
        return cls(**dict(options))


def default_registry() -> MethodRegistry:
    """The built-in token-dropping methods (``int8``/``int4`` are quantizers, ``quant.py``)."""
    reg = MethodRegistry()
    for cls in (
        KnormMethod,
        KeyDiffMethod,
        SnapKVMethod,
        PagedEvictionMethod,
        PagedEvictionBlockMethod,
        StreamingLLMMethod,
    ):
        reg.register(cls)
    return reg


def get_method(name: str, options: Options = ()) -> TokenDropMethod:
    """A fresh instance of the built-in method ``name`` (``ValueError`` if unknown)."""
    return default_registry().create(name, options)
