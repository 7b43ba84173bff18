"""The methods that score a context with the queries of an observation window, and the option
that sets the window's length: a property of the method (``TokenDropMethod.needs_queries``)
written here without torch, so that the daemon asks it on a put without loading the kernels
(``registry.py`` imports them). ``tests/kernels`` checks both say the same of every method.

A stored KV cache keeps keys and values, never queries: the daemon recomputes a window's
queries from the model and the context's last token ids
(``engine/profiling/observation_window.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

WINDOW_OPTION: Mapping[str, str] = MappingProxyType({"snapkv": "window"})
"""method -> the option that sets its observation window (in ``variants.METHOD_OPTIONS``)."""


def window_option(method: str) -> str:
    """The option naming ``method``'s window length; "" for a method that reads no queries."""
    return WINDOW_OPTION.get(method, "")
