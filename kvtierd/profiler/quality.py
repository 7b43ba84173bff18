"""Quality evaluators: one interface, one registry (EvicPress §4.3, quality term of §4.2).

An evaluator answers "how close is the model's behaviour over a variant's KV to its behaviour
over the original KV?" for one context, for many variants at once, as a number in ``[0, 1]``
(1.0 = indistinguishable). Built-ins: ``attention`` (model-free, :mod:`.attention`),
``query_attention`` (the question's attention, every ratio at once, :mod:`.query_attention`),
``answer`` (the paper's metric, :mod:`.answer`) and ``served`` (the same metric measured through
vLLM and ``kvtierd router``, :mod:`kvtierd.integrations.served_eval`). Register more in
:data:`EVALUATORS`; every evaluator is constructed as ``cls(**options)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.yield_gate import YieldGate
from kvtierd.registry import Registry
from kvtierd.sizes import DEFAULT_GROUP_SIZE

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, eq=False)
class ContextKV:
    """One context's original KV as the model produced it (RoPE already applied to keys).

    ``keys``/``values``: ``[L, H, N, D]``. ``window_queries``: ``[L, Hq, W, D]`` RoPE-applied
    queries of the context's last ``W`` tokens when known — ``snapkv`` variants need them and the
    ``attention`` evaluator uses them as probes. ``token_ids``: the context's tokens when known.

    ``prefix_keys``/``prefix_values``: ``[L, H, P, D]``, the KV of the context's ancestors in a
    tree of contexts (issue 29: a system prompt before a document), root first, as they are
    stored. The context's own KV follows them (its keys were computed at positions ``P ..``,
    attending to them); every variant of the context keeps them as they are, so an evaluator
    that reads them scores the context as it is served (``query_attention`` does).
    """

    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor | None = None
    token_ids: tuple[int, ...] = ()
    prefix_keys: torch.Tensor | None = None
    prefix_values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k, v = self.keys, self.values
        if k.dim() != 4 or k.shape != v.shape:
            raise InvalidArgumentError(
                f"keys and values must be equal [L, H, N, D], got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        q = self.window_queries
        if q is not None and (q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]):
            raise InvalidArgumentError(
                f"window_queries must be [L={k.shape[0]}, Hq, W, D={k.shape[3]}], "
                f"got {tuple(q.shape)}"
            )

        pk, pv = self.prefix_keys, self.prefix_values
        if (pk is None) != (pv is None):
            raise InvalidArgumentError("prefix_keys and prefix_values come together")
        if pk is not None and pv is not None:
            want = (k.shape[0], k.shape[1], k.shape[3])
            if (
                pk.dim() != 4
                or pk.shape != pv.shape
                or (pk.shape[0], pk.shape[1], pk.shape[3]) != want
            ):
                raise InvalidArgumentError(
                    f"prefix_keys and prefix_values must be equal [L={want[0]}, H={want[1]}, P, "
                    f"D={want[2]}], got {tuple(pk.shape)} and {tuple(pv.shape)}"
                )

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def prefix_tokens(self) -> int:
        """``P``: the ancestors' tokens before the context (0 for a root)."""
        return 0 if self.prefix_keys is None else int(self.prefix_keys.shape[2])

    def served(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV a request for the context reads: the prefix, then the context's own
        ``[L, H, P + N, D]`` (its own when it has no prefix: no copy)."""
        if self.prefix_keys is None or self.prefix_values is None:
            return self.keys, self.values
        import torch

        k = torch.cat([self.prefix_keys.to(self.keys.dtype), self.keys], dim=2)
        v = torch.cat([self.prefix_values.to(self.values.dtype), self.values], dim=2)
        return k, v


@dataclass(frozen=True, slots=True)
class StoredForm:
    """How the daemon stores variants: the kernels' ``chunk_tokens`` and quantization
    ``group_size``. Sizes and qualities must be computed with the same values as the stored
    objects, so the engine passes its own here."""

    chunk_tokens: int = 1
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.group_size < 1:
            raise InvalidArgumentError(
                f"chunk_tokens and group_size must be >= 1, got {self.chunk_tokens}, "
                f"{self.group_size}"
            )


DEFAULT_FORM = StoredForm()

SCORINGS = ("similarity", "exact_match")
"""How the answer-comparing evaluators (``answer``, ``served``) score a variant's answer against
the full KV's: MiniLM cosine similarity (the paper's), or exact match (1.0 when unchanged)."""


@dataclass(frozen=True, slots=True)
class ProfilingQuery:
    """A question asked about a context: its text and/or its token ids (model tokenizer)."""

    text: str = ""
    token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.text and not self.token_ids:
            raise InvalidArgumentError("a profiling query needs text or token_ids")


@dataclass(frozen=True, slots=True)
class QualityResult:
    """Per-variant quality in ``[0, 1]`` averaged over ``num_queries`` queries."""

    evaluator: str
    quality: Mapping[str, float]
    num_queries: int
    elapsed_s: float = 0.0
    per_query: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def mean_of(
        cls,
        evaluator: str,
        per_query: Mapping[str, Sequence[float]],
        num_queries: int,
        elapsed_s: float,
    ) -> QualityResult:
        """A result whose quality per variant is the mean of its per-query scores."""
        return cls(
            evaluator=evaluator,
            quality=MappingProxyType({v: sum(s) / len(s) for v, s in per_query.items()}),
            num_queries=num_queries,
            elapsed_s=elapsed_s,
            per_query=MappingProxyType({v: tuple(s) for v, s in per_query.items()}),
        )

    def __getitem__(self, variant: str) -> float:
        try:
            return self.quality[variant]
        except KeyError:
            known = ", ".join(self.quality)
            raise KeyError(f"no quality for variant {variant!r} (have: {known})") from None


class QualityEvaluator(ABC):
    """Scores variants of one context. Subclasses set ``name`` and implement :meth:`evaluate`."""

    name: ClassVar[str]
    yield_gate: YieldGate | None = None
    """Set by the daemon: :meth:`pause` then waits while it serves (``yield_gate.py``)."""
    needs_token_ids: ClassVar[bool] = False
    """True when :meth:`evaluate` needs ``ContextKV.token_ids``; a caller that cannot supply
    them (the daemon: LMCache hands it chunk hashes, never tokens) refuses the evaluator."""

    @abstractmethod
    def evaluate(
        self,
        kv: ContextKV,
        variants: Sequence[str],
        queries: Sequence[ProfilingQuery],
        *,
        form: StoredForm = DEFAULT_FORM,
    ) -> QualityResult:
        """Quality of every variant in ``[0, 1]`` (``"none"``, if asked, scores 1.0 through the
        metric itself, not by special-casing). Raises rather than returning partial results.
        Calls :meth:`pause` before each step."""

    def pause(self) -> None:
        """Before each step of :meth:`evaluate` (a decode step, a layer): wait while the
        daemon serves, if it set a :attr:`yield_gate`."""
        if self.yield_gate is not None:
            self.yield_gate.wait()


EVALUATORS: Registry[QualityEvaluator] = Registry(
    "quality evaluator",
    QualityEvaluator,
    {
        "attention": "kvtierd.profiler.attention:AttentionEvaluator",
        "answer": "kvtierd.profiler.answer:AnswerEvaluator",
        "query_attention": "kvtierd.profiler.query_attention:QueryAttentionEvaluator",
        # A client of the serving stack (daemon through kvtierd.client, router over HTTP): it
        # sits in a layer above this package, which may not import it, so it is found by name.
        "served": "kvtierd.integrations.served_eval:ServedEvaluator",
    },
    error=InvalidArgumentError,
)
"""Evaluators by name. Built-ins are imported on first lookup, so that importing this module
loads neither torch nor transformers; others register with ``EVALUATORS.register`` (a test's
own: ``with EVALUATORS.registered(cls)``)."""


def evaluator_class(name: str) -> type[QualityEvaluator]:
    return EVALUATORS.get(name)


def make_evaluator(name: str, options: Mapping[str, Any] | None = None) -> QualityEvaluator:
    """Build a registered evaluator; a bad option names the evaluator."""
    cls = evaluator_class(name)
    try:
        return cls(**dict(options or {}))
    except TypeError as e:
        raise InvalidArgumentError(f"bad options for quality evaluator {name!r}: {e}") from e
