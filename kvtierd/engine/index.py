"""The index of contexts and objects: which objects a context has, in which tier each is, and
the bytes each tenant is charged per tier. No I/O: the tier mover changes the bytes, then the
index. Everything here runs on the daemon's event loop."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvtierd import namespaces
from kvtierd.engine.context_kv import SEPARATOR
from kvtierd.engine.state import ContextRecord, ObjectRecord
from kvtierd.errors import CapacityError
from kvtierd.policies.tree_placement import MAX_DEPTH
from kvtierd.types import DROPPED, ORIGINAL_VARIANT, ObjectMeta, Placement
from kvtierd.variants import QUANT_BITS, parse_variant


class ContextIndex:
    """Objects by key, contexts by id, and who is charged for what (quotas)."""

    def __init__(
        self,
        quotas: Mapping[str, Mapping[str, int]] | None = None,
        namespace_quotas: Mapping[str, Mapping[str, Mapping[str, int]]] | None = None,
    ) -> None:
        self.objects: dict[str, ObjectRecord] = {}
        self.contexts: dict[str, ContextRecord] = {}
        # A daemon-made variant's marker key -> its context (the marker is no object of the
        # context's, but a client reads it: the router, by the digest of its tokens).
        self.marker_owner: dict[str, str] = {}
        # (tenant, tier) -> bytes charged: each object once, in the tier it is placed in
        # (a durable object's persistent copy under a faster tier is not charged again).
        self.usage: Counter[tuple[str, str]] = Counter()
        self.quotas = {tenant: dict(q) for tenant, q in (quotas or {}).items()}
        # Namespaces inside tenants (issue 41.2, kvtierd/namespaces.py): tenant -> configured
        # namespace -> its quota per tier, and (tenant, namespace, tier) -> bytes charged. An
        # object whose key names no configured namespace of its tenant is charged to none.
        self.namespace_quotas = {
            tenant: {name: dict(q) for name, q in spaces.items()}
            for tenant, spaces in (namespace_quotas or {}).items()
        }
        self.namespace_usage: Counter[tuple[str, str, str]] = Counter()
        # Contexts that form a tree (issue 29): parent id -> its children's ids.
        self.children: dict[str, set[str]] = {}

    # -- adding and removing -------------------------------------------------------------------

    def add(self, record: ObjectRecord, key: str = "", *, found: bool = False) -> ContextRecord:
        """Index an object (under ``key``, else its own key), charge it where it is, and add
        it to its context (made on its first object) after the context's last object. Its
        position there (``ObjectMeta.position``, kept with its persistent copies) is numbered
        here, unless its copy already has one past the context's last; ``found``: a copy found
        on a persistent tier at start keeps the position it has, even none (a file written
        before positions were kept): the engine adds those in their order (:func:`found_order`)."""
        if not found:
            record.meta = self.numbered(record.meta)
        meta = record.meta
        self.objects[key or meta.key] = record
        self.account(meta, record.tier, +1)
        return self.context_add(meta, key)

    def numbered(self, meta: ObjectMeta) -> ObjectMeta:
        """``meta`` with the position it gets joining its context now (itself when it has
        one past the context's last). A tier adopting a new object is given this one, so that
        the tier and the index share one ``ObjectMeta`` (issue 42: ~150 bytes an object). Its
        context id is then the context's own string, not the copy each put decodes (issue
        42: ~40 bytes an object, where interning every context id cost the same in the
        interpreter's table of interned strings)."""
        ctx = self.contexts.get(meta.context)
        next_at = ctx.next_position if ctx is not None else 0
        if meta.position is None or meta.position < next_at:
            if ctx is not None and meta.context_id == ctx.context_id:
                return meta.replace(position=next_at, context_id=ctx.context_id)
            return meta.replace(position=next_at)
        return meta

    def context_add(self, meta: ObjectMeta, key: str = "") -> ContextRecord:
        """Add an indexed object to its context, last (the caller numbered it)."""
        context_id = meta.context
        ctx = self.contexts.get(context_id)
        if ctx is None:
            ctx = self._new_context(meta)
            # Its size is its first object's, the same int object (not a new one from 0 + n:
            # 32 bytes a context, issue 42).
            ctx.size_bytes = meta.size_bytes
        else:
            ctx.size_bytes += meta.size_bytes
        ctx.keys.add(key or meta.key)
        position = meta.position
        if position is not None and position >= ctx.next_position:
            ctx.next_position = position + 1
        return ctx

    def _new_context(self, meta: ObjectMeta) -> ContextRecord:
        """The context ``meta`` is the first object of, indexed, below the parent it names
        when that is held (a restart: checked again)."""
        space = self.namespace_of(meta) if self.namespace_quotas else ""
        ctx = ContextRecord(meta.context, meta.variant, tenant=meta.tenant, namespace=space)
        self.contexts[ctx.context_id] = ctx
        if meta.parent_context_id:
            parent = self.contexts.get(meta.parent_context_id)
            if parent is not None and parent.tenant == ctx.tenant:
                self.set_parent(ctx, parent.context_id)
        return ctx

    def remove(self, key: str) -> ContextRecord:
        """Drop an object from the index (its bytes are already gone, or going) and from its
        context; a context left without objects leaves the index (the caller checks
        ``ctx.keys``)."""
        obj = self.objects.pop(key)
        ctx = self.contexts[obj.meta.context]
        ctx.keys.remove(key)
        ctx.size_bytes -= obj.meta.size_bytes
        if not ctx.keys:
            self.forget_context(ctx)
        return ctx

    def forget_context(self, ctx: ContextRecord) -> None:
        """Take a context out of the index (it has no objects left) with its links in the
        tree: its children become roots (their parent's KV is gone; a request recomputes it
        and the tree forms again, docs/integration.md "Context ids")."""
        if self.contexts.get(ctx.context_id) is ctx:
            del self.contexts[ctx.context_id]
        self.set_parent(ctx, "")
        for child in self.children.pop(ctx.context_id, set()):
            kid = self.contexts.get(child)
            if kid is not None:
                kid.parent, kid.after_key = "", ""

    def relink(self, named: Mapping[str, str] | None = None) -> None:
        """Link every root context whose objects name a parent that is held now (at start,
        objects are found in no particular order), unless the link would make a cycle (damaged
        files) or the parent is another tenant's. ``named``: context -> the parent its first
        object naming one names, when the caller kept them as it added the objects (a restart
        of 100,000 contexts, none of them in a tree, then passes over none of them)."""
        if named is None:
            named = {c.context_id: p for c in self.contexts.values()
                     if not c.parent and (p := self._parent_named(c))}  # fmt: skip
        if not named:
            return
        for ctx in self.contexts.values():  # in index order: which link of a cycle is refused
            if ctx.parent or ctx.context_id not in named:
                continue
            parent = self.contexts.get(named[ctx.context_id])
            if parent is None or parent.tenant != ctx.tenant:
                continue
            above = [parent.context_id, *self.ancestors(parent)]
            if ctx.context_id not in above and len(above) <= MAX_DEPTH:
                self.set_parent(ctx, parent.context_id)

    def _parent_named(self, ctx: ContextRecord) -> str:
        """The parent the context's first object naming one names (``""``: none does)."""
        return next((p for k in ctx.keys if (p := self.objects[k].meta.parent_context_id)), "")

    def set_parent(self, ctx: ContextRecord, parent: str, after_key: str = "") -> None:
        """Link ``ctx`` below ``parent`` (``""``: make it a root), after the parent's chunk
        ``after_key`` (``""``: its last). The caller has checked the link (tree_joins.py)."""
        if ctx.parent:
            kids = self.children.get(ctx.parent)
            if kids is not None:
                kids.discard(ctx.context_id)
                if not kids:
                    del self.children[ctx.parent]
        ctx.parent, ctx.after_key = parent, after_key
        if parent:
            self.children.setdefault(parent, set()).add(ctx.context_id)

    def token_drop_refused(self, ctx: ContextRecord) -> str:
        """Why the context may not be stored token-dropped (``""``: it may). A token-dropped
        form is served under a placeholder prompt from token 0 with its kept keys rotated to
        new positions (DESIGN.md §1): exact for a whole prompt prefix, not for a segment of a
        tree. A child's KV sits after all of its parent's tokens, at their positions (RoPE),
        and the router rewrites a prompt from its first token only; a parent's children were
        computed attending to every one of its tokens, at their positions. Quantization keeps
        every token at its position, so it stays allowed for both."""
        if ctx.parent:
            return (
                f"it continues context {ctx.parent!r}: its KV follows all of its parent's "
                "tokens at their positions (RoPE), and the router's placeholder rewrite "
                "starts at token 0; quantization (int8, int4) is allowed"
            )
        kids = len(self.children.get(ctx.context_id, ()))
        if kids:
            return (
                f"{kids} context(s) continue it: their KV was computed after every one of its "
                "tokens, at their positions (RoPE); dropping tokens here would leave them at "
                "the wrong positions; quantization (int8, int4) is allowed"
            )
        return ""

    def ancestors(self, ctx: ContextRecord) -> list[str]:
        """The ids above ``ctx``, parent first (links are checked acyclic when made)."""
        out: list[str] = []
        at = ctx
        while at.parent and len(out) <= MAX_DEPTH:
            out.append(at.parent)
            parent = self.contexts.get(at.parent)
            if parent is None:
                break
            at = parent
        return out

    def take_objects(self, ctx: ContextRecord) -> list[ObjectRecord]:
        """Take every object of a context out of the index, before their bytes are deleted: a
        reader on the event loop must never meet a key whose object is gone while the caller
        awaits the tiers' deletes (tests/daemon/test_index_consistency.py)."""
        gone = [self.objects.pop(key) for key in ctx.keys]
        ctx.keys.clear()
        ctx.size_bytes = 0
        return gone

    def account(self, meta: ObjectMeta, tier: str, sign: int) -> None:
        """Keep per-tenant bytes per tier (quotas) in step with where objects are charged:
        their placement, a variant's marker, the reference copy of an original."""
        self.usage[meta.tenant, tier] += sign * meta.size_bytes
        space = self.namespace_of(meta)
        if space:
            self.namespace_usage[meta.tenant, space, tier] += sign * meta.size_bytes

    def namespace_of(self, meta: ObjectMeta) -> str:
        """The configured namespace of its tenant an object's key names (``""``: none)."""
        spaces = self.namespace_quotas.get(meta.tenant)
        if not spaces:
            return ""
        key = meta.key.removeprefix(f"{meta.tenant}/") if meta.tenant else meta.key
        name = namespaces.named_in(key)
        return name if name in spaces else ""

    # -- questions -----------------------------------------------------------------------------

    def owned(self, key: str, tenant: str) -> ObjectRecord | None:
        """The object under ``key`` if it belongs to ``tenant``: keys are scoped by tenant,
        but a default-tenant object stored as ``A/...`` before tenant ``A`` was configured
        must not become tenant ``A``'s."""
        obj = self.record_of(key)
        return obj if obj is not None and obj.meta.tenant == tenant else None

    def owned_all(self, keys: Sequence[str], tenant: str) -> list[ObjectRecord | None]:
        """:meth:`owned` of each key, in one pass: a Lookup names up to thousands, and two calls
        a key were a fifth of its time. A key found in the dict as the tenant's is taken as it
        is; any other goes the whole way (markers, another tenant's object)."""
        get = self.objects.get
        return [
            obj if (obj := get(k)) is not None and obj.meta.tenant == tenant
            else self.owned(k, tenant)
            for k in keys
        ]  # fmt: skip

    def record_of(self, key: str) -> ObjectRecord | None:
        """The object under ``key``: a context's, or a daemon-made variant's marker (no
        object of its context, but the router reads it)."""
        obj = self.objects.get(key)
        if obj is not None or key not in self.marker_owner:
            return obj
        ctx = self.contexts.get(self.marker_owner[key])
        if ctx is None or ctx.marker is None or ctx.marker[0].key != key:
            return None
        return ObjectRecord(*ctx.marker)

    def placement_of(self, ctx: ContextRecord) -> Placement:
        """Where the context's bytes are (its first object's tier; moves keep them together)."""
        if not ctx.keys:
            return DROPPED
        return Placement(ctx.variant, self.objects[next(iter(ctx.keys))].tier)

    def unread_durable(self, ctx: ContextRecord) -> int:
        """How many of the context's objects are durable and not read yet (durable.py)."""
        return sum(1 for k in ctx.keys if self.objects[k].unread)

    def added_in_form(self, ctx: ContextRecord) -> list[str]:
        """Keys of the objects a client added to a compressed context in its compressed form
        (the LMCache plugin quantizes a longer prompt's new chunks on its device when the
        write advice says int8). They have no original in the reference copy, so they are read
        as they are stored (decoded by their layout): a re-compression re-encodes them with
        the rest, and restoring the original drops them (LMCache recomputes them). Not the
        suffix chunks of requests served from a token-dropped variant: their KV follows the
        placeholders, not the original, so nothing can be built from them."""
        ref = {m.key for m, _ in ctx.reference or ()}
        metas = {k: self.objects[k].meta for k in ctx.keys if k not in ref}
        unusable = [SEPARATOR in m.key or parse_variant(m.variant).drops_tokens
                    for m in metas.values()]  # fmt: skip
        return [k for k, skip in zip(metas, unusable, strict=True) if not skip]

    def sources(self, ctx: ContextRecord) -> list[ObjectRecord]:
        """The objects the context's variants are made from, in order (none: it has no
        source, and keeps the form it has): its own objects while it is stored as the
        original; else the reference copy of its original plus the chunks a client added later
        in the compressed form (they have no original); else, stored only quantized (int8,
        int4: every token kept), its own objects, which dequantize to a full-length KV — for
        the variants :func:`derivable` from that form (:meth:`can_make`)."""
        if ctx.variant == ORIGINAL_VARIANT or self.self_sourced(ctx):
            return [self.objects[k] for k in ctx.keys]
        if not ctx.reference:
            return []  # a token-dropped form: the tokens it dropped are gone
        added = [self.objects[k] for k in self.added_in_form(ctx)]
        return [*(ObjectRecord(m, t) for m, t in ctx.reference), *added]

    def self_sourced(self, ctx: ContextRecord) -> bool:
        """Whether the context is its own source though it is not the original: stored only
        quantized, with no reference copy of its original (no unbounded tier)."""
        return (
            ctx.variant != ORIGINAL_VARIANT
            and not ctx.reference
            and not parse_variant(ctx.variant).drops_tokens
        )

    def can_make(self, ctx: ContextRecord, variant: str) -> bool:
        """Whether the executor can store the context as ``variant`` from what it keeps: any
        variant from its original (stored or a reference copy); from its own quantized
        chunks only those :func:`derivable` from them; nothing else from a token-dropped form."""
        if ctx.variant in (variant, ORIGINAL_VARIANT) or ctx.reference:
            return True
        return self.self_sourced(ctx) and derivable(ctx.variant, variant)

    # -- quotas --------------------------------------------------------------------------------

    def check_quota(
        self,
        metas: Sequence[ObjectMeta],
        in_flight: Mapping[str, int],
        in_flight_spaces: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        """A tenant's objects (stored, ``in_flight`` bytes being put, and ``metas``) stay
        within the sum of its tier quotas, and a configured namespace's (stored,
        ``in_flight_spaces`` bytes being put by ``(tenant, namespace)``, and ``metas``) within
        the sum of its own: counted only once stored, puts that allocate together were each
        let in, and the executor then dropped what no tier's quota had room for."""
        asked: Counter[str] = Counter()
        for meta in metas:
            asked[meta.tenant] += meta.size_bytes
        for (tenant, space), nbytes in self.namespace_bytes(metas).items():
            limits = self.namespace_quotas[tenant][space]
            if not limits:
                continue
            total = sum(limits.values())
            held = sum(v for (t, n, _), v in self.namespace_usage.items()
                       if t == tenant and n == space)  # fmt: skip
            held += (in_flight_spaces or {}).get((tenant, space), 0)
            if held + nbytes > total:
                raise CapacityError(
                    f"namespace {space!r} of tenant {tenant!r} quota exceeded: {held} bytes "
                    f"stored or being put, {nbytes} more asked, quota {total} bytes over tiers "
                    f"{', '.join(limits)}"
                )
        for tenant, nbytes in asked.items():
            quota = self.quotas.get(tenant)
            if not quota:
                continue
            total = sum(quota.values())
            held = sum(v for (t, _), v in self.usage.items() if t == tenant)
            held += in_flight.get(tenant, 0)
            if held + nbytes > total:
                raise CapacityError(
                    f"tenant {tenant!r} quota exceeded: {held} bytes stored or being put, "
                    f"{nbytes} more asked, quota {total} bytes over tiers {', '.join(quota)}"
                )

    @property
    def has_quotas(self) -> bool:
        """Whether any tenant or namespace has a quota (else every tier is open to all)."""
        return bool(self.quotas) or any(self.namespace_quotas.values())

    def namespace_bytes(self, metas: Iterable[ObjectMeta]) -> Counter[tuple[str, str]]:
        """The bytes of ``metas`` per ``(tenant, configured namespace)`` (others left out)."""
        out: Counter[tuple[str, str]] = Counter()
        for meta in metas:
            space = self.namespace_of(meta)
            if space:
                out[meta.tenant, space] += meta.size_bytes
        return out

    def quota_tier(
        self, ctx: ContextRecord, wanted: str, tiers: Sequence[str], size_bytes: int | None = None
    ) -> str | None:
        """The first tier of ``tiers`` from ``wanted`` down where the context fits its tenant's
        and namespace's quotas (``None``: nowhere, drop it), at ``size_bytes`` (a form it is
        about to take; ``None``: its size now). Tiers without a quota are unlimited."""
        for name in tiers[tiers.index(wanted) :]:
            if self._fits(ctx, name, size_bytes):
                return name
        return None

    def _fits(self, ctx: ContextRecord, tier: str, size_bytes: int | None = None) -> bool:
        """Whether the context, at ``size_bytes`` (``None``: as it is), fits its tenant's quota
        in ``tier``, and its namespace's."""
        quota = self.quotas.get(ctx.tenant)
        limit = quota.get(tier) if quota else None
        if limit is not None:
            here = sum(
                self.objects[k].meta.size_bytes for k in ctx.keys if self.objects[k].tier == tier
            )
            size = ctx.size_bytes if size_bytes is None else size_bytes
            if self.usage[ctx.tenant, tier] - here + size > limit:
                return False
        space = ctx.namespace
        limit = self.namespace_quotas.get(ctx.tenant, {}).get(space, {}).get(tier)
        if not space or limit is None:
            return True
        mine = [
            self.objects[k] for k in ctx.keys if self.namespace_of(self.objects[k].meta) == space
        ]
        here = sum(o.meta.size_bytes for o in mine if o.tier == tier)
        size = sum(o.meta.size_bytes for o in mine) if size_bytes is None else size_bytes
        return self.namespace_usage[ctx.tenant, space, tier] - here + size <= limit

    def namespace_rows(self, tiers: Sequence[str]) -> list[tuple[str, str, str, int, int | None]]:
        """(tenant, namespace, tier, bytes charged, quota or ``None``) of every configured
        namespace and tier (the metrics' rows: only configured names, so a client cannot
        make label values)."""
        return [
            (tenant, space, tier, self.namespace_usage[tenant, space, tier], quota.get(tier))
            for tenant, spaces in self.namespace_quotas.items()
            for space, quota in spaces.items()
            for tier in tiers
        ]


def derivable(source: str, target: str) -> bool:
    """Whether ``target`` is made from a context stored only as the quantization-only
    ``source`` (``int8``): a variant quantized the same or coarser (``int4``,
    ``keydiff@0.5+int8``). Not the original, which the quantization lost, nor a finer form
    (``knorm@0.5``): it would spend bytes on precision the source no longer has."""
    have = QUANT_BITS.get(parse_variant(source).quant)
    want = QUANT_BITS.get(parse_variant(target).quant)
    return have is not None and want is not None and want <= have


def found_order(meta: ObjectMeta) -> tuple[bool, int, str]:
    """The order in which objects found on the persistent tiers at start join their contexts
    (sort by it): by position, the order they were put (issue 31). An object without one was
    written before positions were kept, so before any that has one: those come first, in key
    order, which is deterministic but not the order they were put (LMCache keys a chunk by a
    hash of its prefix). Two with one position go in key order (each on another tier: a tier
    refuses two of its own, ``ssd_format.duplicate_positions``)."""
    return (meta.position is not None, meta.position or 0, meta.key)
