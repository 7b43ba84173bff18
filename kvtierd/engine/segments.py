"""Contexts that form a tree (issue 29): which context a put joins, and splitting a context at
a branch (docs/integration.md, "Context ids").

LMCache keys every chunk by its whole prefix, so chunk keys alone tell where a prompt branches
off another: the put's first chunk follows the chunk ``after_key`` that a lookup hit. The rule
(:meth:`Segments.resolve`), for a put proposing a new context id:

* ``after_key`` is the **last** chunk of its context and no child of it branches there: the
  put extends that context (a longer prompt, or a request's next put under chunked prefill)
  and joins it; when a child already branches there, the put is another child;
* ``after_key`` is **inside** its context: the put branches off a shared prefix. That context
  is split after ``after_key``: it keeps the prefix (its id, its parent), its chunks after the
  branch point become a child context of their own, and the put's chunks a second child;
* no context holds ``after_key`` (or none was sent): the put starts a root context.

A context is split only while it is the original with nothing built on it (no daemon-made
variant, no reference copy, no durable hold, no operation in flight): a context stored in another
form keeps its chunks together, and the branch becomes a child of the whole context (still a
valid tree: the child's prefix is in its parent, only coarser).

The split is recorded in memory; the children a put creates carry ``parent_context_id`` in their
objects (and their persistent copies), so a restart keeps every branch's link. A split prefix
whose objects were on a persistent tier before the split is found whole again after a restart
(its old chunks still name it): its branches stay its children.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from kvtierd.engine.context_kv import SEPARATOR
from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling import ProfilingService
from kvtierd.engine.state import ContextRecord
from kvtierd.errors import InvalidArgumentError, NotFoundError
from kvtierd.policies.precedence import MAX_DEPTH
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where a put's chunks go: ``context_id`` below ``parent`` (``""``: a root)."""

    context_id: str
    parent: str


class Segments:
    """Resolves puts into the tree and splits contexts at branches (module docstring)."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        placing: Placing,
        executor: Executor,
        profiling: ProfilingService,
    ) -> None:
        self._index = index
        self._placing = placing
        self._executor = executor
        self._profiling = profiling
        self.splits = 0

    def resolve(self, tenant: str, proposed: str, after_key: str) -> Continuation:
        """Which context a put that proposes ``proposed`` and follows ``after_key`` joins
        (both scoped daemon-wide names; module docstring)."""
        index = self._index
        obj = index.owned(after_key, tenant) if after_key else None
        owner = index.contexts.get(obj.meta.context) if obj is not None else None
        if owner is None or after_key not in owner.keys:
            known = index.contexts.get(proposed)
            return Continuation(proposed, known.parent if known is not None else "")
        last = next(reversed(owner.keys)) == after_key
        if proposed == owner.context_id or (last and not self._continued_at(owner, after_key)):
            return Continuation(owner.context_id, owner.parent)
        if not last:
            self.split(owner, after_key)
        return Continuation(proposed, owner.context_id)

    def _continued_at(self, ctx: ContextRecord, key: str) -> bool:
        """Whether a child of ``ctx`` branches after its chunk ``key`` (``after_key`` ``""``:
        after the parent's last chunk, where it was when the child was made)."""
        last = next(reversed(ctx.keys), "")
        for kid_id in self._index.children.get(ctx.context_id, ()):
            kid = self._index.contexts.get(kid_id)
            if kid is not None and (kid.after_key or last) == key:
                return True
        return False

    def split(self, ctx: ContextRecord, after_key: str) -> str:
        """Split ``ctx`` after its chunk ``after_key`` when it can be (module docstring): its
        later chunks become a child context; returns that child's id, ``""`` when not split."""
        keys = list(ctx.keys)
        tail = keys[keys.index(after_key) + 1 :]
        if not tail or not self._splittable(ctx, tail):
            return ""
        index = self._index
        child_id = tail[0]  # a context's id is the key of its first chunk
        for key in tail:
            obj = index.objects[key]
            del ctx.keys[key]
            ctx.size_bytes -= obj.meta.size_bytes
            obj.meta = dataclasses.replace(
                obj.meta, context_id=child_id, parent_context_id=ctx.context_id
            )
            index.context_add(obj.meta, key)
        child = index.contexts[child_id]
        child.variant, child.hits, child.last_access_s = ctx.variant, ctx.hits, ctx.last_access_s
        index.set_parent(child, ctx.context_id, after_key)
        moved = set(tail)
        for kid_id in list(index.children.get(ctx.context_id, ())):
            kid = index.contexts.get(kid_id)
            # a child after the moved part, or after the end, continues the moved part now
            if kid is not None and (kid.after_key in moved or not kid.after_key):
                index.set_parent(kid, child_id, kid.after_key)
        self.splits += 1
        logger.info(
            "context %r branches after chunk %r: split, its %d later chunks are now context %r",
            ctx.context_id, after_key, len(tail), child_id,
        )  # fmt: skip
        for changed in (ctx, child):
            self._profiling.note_change(changed)
        self._executor.submit(self._placing.insert(ctx))
        self._executor.submit(self._placing.adopt_where_it_is(child))
        return child_id

    def _splittable(self, ctx: ContextRecord, tail: list[str]) -> bool:
        """Only an original context with nothing built on it, and no operation on it now."""
        return (
            ctx.variant == ORIGINAL_VARIANT
            and ctx.reference is None
            and ctx.marker is None
            and not ctx.durable_held
            and not ctx.lock.locked()
            and tail[0] not in self._index.contexts
            and not any(SEPARATOR in key for key in tail)
        )


def check_parent(index: ContextIndex, meta: ObjectMeta) -> None:
    """Refuse a put whose ``parent_context_id`` the daemon does not hold, that is another
    tenant's, or that would make a cycle or a chain deeper than ``MAX_DEPTH``."""
    parent_id = meta.parent_context_id
    if not parent_id:
        return
    parent = index.contexts.get(parent_id)
    if parent is None or parent.tenant != meta.tenant:
        raise NotFoundError(
            f"object {meta.key!r}: parent context {parent_id!r} is not held by the daemon "
            "(a parent must be stored first, by the same tenant)"
        )
    above = [parent_id, *index.ancestors(parent)]
    if meta.context in above:
        raise InvalidArgumentError(
            f"object {meta.key!r}: parent context {parent_id!r} would make a cycle: "
            f"{meta.context!r} is already above it"
        )
    if len(above) > MAX_DEPTH:
        raise InvalidArgumentError(
            f"object {meta.key!r}: parent context {parent_id!r} is {len(above) - 1} levels "
            f"deep; a context may be at most {MAX_DEPTH} levels below its root"
        )
