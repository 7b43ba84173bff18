"""The placer interface and its registry.

A placer decides, for every context, its placement ``(variant, tier)`` or ``dropped``, and
answers each change with a :class:`~kvtierd.types.Plan` that the engine carries out. Placers
are pure Python + numpy (no torch): the engine owns bytes, the placer owns decisions.

Contract with the engine:

* the engine calls :meth:`Placer.insert` when a context is new or its profile changed (it grew,
  or was re-profiled) and executes the returned plan in order;
* :meth:`Placer.access` records a hit (recency/frequency) and may return a plan (promotion),
  never above the ``fastest`` tier the engine names (a quota full above it);
* :meth:`Placer.remove` forgets a context a client deleted;
* :meth:`Placer.rebalance` recomputes every placement from scratch (after re-profiling), never
  above the ``fastest`` tier the engine names for a context;
* executing a plan in order never puts a tier over its capacity.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from kvtierd.policies.model import OptionArrays
from kvtierd.policy_config import PolicyConfig, PolicyDocument
from kvtierd.registry import Registry
from kvtierd.types import DROPPED, ContextProfile, Placement, Plan, TierModel


@dataclass(frozen=True, slots=True)
class PlacerParams:
    """Knobs shared by placers; each placer reads the ones it needs.

    ``alpha`` is EvicPress's quality weight in 1/seconds (utility = (alpha*quality - ttft_s)
    * frequency); ``fixed_variant`` is the variant the ``fixed`` baseline applies (also given
    as ``fixed:<variant>`` to :func:`make_placer`); ``selection`` is the greedy's rule when a
    tier overflows: ``per_byte`` (least utility drop per byte freed) or ``absolute`` (least
    utility drop), see ``kvtierd/policies/greedy_state.py``.
    """

    alpha: float = 1.0
    fixed_variant: str = ""
    selection: str = "per_byte"


class Placer(abc.ABC):
    """Base of every placer; subclasses set ``name`` and are found by it in :data:`PLACERS`.

    A placer declares its own policy schema: the top-level keys of a policy document it reads
    (``policy_keys``) and how (:meth:`read_policy`); the loader
    (:mod:`kvtierd.policies.loader`) refuses any other key.
    """

    name: ClassVar[str]
    uses_quality: ClassVar[bool] = False
    """Whether the placer weighs the quality of a context's variants: only then are contexts
    profiled (a first profile, drift re-profiling); the others decide on sizes and use."""
    policy_keys: ClassVar[tuple[str, ...]] = ()
    policy_fields: ClassVar[tuple[str, ...]] = ()
    """The ``PolicyConfig`` attributes :meth:`read_policy` sets (``kvtierctl policy validate``
    shows them)."""

    @classmethod
    def read_policy(cls, doc: PolicyDocument, policy: PolicyConfig) -> PolicyConfig:
        """``policy`` (its name and description read) with what this placer's keys of ``doc``
        set; raises ``ConfigError`` naming the key and what is allowed. This default reads
        nothing: a placer without knobs."""
        return policy

    def __init__(self, tiers: Sequence[TierModel], params: PlacerParams | None = None) -> None:
        if not tiers:
            raise ValueError("a placer needs at least one tier")
        self.tiers: tuple[TierModel, ...] = tuple(tiers)
        self._configured = self.tiers  # as given: ``tiers`` is this less what is held back
        self.held_back = [0] * len(self.tiers)  # bytes of each tier kept free (hold_back)
        self.params = params or PlacerParams()
        # Contexts that continue another's prefix (issue 29): child -> parent, and back. A
        # placer that honours precedence (evicpress) reads them; the baselines ignore them.
        self.parents: dict[str, str] = {}
        self.children: dict[str, set[str]] = {}

    def link(self, child: str, parent: str) -> None:
        """Record that ``child`` is usable only while ``parent`` is cached (``""``: a root)."""
        self.unlink(child)
        if parent:
            self.parents[child] = parent
            self.children.setdefault(parent, set()).add(child)

    def unlink(self, child: str) -> None:
        old = self.parents.pop(child, "")
        if old:
            kids = self.children.get(old)
            if kids is not None:
                kids.discard(child)
                if not kids:
                    del self.children[old]

    @abc.abstractmethod
    def insert(self, profile: ContextProfile) -> Plan:
        """Place a new context, or re-place one whose profile changed."""

    @abc.abstractmethod
    def access(self, context_id: str, now_s: float, fastest: str = "") -> Plan:
        """Record a hit on a context; may return a plan (e.g. a promotion). ``fastest``: the
        fastest tier the context may be promoted into (``""``: any). The engine names one when
        the context's tenant or namespace quota is full in the tiers above it: a promotion
        there would move other contexts down to make room for one the quota keeps out."""

    @abc.abstractmethod
    def remove(self, context_id: str) -> None:
        """Forget a context whose bytes the engine already deleted."""

    @abc.abstractmethod
    def placement(self, context_id: str) -> Placement:
        """The context's current placement; raises ``KeyError`` for an unknown context."""

    def adopt(self, profile: ContextProfile, placement: Placement) -> Plan:
        """Record a context that already lives at ``placement`` (found when the daemon starts).

        Unlike :meth:`insert` it does not choose a placement; the returned plan only resolves
        an overflow. This default, for placers that cannot honour an existing placement,
        chooses one afresh (:meth:`insert`).
        """
        return self.insert(profile)

    def relearn(self, profile: ContextProfile, where: Placement) -> Plan:
        """A known context's options changed outside a plan (a compression that left no
        original to restore); its bytes are at ``where``. This default, for placers that keep
        no options between calls (each call reads the profile it is given), does nothing."""
        return Plan()

    def room_cost(self, tier: str, need_bytes: float) -> float:
        """The utility the placer would give up to fit ``need_bytes`` more in ``tier``; what
        write advice subtracts (engine/write_advice.py). This default, for placers that do
        not price utility, is 0."""
        return 0.0

    def used_bytes(self) -> list[float]:
        """Bytes the placer has placed in each tier, fastest first: what a decision's margin
        counts as taken (engine/margin.py). This default, for placers that keep no account
        of bytes, is none."""
        return [0.0] * len(self.tiers)

    @abc.abstractmethod
    def rebalance(
        self, profiles: Sequence[ContextProfile], fastest: Mapping[str, str] | None = None
    ) -> Plan:
        """Recompute all placements from these profiles (every known context is included).
        ``fastest``: per context, the fastest tier it may be placed in (the engine names one
        where its tenant's or namespace's quota is full above it); others may go anywhere."""

    def rebalance_options(
        self, options: OptionArrays, fastest: Mapping[str, str] | None = None
    ) -> Plan:
        """:meth:`rebalance` from arrays (the daemon's path). This default builds the profiles;
        a placer that prices arrays itself overrides it."""
        return self.rebalance(options.profiles(), fastest)

    def placements(self, context_ids: Sequence[str]) -> list[Placement]:
        """:meth:`placement` of each context, ``DROPPED`` for one the placer does not know
        (what the engine reconciles every context with after a rebalance)."""
        out = []
        for cid in context_ids:
            try:
                out.append(self.placement(cid))
            except KeyError:
                out.append(DROPPED)
        return out

    def refresh_tiers(self, tiers: Sequence[TierModel]) -> None:
        """Take the tiers' current load model (bandwidth, overhead: measured online) before a
        :meth:`rebalance`. Names and capacities must not change (that is a new placer)."""
        fresh = tuple(tiers)
        shape = [(t.name, t.capacity_bytes) for t in self._configured]
        if [(t.name, t.capacity_bytes) for t in fresh] != shape:
            raise ValueError(f"refresh_tiers: tiers must keep their names and capacities {shape}")
        self._configured = fresh
        self.tiers = self._less_held_back()

    def hold_back(self, tier: str, nbytes: int, *, plan: bool = True) -> Plan:
        """Keep ``nbytes`` of ``tier`` free of contexts from now on, in place of what was held
        back there before, and return the plan that frees them now. For a tier whose store
        takes more room than the bytes the placer counts: the CPU arena gives each object whole
        4 KiB blocks, and a CPU tier of 1-16 KiB objects filled its arena while the placer saw
        it within capacity, every put refused and no move planned (issue 42). Every placement
        and rebalance after this sees the tier ``nbytes`` smaller. ``plan=False`` only records
        it, for a caller about to rebalance (which places every context anew) or a placer that
        holds nothing yet: the plan would be worked out and thrown away."""
        names = [t.name for t in self._configured]
        if tier not in names:
            raise ValueError(f"hold_back: unknown tier {tier!r}; tiers: {', '.join(names)}")
        i = names.index(tier)
        if self._configured[i].capacity_bytes is None:
            raise ValueError(f"hold_back: tier {tier!r} is unbounded: nothing to hold back")
        self.held_back[i] = max(0, int(nbytes))
        self.tiers = self._less_held_back()
        return self._capacity_changed(i, plan)

    def _less_held_back(self) -> tuple[TierModel, ...]:
        return tuple(
            t if not held or t.capacity_bytes is None
            else replace(t, capacity_bytes=max(0, t.capacity_bytes - held))
            for t, held in zip(self._configured, self.held_back, strict=True)
        )  # fmt: skip

    def _capacity_changed(self, tier: int, plan: bool) -> Plan:
        """Take ``self.tiers`` after tier ``tier``'s capacity changed (:meth:`hold_back`)
        and, when ``plan``, return what brings every context within it. This default, for
        placers that keep no account of bytes, plans nothing."""
        return Plan()


