"""Profiles persisted with their context: one JSON file per context, reloaded after a restart.

A :class:`ProfileRecord` is what a profiling run established about a context — the
:class:`~kvtierd.types.ContextProfile` the placer reads, plus where its numbers came from
(evaluator, query source and count, token count, when) and so which :class:`ProfileReading`
made it. The decayed access count is stored beside it so frequency survives restarts too.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvtierd.errors import CorruptObjectError
from kvtierd.policy_config import EXPENSIVE_EVALUATORS
from kvtierd.profiler.files import JsonDir
from kvtierd.types import ContextProfile, VariantProfile


class ProfileReading(enum.Enum):
    """What a profile knew when it was made (DESIGN.md §3.11: each profile says which reading
    made it), weakest first. The value is what ``kvtierctl`` shows."""

    PRIOR = "prior"  # no model, no probes: the labels' per-variant share, blind to the context
    FIRST_PUT = "first put"  # probes from the context itself, no question known
    TRAFFIC = "traffic"  # questions known from users or traffic
    REFINED = "refined"  # the refining evaluator (answer, served) decoded answers


@dataclass(frozen=True, slots=True)
class ProfileRecord:
    """One context's profile and its provenance; ``profiled_at_s`` is wall-clock seconds."""

    profile: ContextProfile
    evaluator: str
    query_source: str
    num_queries: int
    num_tokens: int
    profiled_at_s: float
    frequency_value: float = 0.0
    frequency_t_ref_s: float = 0.0
    # The traffic requests its queries stood for when each of them was asked at least twice
    # (QueryStore.repeated_requests); 0 otherwise.
    repeated_requests: int = 0

    @property
    def context_id(self) -> str:
        return self.profile.context_id

    @property
    def reading(self) -> ProfileReading:
        """Derived from fields every profile file has always kept, so files written before
        readings were named read as they were made. An estimate from no query at all is the
        prior (``query_attention`` without a model: ``num_queries`` 0); the query source
        says whether questions were known (``QueryStore.profiling_set``: ``initial`` is the
        local set, which only the probes of a first put stand in for)."""
        if self.evaluator in EXPENSIVE_EVALUATORS:
            return ProfileReading.REFINED
        if self.num_queries == 0:
            return ProfileReading.PRIOR
        if self.query_source == "initial":
            return ProfileReading.FIRST_PUT
        return ProfileReading.TRAFFIC


class ProfileStore:
    """``directory/<hash>.json`` per context (:class:`~kvtierd.profiler.files.JsonDir`)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._files = JsonDir(directory)

    def save(self, record: ProfileRecord) -> None:
        self._files.write(record.context_id, _to_doc(record))

    def delete(self, context_id: str) -> None:
        self._files.delete(context_id)

    def records(self) -> Iterator[ProfileRecord]:
        for doc in self._files.documents():
            yield _from_doc(doc)


def _to_doc(r: ProfileRecord) -> dict[str, Any]:
    p = r.profile
    return {
        "version": 1,
        "variants": [
            {
                "variant": v.variant,
                "size_bytes": v.size_bytes,
                "quality": v.quality,
                "restore_s": v.restore_s,
            }
            for v in p.variants
        ],
        "frequency": p.frequency,
        "prefill_s": p.prefill_s,
        "pinned": p.pinned,
        "evaluator": r.evaluator,
        "query_source": r.query_source,
        "num_queries": r.num_queries,
        "num_tokens": r.num_tokens,
        "repeated_requests": r.repeated_requests,
        "profiled_at_s": r.profiled_at_s,
        "frequency_value": r.frequency_value,
        "frequency_t_ref_s": r.frequency_t_ref_s,
    }


def _from_doc(d: dict[str, Any]) -> ProfileRecord:
    try:
        profile = ContextProfile(
            context_id=d["context_id"],
            variants=tuple(
                VariantProfile(
                    variant=str(v["variant"]),
                    size_bytes=int(v["size_bytes"]),
                    quality=float(v["quality"]),
                    restore_s=float(v["restore_s"]),
                )
                for v in d["variants"]
            ),
            frequency=float(d["frequency"]),
            prefill_s=float(d["prefill_s"]),
            pinned=bool(d["pinned"]),
        )
        return ProfileRecord(
            profile=profile,
            evaluator=str(d["evaluator"]),
            query_source=str(d["query_source"]),
            num_queries=int(d["num_queries"]),
            num_tokens=int(d["num_tokens"]),
            repeated_requests=int(d.get("repeated_requests", 0)),  # absent before issue 13
            profiled_at_s=float(d["profiled_at_s"]),
            frequency_value=float(d["frequency_value"]),
            frequency_t_ref_s=float(d["frequency_t_ref_s"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptObjectError(f"profile of {d.get('context_id')!r} is malformed: {e}") from e
