"""Contexts that form a tree (issue 29): which context a put joins, and splitting a context at
a branch (docs/integration.md, "Context ids").

LMCache keys every chunk by its whole prefix, so chunk keys alone tell where a prompt branches
off another: the put's first chunk follows the chunk ``after_key`` that a lookup hit. The rule
(:meth:`TreeJoins.resolve`), for a put proposing a new context id:

* ``after_key`` is the **last** chunk of its context and no child of it branches there: the
  put extends that context (a longer prompt, or a request's next put under chunked prefill)
  and joins it; when a child already branches there, the put is another child;
* ``after_key`` is **inside** its context: the put branches off a shared prefix. That context
  is split after ``after_key``: it keeps the prefix (its id, its parent), its chunks after the
  branch point become a child context of their own, and the put's chunks a second child;
* no context holds ``after_key`` (or none was sent): the put starts a root context.

"Last" is by the order chunks were put, which a restart keeps: each chunk's position in its
context is in its persistent copies (``ObjectMeta.position``, issue 31), and a split leaves the
moved chunks their positions (they still order the child).

A context is split only while it is the original with nothing built on it (no daemon-made
variant, no reference copy, no durable hold, no operation in flight): a context stored in another
form keeps its chunks together, and the branch becomes a child of the whole context (still a
valid tree: the child's prefix is in its parent, only coarser).

The children a put creates carry ``parent_context_id`` in their objects (and their persistent
copies), so a restart keeps every branch's link. A split is made durable the same way: the
moved chunks' objects get the child's ``context_id`` and the prefix as ``parent_context_id``, the
children that followed them name the new child, and every persistent copy of those objects (an
SSD file's header, a remote header) is rewritten with them (``Tier.relabel``) before the put
that branched is advised, so a restart finds the prefix and its children as they were. A crash
in the middle (or a copy that cannot be rewritten, logged) leaves some moved chunks naming the
prefix: a restart finds them in the prefix's context, a coarser tree as every restart found
before splits were kept. Loads stay right whatever the grouping: LMCache keys each chunk by its
whole prefix and loads it only after that prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvtierd.engine.context_kv import SEPARATOR
from kvtierd.engine.executor import Executor
from kvtierd.engine.index import ContextIndex
from kvtierd.engine.placing import Placing
from kvtierd.engine.profiling.profiling_service import ProfilingService
from kvtierd.engine.state import ContextRecord
from kvtierd.errors import InvalidArgumentError, KvtierError, NotFoundError
from kvtierd.policies.tree_placement import MAX_DEPTH
from kvtierd.storage import Tier
from kvtierd.types import ORIGINAL_VARIANT, ObjectMeta

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TreePlace:
    """Where a put's chunks go: ``context_id`` below ``parent`` (``""``: a root)."""

    context_id: str
    parent: str