PLACERS: Registry[Placer] = Registry(
    "placer",
    Placer,
    {
        "evicpress": "kvtierd.policies.evicpress:EvicPressPlacer",
        "lru": "kvtierd.policies.lru:LruPlacer",
        "lfu": "kvtierd.policies.baselines:LfuPlacer",
        "fixed": "kvtierd.policies.baselines:FixedPlacer",
        "prefill": "kvtierd.policies.baselines:PrefillPlacer",
    },
)
"""Placers by name (built-ins imported on first lookup; others register with
``PLACERS.register``)."""


def placer_class(spec: str) -> type[Placer]:
    """The placer of ``name`` or ``name:<argument>``; an unknown name lists the known ones."""
    return PLACERS.get(spec.split(":", 1)[0])


def make_placer(
    spec: str, tiers: Sequence[TierModel], params: PlacerParams | None = None
) -> Placer:
    """Build a placer from ``name`` or ``name:<argument>`` (``fixed:knorm@0.5``).

    The argument after the colon becomes ``params.fixed_variant``; only ``fixed`` takes one.
    """
    cls = placer_class(spec)
    params = params or PlacerParams()
    _, sep, arg = spec.partition(":")
    if sep:
        params = replace(params, fixed_variant=arg)
    return cls(tiers, params)
