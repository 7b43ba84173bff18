"""Which of a context's variants the daemon lets its placer choose at a given request (issue 30).

The paper's simulator offers every profiled variant from a context's first put. The daemon
does not (measured beside ``bench_e2e``):

* **A compressed form only under a trusted profile** (``trusted_after_requests``): a context
  is profiled by the policy's estimator after its put has settled
  (``engine/profiling/profiling_service.py``); until then ``ContextOptions.profiled`` gives the
  placer nothing, so the context is placed as its original. The profile outlives a drop
  (``Profiler.set_aside``: a context stored again
  gets its kept profile back). Applies to placers that read profiles (EvicPress); a ``fixed``
  placer stores its policy's variant whatever the profile says.
* **A token-dropped form only once the router can serve it** (``servable_after_requests``):
  vLLM loads such a form only as ``[M placeholder ids] + suffix``, which the router finds by
  the digest of the context's tokens; the daemon fixes the tokens a form covers from the
  context's second registered prompt on (``engine/servable.py``: one prompt does not say where
  the document ends), and forgets them when the context's bytes are gone. So such a form is
  offered once the context has had that many requests since it was last stored. Applies to
  every placer (a ``fixed`` placer whose variant is not offered keeps the original). A form
  that also quantizes (``keydiff@0.5+int8``) is written as its quantization until then (the
  plugin quantizes on its side, ``engine/write_advice.py``; issue 26's fixed keydiff@0.5+int8
  daemon logged every context "compressed to keydiff@0.5+int8: 23224320 -> 13271040 bytes",
  from int8): offered under its own name at the quantization's size (all tokens kept: the
  profile's own quantized variant's, else its size over its kept ratio), and
  priced at its own size once servable. The simulator serves it at the form's quality and
  load throughout (a hit's load is a fixed cost on the measured stack).

* **A compressed context keeps only its compressed form** (``original_kept``): the daemon
  writes a variant in place of the original and keeps the original only as a reference copy
  in an unbounded tier (EvicPress's remote store, §4); without one (bench_e2e's CPU and SSD
  tiers) what it can make of a compressed context is its own form and, from a quantization
  that keeps every token (``int8``), the forms quantized the same or coarser (``int4``,
  ``keydiff@0.5+int8``): never the original again until the context is prefilled and put
  anew (``engine/index.py``: ``can_make``, ``derivable``). The placer is offered only those,
  and a plan made before it knew (a repair that gives another context its original back)
  leaves that context in the form it has, where the plan put it, adopted by the placer
  (``engine/executor.py``, ``_keep_form``; seed 2 of the matrix logged 22 such plans,
  ``planned as none, but only its int8 form is kept``). A token-dropped form keeps only
  itself.

``0`` for both counts and ``original_kept`` (the defaults) are the paper's model: every variant
from the first put, the original always at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvtierd.errors import InvalidArgumentError
from kvtierd.types import ORIGINAL_VARIANT, ContextProfile
from kvtierd.variants import QUANT_BITS, parse_variant

PROFILE_READERS = ("evicpress",)
"""Placers whose choice follows a context's profile (the trust rule applies to them)."""


@dataclass(frozen=True, slots=True)
class OfferRule:
    """When a context's compressed (``trusted_after_requests``) and token-dropped
    (``servable_after_requests``) variants are offered: after that many of its requests; and
    whether its original stays at hand once it is compressed (``original_kept``; else only
    where an unbounded tier keeps a reference copy) (module docstring)."""

    trusted_after_requests: int = 0
    servable_after_requests: int = 0
    original_kept: bool = True

    def __post_init__(self) -> None:
        for name in ("trusted_after_requests", "servable_after_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")


DAEMON = OfferRule(trusted_after_requests=1, servable_after_requests=2, original_kept=False)
"""What kvtierd's daemon lets its placer choose: a compressed form once the estimator has
profiled the context after its first put, a token-dropped one once two of its prompts fixed
the tokens the form covers, and of a compressed context only what its form can make (module
docstring)."""


def can_make(form: str, target: str) -> bool:
    """Whether a context kept only as ``form`` (no original at hand) can be stored as
    ``target``: itself, or from a quantization that keeps every token a form quantized the
    same or coarser (the daemon's ``engine/index.py``, ``derivable``)."""
    if form in (target, ORIGINAL_VARIANT):
        return True
    have, want = parse_variant(form), parse_variant(target)
    if have.drops_tokens or not have.quant or not want.quant:
        return False
    return QUANT_BITS[want.quant] <= QUANT_BITS[have.quant]


class Offers:
    """Per context, the requests it has had (ever, and since it was last stored) and the form
    its bytes are in, and so the profile its placer is offered now. ``reference_tier``: an
    unbounded tier keeps every compressed context's original (the daemon's reference copy)."""

    def __init__(self, rule: OfferRule, placer: str, reference_tier: bool = False) -> None:
        self.rule = rule
        self._reads_profiles = placer.partition(":")[0] in PROFILE_READERS
        self._original_kept = rule.original_kept or reference_tier
        self._ever: dict[str, int] = {}
        self._stored: dict[str, int] = {}
        self._form: dict[str, str] = {}  # absent: the original (as a put brings it)

    def served(self, context_id: str) -> None:
        """One more request of the context has been served."""
        self._ever[context_id] = self._ever.get(context_id, 0) + 1
        self._stored[context_id] = self._stored.get(context_id, 0) + 1

    def dropped(self, context_id: str) -> None:
        """The context's bytes are gone: the tokens its forms cover are forgotten, and the next
        put brings its original."""
        self._stored[context_id] = 0
        self._form.pop(context_id, None)

    def form(self, context_id: str) -> str:
        """The form the context's bytes are in."""
        return self._form.get(context_id, ORIGINAL_VARIANT)

    def make(self, context_id: str, variant: str) -> bool:
        """Store the context as ``variant`` if it can be made from what the context keeps;
        ``False`` leaves it as it is. A token-dropped form offered before it was servable is
        written as its quantization (module docstring): that is the form it keeps."""
        form = self.form(context_id)
        if not (self._original_kept or can_make(form, variant)):
            return False
        written = parse_variant(variant)
        if written.drops_tokens and written.quant and not self._servable(context_id):
            variant = written.quant
        if not self._original_kept:
            self._form[context_id] = variant
        return True

    def _servable(self, context_id: str) -> bool:
        return self._stored.get(context_id, 0) >= self.rule.servable_after_requests

    def offered(self, profile: ContextProfile) -> ContextProfile:
        """``profile`` narrowed to the variants the daemon would let the placer choose now."""
        cid, rule = profile.context_id, self.rule
        trusted = not self._reads_profiles or self._ever.get(cid, 0) >= rule.trusted_after_requests
        servable = self._servable(cid)
        have = self.form(cid)
        sizes = {v.variant: v.size_bytes for v in profile.variants}
        keep = []
        for v in profile.variants:
            if not (self._original_kept or can_make(have, v.variant)):
                continue  # its original is gone: only what its form makes (module docstring)
            form = parse_variant(v.variant)
            if v.variant in (ORIGINAL_VARIANT, have) or (
                trusted and (servable or not form.drops_tokens)
            ):
                keep.append(v)
            elif trusted and form.quant:  # stored as its quantization until servable
                quantized = sizes.get(form.quant) or math.ceil(v.size_bytes / form.ratio)
                keep.append(replace(v, size_bytes=quantized))
        if keep == list(profile.variants):
            return profile
        return replace(profile, variants=tuple(keep))
