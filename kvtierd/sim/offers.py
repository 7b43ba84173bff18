"""Which of a context's variants the daemon lets its placer choose at a given request (issue 30).

The paper's simulator offers every profiled variant from a context's first put. The daemon
does not (measured beside ``bench_e2e``):

* **A compressed form only under a trusted profile** (``trusted_after_requests``): a context
  is profiled by the policy's estimator after its put has settled (``engine/profiling.py``);
  until then ``ContextOptions.profiled`` gives the placer nothing, so the context is placed as
  its original. The profile outlives a drop (``Profiler.set_aside``: a context stored again
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
  from int8): offered under its own name at the quantization's size (all tokens kept), and
  priced at its own size once servable. The simulator serves it at the form's quality and
  load throughout (a hit's load is a fixed cost on the measured stack).

``0`` for both (the defaults) is the paper's model: every variant from the first put.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvtierd.errors import InvalidArgumentError
from kvtierd.types import ORIGINAL_VARIANT, ContextProfile
from kvtierd.variants import parse_variant

PROFILE_READERS = ("evicpress",)
"""Placers whose choice follows a context's profile (the trust rule applies to them)."""


@dataclass(frozen=True, slots=True)
class OfferRule:
    """When a context's compressed (``trusted_after_requests``) and token-dropped
    (``servable_after_requests``) variants are offered: after that many of its requests
    (module docstring)."""

    trusted_after_requests: int = 0
    servable_after_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("trusted_after_requests", "servable_after_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")


DAEMON = OfferRule(trusted_after_requests=1, servable_after_requests=2)
"""What kvtierd's daemon lets its placer choose: a compressed form once the estimator has
profiled the context after its first put, a token-dropped one once two of its prompts fixed
the tokens the form covers (module docstring)."""


class Offers:
    """Per context, the requests it has had (ever, and since it was last stored) and so the
    profile its placer is offered now."""

    def __init__(self, rule: OfferRule, placer: str) -> None:
        self.rule = rule
        self._reads_profiles = placer.partition(":")[0] in PROFILE_READERS
        self._ever: dict[str, int] = {}
        self._stored: dict[str, int] = {}

    def served(self, context_id: str) -> None:
        """One more request of the context has been served."""
        self._ever[context_id] = self._ever.get(context_id, 0) + 1
        self._stored[context_id] = self._stored.get(context_id, 0) + 1

    def dropped(self, context_id: str) -> None:
        """The context's bytes are gone: the tokens its forms cover are forgotten."""
        self._stored[context_id] = 0

    def offered(self, profile: ContextProfile) -> ContextProfile:
        """``profile`` narrowed to the variants the daemon would let the placer choose now."""
        cid, rule = profile.context_id, self.rule
        trusted = not self._reads_profiles or self._ever.get(cid, 0) >= rule.trusted_after_requests
        servable = self._stored.get(cid, 0) >= rule.servable_after_requests
        keep = []
        for v in profile.variants:
            form = parse_variant(v.variant)
            if v.variant == ORIGINAL_VARIANT or (trusted and (servable or not form.drops_tokens)):
                keep.append(v)
            elif trusted and form.quant:  # stored as its quantization until servable
                keep.append(replace(v, size_bytes=math.ceil(v.size_bytes / form.ratio)))
        if keep == list(profile.variants):
            return profile
        return replace(profile, variants=tuple(keep))
