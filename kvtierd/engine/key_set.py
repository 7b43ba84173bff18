"""The keys of a context's objects: an ordered set that holds a few keys without a dict."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

Held = str | tuple[str, ...] | dict[str, None] | None
"""What a :class:`KeySet` keeps in its holder: ``None`` when empty, the key when it holds one,
a tuple of up to :data:`FEW` keys, a dict past that (back to the bare key when one is left)."""

FEW = 8
"""Keys a :class:`KeySet` holds in a tuple (a scan of at most this many finds one)."""


class KeyHolder(Protocol):
    """An object with a slot that a :class:`KeySet` keeps its keys in."""

    held_keys: Held


class _Holder:
    __slots__ = ("held_keys",)

    def __init__(self) -> None:
        self.held_keys: Held = None


class KeySet:
    """Keys in the order they were added, as a ``dict[str, None]`` keeps them: add, remove and
    membership O(1) (a scan of at most :data:`FEW` while it holds few), iteration in order
    (and reversed), but lean while it holds few keys.

    Most contexts of a large daemon hold one chunk or a few (issue 42: a restart of 1,000,000
    objects within 1 KB each), and a dict of up to five keys is 184 bytes (64 for the dict,
    120 for its table): a key set of one key holds the key itself, of a few (up to
    :data:`FEW`) a tuple of them (64 bytes for three). It keeps its keys in a ``held_keys``
    slot of its ``holder`` (:data:`Held`): a :class:`~kvtierd.engine.state.ContextRecord`
    lends its own, so a context pays no object for its keys (40 bytes an object at 1M), and
    each ``ctx.keys`` is a view made on access; without a holder it makes one of its own.

    Iterating it while it changes is as unsafe as a dict's (callers that change it iterate a
    ``list`` of it)."""

    __slots__ = ("_holder",)

    def __init__(self, keys: Iterable[str] = (), holder: KeyHolder | None = None) -> None:
        self._holder: KeyHolder = _Holder() if holder is None else holder
        for key in keys:
            self.add(key)

    @property
    def _keys(self) -> Held:
        return self._holder.held_keys

    @_keys.setter
    def _keys(self, held: Held) -> None:
        self._holder.held_keys = held

    def add(self, key: str) -> None:
        """Add ``key`` last; a key held already keeps its place."""
        held = self._keys
        if held is None:
            self._keys = key
        elif isinstance(held, dict):
            held[key] = None
        elif isinstance(held, tuple):
            if key not in held:
                self._keys = (*held, key) if len(held) < FEW else dict.fromkeys((*held, key))
        elif key != held:
            self._keys = (held, key)

    def remove(self, key: str) -> None:
        """Remove ``key``; ``KeyError`` when it is not held."""
        held = self._keys
        if isinstance(held, dict):
            del held[key]
            if len(held) == 1:
                self._keys = next(iter(held))
        elif isinstance(held, tuple):
            if key not in held:
                raise KeyError(key)
            rest = tuple(k for k in held if k != key)
            self._keys = rest[0] if len(rest) == 1 else rest
        elif held is not None and held == key:
            self._keys = None
        else:
            raise KeyError(key)

    def discard(self, key: str) -> None:
        """Remove ``key`` if it is held."""
        if key in self:
            self.remove(key)

    def clear(self) -> None:
        self._keys = None

    def __contains__(self, key: object) -> bool:
        held = self._keys
        if isinstance(held, (dict, tuple)):
            return key in held
        return held is not None and held == key

    def __len__(self) -> int:
        held = self._keys
        if held is None:
            return 0
        return len(held) if isinstance(held, (dict, tuple)) else 1

    def __bool__(self) -> bool:
        return self._keys is not None

    def __iter__(self) -> Iterator[str]:
        held = self._keys
        if held is None:
            return iter(())
        return iter(held) if isinstance(held, (dict, tuple)) else iter((held,))

    def __reversed__(self) -> Iterator[str]:
        held = self._keys
        if held is None:
            return iter(())
        return reversed(held) if isinstance(held, (dict, tuple)) else iter((held,))

    def __repr__(self) -> str:
        return f"KeySet({list(self)!r})"
