"""What ``kvtierd router`` and its clients agree on (DESIGN.md §1, docs/integration.md).

* A context's identity: :func:`context_digest` of the model vLLM loaded and the context's token
  ids. The router names stored compressed contexts by it and the LMCache plugin stores their
  manifests under it.
* The answer header :data:`LOADED_HEADER`: ``<digest>/<variant>`` when the router served the
  request from a stored token-dropped variant, absent when it sent the real prompt.

It sits at the bottom layer so that the router (``kvtierd.integrations``) and the ``engine``
quality evaluator (``kvtierd.profiler``, which may not import integrations) share one
definition instead of two copies held equal by a test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

LOADED_HEADER = "x-kvtierd-context"
"""The router's answer header naming the ``<digest>/<variant>`` it loaded (absent: real prompt)."""


def context_digest(model: str, token_ids: Sequence[int]) -> str:
    """The identity of a context: the model path vLLM loaded (LMCache's model name) and the
    context's token ids (hex, 32 characters)."""
    h = hashlib.sha256(model.encode())
    h.update(b"\0")
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.hexdigest()[:32]


def loaded_value(digest: str, variant: str) -> str:
    """The value of :data:`LOADED_HEADER` for a request served from ``variant`` of ``digest``."""
    return f"{digest}/{variant}"
