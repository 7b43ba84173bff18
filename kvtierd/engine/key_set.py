"""The keys of a context's objects: an ordered set that holds a single key without a dict."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KeySet:
    """Keys in the order they were added, as a ``dict[str, None]`` keeps them: add, remove and
    membership O(1), iteration in order (and reversed), but lean while it holds one key.

    Most contexts of a large daemon hold one chunk (issue 42: a restart of 1,000,000 objects
    within 1 KB each), and a one-key dict is 184 bytes (64 for the dict, 120 for its table);
    this holds the key itself, 40 bytes. It holds ``None`` when empty, the key when it holds
    one, a dict from two keys on, and goes back to the bare key when one is left.

    Iterating it while it changes is as unsafe as a dict's (callers that change it iterate a
    ``list`` of it)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys: str | dict[str, None] | None = None
        for key in keys:
            self.add(key)

    def add(self, key: str) -> None:
        """Add ``key`` last; a key held already keeps its place."""
        held = self._keys
        if held is None:
            self._keys = key
        elif isinstance(held, dict):
            held[key] = None
        elif key != held:
            self._keys = {held: None, key: None}

    def remove(self, key: str) -> None:
        """Remove ``key``; ``KeyError`` when it is not held."""
        held = self._keys
        if isinstance(held, dict):
            del held[key]
            if len(held) == 1:
                self._keys = next(iter(held))
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
        if isinstance(held, dict):
            return key in held
        return held is not None and held == key

    def __len__(self) -> int:
        held = self._keys
        if held is None:
            return 0
        return len(held) if isinstance(held, dict) else 1

    def __bool__(self) -> bool:
        return self._keys is not None

    def __iter__(self) -> Iterator[str]:
        held = self._keys
        if held is None:
            return iter(())
        return iter(held) if isinstance(held, dict) else iter((held,))

    def __reversed__(self) -> Iterator[str]:
        held = self._keys
        if held is None:
            return iter(())
        return reversed(held) if isinstance(held, dict) else iter((held,))

    def __repr__(self) -> str:
        return f"KeySet({list(self)!r})"