class TreeJoins:
    """Resolves puts into the tree and splits contexts at branches (module docstring)."""

    def __init__(
        self,
        *,
        index: ContextIndex,
        placing: Placing,
        executor: Executor,
        profiling: ProfilingService,
        tiers: Mapping[str, Tier],
    ) -> None:
        self._index = index
        self._placing = placing
        self._executor = executor
        self._profiling = profiling
        self._tiers = tiers
        self._unsaved: list[str] = []  # keys whose persistent copies name an old context
        self.splits = 0
        self.relabel_failures = 0

    async def resolve(
        self, tenant: str, proposed: str, after_key: str, *, save: bool = True
    ) -> TreePlace:
        """Which context a put that proposes ``proposed`` and follows ``after_key`` joins
        (both scoped daemon-wide names; module docstring); a split it made is on the
        persistent tiers when it returns, or, with ``save`` false, once :meth:`save` has
        returned (one Advise of many queries saves once, at its end: each split rewrote the
        moved chunks' files, and splits after chunks 0, 1, 2, ... moved the shrinking tail
        each time, N(N-1)/2 rewrites; issue 40.5)."""
        joins = self._resolve(tenant, proposed, after_key)
        if save:
            await self.save()
        return joins

    def _resolve(self, tenant: str, proposed: str, after_key: str) -> TreePlace:
        index = self._index
        obj = index.owned(after_key, tenant) if after_key else None
        owner = index.contexts.get(obj.meta.context) if obj is not None else None
        if owner is None or after_key not in owner.keys:
            known = index.contexts.get(proposed)
            return TreePlace(proposed, known.parent if known is not None else "")
        last = next(reversed(owner.keys)) == after_key
        if proposed == owner.context_id or (last and not self._continued_at(owner, after_key)):
            return TreePlace(owner.context_id, owner.parent)
        if not last:
            self.split(owner, after_key)
        return TreePlace(proposed, owner.context_id)

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
        if not tail or not self._splittable(ctx, tail) or not self._room_below(ctx, tail):
            return ""
        index = self._index
        child_id = tail[0]  # a context's id is the key of its first chunk
        for key in tail:
            obj = index.objects[key]
            ctx.keys.remove(key)
            ctx.size_bytes -= obj.meta.size_bytes
            obj.meta = obj.meta.replace(context_id=child_id, parent_context_id=ctx.context_id)
            index.context_add(obj.meta, key)
        child = index.contexts[child_id]
        # The reads so far were the whole context's: the child counts only its own from now
        # on (it inherited the parent's count, issue 41), but it was last used when it was.
        child.variant, child.last_access_s = ctx.variant, ctx.last_access_s
        index.set_parent(child, ctx.context_id, after_key)
        moved = set(tail)
        self._unsaved.extend(tail)
        for kid_id in list(index.children.get(ctx.context_id, ())):
            kid = index.contexts.get(kid_id)
            # a child after the moved part, or after the end, continues the moved part now
            if kid is not None and (kid.after_key in moved or not kid.after_key):
                index.set_parent(kid, child_id, kid.after_key)
                self._placing.relink(kid)  # the placer's tree follows the index's
                self._rename_parent(kid, child_id)
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

    def _rename_parent(self, kid: ContextRecord, parent: str) -> None:
        """``kid`` continues ``parent`` now: its objects say so (module docstring)."""
        for key in kid.keys:
            obj = self._index.objects[key]
            if obj.meta.parent_context_id != parent:
                obj.meta = obj.meta.replace(parent_context_id=parent)
                self._unsaved.append(key)

    async def save(self) -> None:
        """Rewrite the persistent copies of the objects splits gave a new identity, each once
        however many splits moved it since the last save. A copy that cannot be rewritten is
        logged and counted: the split holds in memory, and a restart finds that chunk with its
        old context (module docstring)."""
        while self._unsaved:
            batch = list(dict.fromkeys(self._unsaved))
            self._unsaved.clear()
            for key in batch:
                await self._save_one(key)

    async def _save_one(self, key: str) -> None:
        obj = self._index.objects.get(key)
        ctx = None if obj is None else self._index.contexts.get(obj.meta.context)
        if obj is None or ctx is None:
            return  # deleted meanwhile: nothing of it to find after a restart
        async with ctx.lock:  # no move or delete of the object meanwhile
            for name in dict.fromkeys((obj.tier, obj.shadow)):
                tier = self._tiers.get(name)
                if tier is None or not tier.persistent:
                    continue
                try:
                    await tier.relabel(obj.meta)
                except KvtierError as e:
                    self.relabel_failures += 1
                    logger.warning(
                        "object %r on tier %s: its new context %r is not written there "
                        "(a restart finds it in its old one): %s",
                        key, name, obj.meta.context, e,
                    )  # fmt: skip

    def _room_below(self, ctx: ContextRecord, tail: list[str]) -> bool:
        """Whether the split keeps the tree within ``MAX_DEPTH``: the new child is one level
        below ``ctx``, and the children after the moved part (with all below them) go one level
        down with it. Checked at put only, splits made chains of any depth, and then every
        rebalance failed for the whole daemon (issue 40.4). Not split, the branch is a child
        of the whole context (module docstring)."""
        index, moved = self._index, set(tail)
        level = [
            kid
            for kid in index.children.get(ctx.context_id, ())
            if (c := index.contexts.get(kid)) is not None
            and (c.after_key in moved or not c.after_key)
        ]
        depth = len(index.ancestors(ctx)) + 1  # the new child's; a root's is 0
        while level and depth <= MAX_DEPTH:
            depth += 1
            level = [k for kid in level for k in index.children.get(kid, ())]
        return depth <= MAX_DEPTH

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
