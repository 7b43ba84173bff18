"""Profiling queries per context: supplied by users, sampled from real traffic, or a local set.

EvicPress §4.3 profiles each context on ~50 questions that GPT-5 generated about its paragraphs,
then re-profiles on the newest real queries. kvtierd has no generator model, so a context is
profiled on (in this order of preference):

1. ``user`` queries — given through the API / ``kvtierctl`` (kept, at most ``max_user``);
2. ``traffic`` — the newest ``sample_size`` real queries seen for the context (a bounded window:
   drift means the *recent* distribution moved, so older queries must age out);
3. ``INITIAL_QUERIES`` — a fixed, context-agnostic local set, used only when 1 and 2 are empty.
   It is much weaker than the paper's generated questions: it probes summaries and recall in
   general and knows nothing about which facts the context holds.

Persisted as one JSON file per context (:class:`~kvtierd.profiler.files.JsonDir`). Thread-safe:
real queries arrive while the profiler runs on another thread (a profile through the serving
stack takes seconds to minutes), and must not wait for it.
"""

from __future__ import annotations

import os
import threading
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler.files import JsonDir
from kvtierd.profiler.quality import ProfilingQuery

INITIAL_QUERIES: tuple[ProfilingQuery, ...] = tuple(
    ProfilingQuery(text=t)
    for t in (
        "Summarize the text above in two sentences.",
        "What is the main topic of the text above?",
        "List the names, numbers and dates mentioned above.",
        "What is the last thing the text above says?",
        "What question does the text above answer?",
    )
)


@dataclass(slots=True)
class _Entry:
    user: list[ProfilingQuery]
    traffic: deque[ProfilingQuery]
    new_since_profile: int = 0
    changes: int = 0  # queries added or recorded since this process started (QueryStore.version)
    # The context's token ids, when a writer told us; packed (4 bytes an id: a tuple of
    # Python ints takes ~10x that, and the daemon bounds what a tenant registers in bytes).
    tokens: array[int] = field(default_factory=lambda: array("I"))


