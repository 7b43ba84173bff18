"""snapkv in the daemon: the window queries its variants are profiled and built with.

snapkv scores a context's tokens by the attention of its last ``W`` queries (``kernels/snapkv``),
and a stored KV cache keeps keys and values, never queries. The daemon recomputes them as the
LMCache plugin does for a router store request (``profiler/window_queries.py``): the model in
the policy's ``profiling.model_dir`` (the checkpoint vLLM serves; a policy with snapkv and no
``model_dir`` is refused, ``policy_config.SNAPKV_NEEDS_MODEL``) runs the context's last ``W``
token ids — registered by the router or ``KVStore.SetContextTokens`` — after the stored KV of
the tokens before them. One forward pass of ``W`` tokens per profile or build; the model is
loaded once per process and KV dtype.

* Profiling: when the grid holds a snapkv variant, the queries of the largest window are
  computed and handed to the evaluator (snapkv takes the last ``W`` of them; the ``attention``
  evaluator also uses them as its probes). A context whose token ids are not known to its end
  is profiled without its snapkv variants.
* Building (the executor's ``compress``): the servable form (``servable.py``) covers the first
  ``N`` agreed tokens; its window is their last ``W`` ids (``ServableForm.window_ids``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtierd.errors import InvalidArgumentError, KvtierError
from kvtierd.kernels.window_methods import window_option
from kvtierd.variants import Variant, as_variant, option_default

if TYPE_CHECKING:
    import torch

    from kvtierd.profiler import DriftSample, Profiler, ProfilingQuery, StoredForm
    from kvtierd.types import ContextProfile

logger = logging.getLogger(__name__)


def window_of(variant: Variant | str) -> int:
    """The observation window of a variant whose method reads window queries (snapkv;
    ``kernels/window_methods.py``), 0 for any other."""
    v = as_variant(variant)
    option = window_option(v.method)
    if not option:
        return 0
    return dict(v.options).get(option, option_default(v.method, option))


def grid_window(variants: Iterable[str]) -> int:
    """The largest snapkv window among ``variants`` (0: none is snapkv)."""
    return max((window_of(v) for v in variants), default=0)


def context_queries(
    model_dir: str,
    variants: Sequence[str],
    keys: torch.Tensor,
    values: torch.Tensor,
    tokens: Sequence[int],
) -> torch.Tensor | None:
    """The window queries ``[L, Hq, W, D]`` that ``variants`` need for a context whose KV is
    ``keys``/``values`` ``[L, H, N, D]``; ``None`` when none is snapkv, or the policy names no
    model, or ``tokens`` (the ids known, from the first) do not reach the context's end."""
    from kvtierd.profiler.window_queries import queries_for_context

    window, n = grid_window(variants), int(keys.shape[2])
    if not window or not model_dir or len(tokens) < n:
        return None
    return queries_for_context(model_dir, keys, values, tokens[:n], window)


def profile(
    profiler: Profiler,
    model_dir: str,
    context_id: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    queries: Sequence[ProfilingQuery],
    variants: Sequence[str],
    form: StoredForm,
    refine: bool = False,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ContextProfile:
    """:meth:`Profiler.profile` with the window queries the grid's snapkv variants need; the
    snapkv variants are left out when they cannot be computed (module docstring), as they are
    for a context with a ``prefix`` (its ancestors' KV: its window would need their ids)."""
    tokens = profiler.queries.tokens(context_id, int(keys.shape[2]))
    window_queries = None
    if prefix is None:
        window_queries = context_queries(model_dir, variants, keys, values, tokens)
    if window_queries is None and grid_window(variants):
        logger.info("context %s: profiled without its snapkv variants: %s", context_id,
                    "it continues another context" if prefix is not None else
                    _why_not(model_dir, len(tokens), int(keys.shape[2])))  # fmt: skip
        variants = [v for v in variants if not window_of(v)]
    return profiler.profile(context_id, keys, values, queries=queries, variants=variants,
                            window_queries=window_queries, form=form, refine=refine,
                            prefix=prefix)  # fmt: skip


def check_drift(
    profiler: Profiler,
    context_id: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    variant: str,
    *,
    model_dir: str,
    variants: Sequence[str],
    form: StoredForm,
) -> DriftSample | None:
    """:meth:`Profiler.check_drift` with the window queries the profile was scored with
    (``variants``: the grid); ``None`` (no sample) when the context is stored as snapkv and
    they cannot be computed now (a policy without ``model_dir`` since, or its ids are gone)."""
    tokens = profiler.queries.tokens(context_id, int(keys.shape[2]))
    try:
        window_queries = context_queries(model_dir, [*variants, variant], keys, values, tokens)
    except KvtierError as e:  # a failed measurement is no sample; the drift loop goes on
        logger.warning("context %s: drift not measured: %s", context_id, e)
        return None
    if window_queries is None and window_of(variant):
        return None
    return profiler.check_drift(context_id, keys, values, variant,
                                window_queries=window_queries, form=form)  # fmt: skip


def form_queries(
    model_dir: str, window_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """The window queries of a servable form's ``N`` tokens (``keys``/``values`` ``[L, H, N,
    D]``; ``window_ids``: their last ``W`` ids) for building its snapkv variant."""
    from kvtierd.profiler.window_queries import queries_for_context

    if not model_dir or not window_ids:
        raise InvalidArgumentError(
            f"snapkv needs its window queries: model_dir {model_dir!r}, "
            f"{len(window_ids)} window token ids"
        )
    return queries_for_context(model_dir, keys, values, window_ids, len(window_ids))


def _why_not(model_dir: str, known: int, n: int) -> str:
    if not model_dir:
        return "the policy names no profiling.model_dir"
    return f"{known} of its {n} token ids are known (the window is its last ones)"
