"""What ``kvtierd router`` and its clients agree on (DESIGN.md §1, docs/integration.md).

* A context's identity: :func:`context_digest` of the model vLLM loaded, an optional
  profiling **scope** and the context's token ids. The router names stored compressed contexts
  by it, and the LMCache plugin derives from it the manifest key and the placeholder ids.
* A request's ``"kvtierd"`` field (:class:`ContextRequest`): store the first ``context_tokens``
  tokens as ``variant``, or — within a scope — load ``variant``.
* The answer header :data:`LOADED_HEADER`: ``<digest>/<variant>`` when the router served the
  request from a stored token-dropped variant, absent when it sent the real prompt.

**Scopes.** A production request names no scope: the router rewrites it to whichever variant
the context is stored in (one per context). A scoped context (e.g. one a profiler stores to
score it) has another digest, hence other manifest keys and placeholder ids: no production
prompt is ever rewritten to it, nor shares vLLM's prefix cache with it. Within a scope a
context may be stored in several variants at once (one manifest each), and a request loads the
one it names.

It sits at the bottom layer so that the router and the ``served`` quality evaluator
(``kvtierd.integrations``) and the daemon, which writes the servable form of the variants it
builds (``kvtierd.engine``, which may not import integrations), share one definition.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtierd.errors import InvalidArgumentError

LOADED_HEADER = "x-kvtierd-context"
"""The router's answer header naming the ``<digest>/<variant>`` it loaded (absent: real prompt)."""

_SCOPE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_FIELDS = ("context_tokens", "variant", "scope")
MAX_CONTEXT_TOKENS = 1 << 22  # above any served model's context length
MAX_FIELD_CHARS = 256


def check_scope(scope: str) -> str:
    """``scope`` if it is ``""`` (production) or 1-64 characters of ``[A-Za-z0-9._-]``."""
    if scope and not _SCOPE.fullmatch(scope):
        raise InvalidArgumentError(
            f"kvtierd.scope {scope!r}: expected 1-64 characters of letters, digits, '.', '_', '-'"
        )
    return scope


def context_digest(model: str, token_ids: Sequence[int], scope: str = "") -> str:
    """The identity of a context: the model path vLLM loaded (LMCache's model name), the scope
    (``""``: production) and the context's token ids (hex, 32 characters).

    A production digest hashes ``model, 0, ids`` (8 bytes per id), as before scopes existed. A
    scoped one puts a header between the model's ``0`` and the ids — 1, the scope's length, the
    scope, zero padding — whose length is 1 modulo 8, so no token ids, however chosen, give a
    production prompt a scoped context's digest."""
    h = hashlib.sha256(model.encode())
    h.update(b"\0")
    if check_scope(scope):
        header = b"\x01" + bytes([len(scope)]) + scope.encode()
        h.update(header + b"\0" * ((1 - len(header)) % 8))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.hexdigest()[:32]


def loaded_value(digest: str, variant: str) -> str:
    """The value of :data:`LOADED_HEADER` for a request served from ``variant`` of ``digest``."""
    return f"{digest}/{variant}"


@dataclass(frozen=True, slots=True)
class ContextRequest:
    """A request's ``"kvtierd"`` field. ``context_tokens > 0``: store the first that many tokens
    as ``variant`` (within ``scope``, if any). Else, within ``scope``: load ``variant`` of the
    scoped context the prompt starts with, or, without a variant, never load a stored variant
    (the real prompt). A production request without the field loads whatever is stored."""

    context_tokens: int = 0
    variant: str = ""
    scope: str = ""

    def __post_init__(self) -> None:
        check_scope(self.scope)
        if self.context_tokens < 0:
            raise InvalidArgumentError(f"kvtierd.context_tokens must be >= 0, got {self}")
        if self.context_tokens and not self.variant:
            raise InvalidArgumentError("kvtierd.context_tokens needs kvtierd.variant to store")
        if self.variant and not (self.context_tokens or self.scope):
            raise InvalidArgumentError(
                "kvtierd.variant without context_tokens loads a scoped context and needs "
                "kvtierd.scope (production requests load whatever variant is stored)"
            )

    @property
    def is_store(self) -> bool:
        return self.context_tokens > 0

    @classmethod
    def from_json(cls, raw: Any) -> ContextRequest:
        if not isinstance(raw, Mapping):
            raise InvalidArgumentError(f"kvtierd must be an object, got {raw!r}")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise InvalidArgumentError(f"kvtierd: unknown keys {unknown}; known: {_FIELDS}")
        tokens = raw.get("context_tokens", 0)
        # 1e400 (JSON's inf) raised OverflowError in int(): a 500 with a traceback
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens > MAX_CONTEXT_TOKENS:
            raise InvalidArgumentError(
                f"kvtierd.context_tokens must be an integer of at most {MAX_CONTEXT_TOKENS}, "
                f"got {tokens!r:.40}"
            )
        texts = {k: raw.get(k, "") for k in ("variant", "scope")}
        for key, value in texts.items():
            if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS:
                raise InvalidArgumentError(
                    f"kvtierd.{key} must be a string of at most {MAX_FIELD_CHARS} characters"
                )
        return cls(tokens, texts["variant"], texts["scope"])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"context_tokens": self.context_tokens} if self.is_store else {}
        return out | {k: v for k, v in (("variant", self.variant), ("scope", self.scope)) if v}