class QueryStore:
    """Queries per context (module docstring); ``directory=None`` keeps them in memory only."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        sample_size: int = 32,
        max_user: int = 256,
    ) -> None:
        if sample_size < 1 or max_user < 1:
            raise InvalidArgumentError(
                f"sample_size and max_user must be >= 1, got {sample_size}, {max_user}"
            )
        self.sample_size = sample_size
        self.max_user = max_user
        self._files = None if directory is None else JsonDir(directory)
        self._entries: dict[str, _Entry] = {}
        self._unsaved: set[str] = set()  # changed in memory only (``record(persist=False)``)
        self._lock = threading.RLock()

    def _entry(self, context_id: str) -> _Entry:
        e = self._entries.get(context_id)
        if e is None:
            e = self._entries[context_id] = _Entry([], deque(maxlen=self.sample_size))
        return e

    def add_user(self, context_id: str, queries: list[ProfilingQuery]) -> None:
        """Add user-supplied profiling queries (the oldest beyond ``max_user`` are dropped)."""
        with self._lock:
            e = self._entry(context_id)
            e.user = [*e.user, *queries][-self.max_user :]
            e.changes += 1
            self._save(context_id)

    def record(self, context_id: str, query: ProfilingQuery, *, persist: bool = True) -> None:
        """A real query for the context was served: keep it in the newest-queries window."""
        with self._lock:
            e = self._entry(context_id)
            e.traffic.append(query)
            e.new_since_profile += 1
            e.changes += 1
            if persist:
                self._save(context_id)
            else:
                self._unsaved.add(context_id)

    def set_tokens(self, context_id: str, tokens: Sequence[int]) -> None:
        """Record the token ids the context was computed from (the longest given wins: a
        context grows, and its first tokens never change)."""
        with self._lock:
            e = self._entry(context_id)
            if len(tokens) > len(e.tokens):
                e.tokens = array("I", tokens)
                self._save(context_id)

    def tokens(self, context_id: str, n: int) -> tuple[int, ...]:
        """The context's first ``n`` token ids, or ``()`` if fewer than ``n`` are known."""
        with self._lock:
            e = self._entries.get(context_id)
            return tuple(e.tokens[:n]) if e is not None and len(e.tokens) >= n else ()

    def known_tokens(self, context_id: str) -> int:
        """How many of the context's token ids a writer has registered."""
        with self._lock:
            e = self._entries.get(context_id)
            return 0 if e is None else len(e.tokens)

    def token_counts(self) -> dict[str, int]:
        """:meth:`known_tokens` of every context a writer registered ids for (a restart asks
        for all of them: one lock, not one per context, issue 42)."""
        with self._lock:
            return {cid: len(e.tokens) for cid, e in self._entries.items() if e.tokens}

    def profiling_set(self, context_id: str) -> tuple[str, tuple[ProfilingQuery, ...]]:
        """``(source, queries)`` to profile on: user + traffic, else the initial local set."""
        with self._lock:
            e = self._entries.get(context_id)
            if e is not None and (e.user or e.traffic):
                source = (
                    "user+traffic" if e.user and e.traffic else ("user" if e.user else "traffic")
                )
                return source, tuple(dict.fromkeys([*e.user, *e.traffic]))
            return "initial", INITIAL_QUERIES

    def repeated_requests(self, context_id: str, queries: Sequence[ProfilingQuery]) -> int:
        """How many requests of the traffic window ``queries`` stand for, when each of them was
        asked at least twice there; 0 when one was asked once or not at all. Traffic that
        repeats its questions is all scored by a profile on them, however few they are: no
        query was seen only once, so none of the traffic is estimated to be unseen (the
        Good-Turing estimate of the unseen share is the share of queries seen once)."""
        with self._lock:
            e = self._entries.get(context_id)
            counts = Counter(e.traffic) if e is not None else Counter[ProfilingQuery]()
        if not queries or any(counts[q] < 2 for q in queries):
            return 0
        return sum(counts[q] for q in queries)

    def recent(self, context_id: str) -> tuple[ProfilingQuery, ...]:
        """The newest real queries (the drift check's sample)."""
        with self._lock:
            e = self._entries.get(context_id)
            return tuple(e.traffic) if e is not None else ()

    def version(self, context_id: str) -> int:
        """Grows with every query added or recorded for the context (in this process): a
        profile tried on one version need not be tried again until it changes."""
        with self._lock:
            e = self._entries.get(context_id)
            return 0 if e is None else e.changes

    def new_since_profile(self, context_id: str) -> int:
        with self._lock:
            e = self._entries.get(context_id)
            return 0 if e is None else e.new_since_profile

    def mark_profiled(self, context_id: str) -> None:
        with self._lock:
            self._entry(context_id).new_since_profile = 0
            self._save(context_id)

    def drop_tokens(self, context_id: str) -> None:
        """Forget the context's token ids only (its queries stay)."""
        with self._lock:
            e = self._entries.get(context_id)
            if e is not None and len(e.tokens):
                e.tokens = array("I")
                self._save(context_id)

    def forget(self, context_id: str) -> None:
        with self._lock:
            self._entries.pop(context_id, None)
            self._unsaved.discard(context_id)
            if self._files is not None:
                self._files.delete(context_id)

    def flush(self) -> None:
        """Write what changed in memory only since it was last written (each file written at
        every stop took ~26 s of issue 42's stop at 1M puts, with one fsync a file)."""
        with self._lock:
            for cid in list(self._unsaved):  # a copy: _save takes each out
                self._save(cid)

    def load(self) -> int:
        """Read every persisted context back (after a restart); returns how many."""
        with self._lock:
            if self._files is None:
                return 0
            n = 0
            for doc in self._files.documents():
                e = self._entry(doc["context_id"])
                e.user = [_query(q) for q in doc.get("user", [])][-self.max_user :]
                e.traffic.extend(_query(q) for q in doc.get("traffic", []))
                e.new_since_profile = int(doc.get("new_since_profile", 0))
                e.tokens = array("I", (int(t) for t in doc.get("tokens", [])))
                n += 1
            return n

    def _save(self, context_id: str) -> None:
        self._unsaved.discard(context_id)
        if self._files is None:
            return
        e = self._entries[context_id]
        self._files.write(
            context_id,
            {
                "user": [_doc(q) for q in e.user],
                "traffic": [_doc(q) for q in e.traffic],
                "new_since_profile": e.new_since_profile,
                "tokens": list(e.tokens),
            },
        )


def _doc(q: ProfilingQuery) -> dict[str, object]:
    return {"text": q.text, "token_ids": list(q.token_ids)}


def _query(d: dict[str, object]) -> ProfilingQuery:
    ids = d.get("token_ids", [])
    return ProfilingQuery(
        text=str(d.get("text", "")),
        token_ids=tuple(int(i) for i in ids) if isinstance(ids, list) else (),
    )
