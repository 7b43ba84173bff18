"""One registry per extension point (STYLE.md §3): compression methods, tiers, placers and
quality evaluators are each a :class:`Registry` of classes by name.

* **Built-ins are lazy.** A registry names its built-in classes as ``"module:Class"`` and
  imports one only when it is looked up (its name is listed without any import), so nothing is
  registered as a side effect of importing an unrelated module, and looking up ``lru`` does not
  import torch for a kernel or transformers for an evaluator.
* **Everything else registers explicitly** with :meth:`Registry.register` (also a class
  decorator) or, for the length of a test, :meth:`Registry.registered`.
* **One class per name.** A duplicate name raises and names the class holding it; a second
  copy of the *same* definition — a module imported twice under two names, as a test module
  imported by another test module is — raises saying so, instead of leaving whichever copy came
  first in the registry (tests once read a list of the wrong copy: commit c1da812).
* **An unknown name** raises the registry's error type, ``unknown <kind> 'name'; known: ...``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> subclass of ``base`` for one extension point.

    ``kind`` names the extension point in messages (``"placer"``); ``base`` is ``T`` itself
    (typed ``type``: mypy passes no abstract class as ``type[T]``); ``name_attr`` is the class
    attribute holding a class's name (``"name"``, ``"kind"`` for tiers); ``builtins`` maps each
    built-in name to ``"module:Class"``; ``error`` builds the exception of an unknown name (a
    ``ValueError`` subclass such as ``ConfigError``).
    """

    def __init__(
        self,
        kind: str,
        base: type,
        builtins: Mapping[str, str],
        *,
        name_attr: str = "name",
        error: Callable[[str], ValueError] = ValueError,
    ) -> None:
        self.kind = kind
        self.base = base
        self._builtins = dict(builtins)
        self._name_attr = name_attr
        self._error = error
        self._classes: dict[str, type[T]] = {}

    def names(self) -> tuple[str, ...]:
        """Every name, built-in or registered, sorted; imports nothing."""
        return tuple(sorted({*self._builtins, *self._classes}))

    def __contains__(self, name: object) -> bool:
        return name in self._builtins or name in self._classes

    def get(self, name: str) -> type[T]:
        """The class registered as ``name`` (a built-in is imported on its first lookup)."""
        cls = self._classes.get(name)
        if cls is not None:
            return cls
        if name not in self._builtins:
            raise self._error(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        cls = self._load(name, self._builtins[name])
        self._classes[name] = cls
        return cls

    def register(self, cls: type[T]) -> type[T]:
        """Add ``cls`` under its name; usable as a class decorator. Raises ``TypeError`` for a
        class that is not a ``base`` or has no name, ``ValueError`` for a name already taken."""
        name = self._name_of(cls)
        if name in self._builtins:
            raise ValueError(
                f"{self.kind} {name!r} is built in ({self._builtins[name]}); choose another name"
            )
        held = self._classes.get(name)
        if held is not None:
            raise ValueError(f"{self.kind} {name!r} is already registered by {_where(held)}"
                             f"{_twice(held, cls)}")  # fmt: skip
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a registered (not a built-in) class; unknown names raise the registry's
        error."""
        if name in self._builtins or name not in self._classes:
            raise self._error(f"no registered {self.kind} {name!r} to remove")
        del self._classes[name]

    @contextmanager
    def registered(self, cls: type[T]) -> Iterator[type[T]]:
        """``cls`` registered inside the ``with`` block only (a test's own class)."""
        self.register(cls)
        try:
            yield cls
        finally:
            self.unregister(self._name_of(cls))

    def _name_of(self, cls: type[T]) -> str:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__} subclass")
        name = getattr(cls, self._name_attr, "")
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} has no {self._name_attr} (a non-empty string)")
        return name

    def _load(self, name: str, path: str) -> type[T]:
        module, _, attr = path.partition(":")
        cls: type[T] = getattr(importlib.import_module(module), attr)
        if self._name_of(cls) != name:
            raise TypeError(f"built-in {self.kind} {name!r} ({path}) names itself "
                            f"{getattr(cls, self._name_attr)!r}")  # fmt: skip
        return cls


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _twice(held: type, cls: type) -> str:
    """A note when ``cls`` is another copy of ``held``'s definition (same file, same name)."""
    try:
        same = inspect.getfile(held) == inspect.getfile(cls)
    except TypeError:  # a class defined outside any file (built by type())
        return ""
    if not same or held.__qualname__ != cls.__qualname__:
        return ""
    return (
        f"; {inspect.getfile(cls)} was imported twice, as {held.__module__!r} and "
        f"{cls.__module__!r}: import it under one name, or register each copy only while it is "
        "used (Registry.registered)"
    )
