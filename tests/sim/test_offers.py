"""What the daemon lets a placer choose (``kvtierd/sim/offers.py``, issue 30): a compressed form
only under a trusted profile, a token-dropped one only once the router can serve it (until then
a composed form is stored as its quantization), each checked on a replay that differs without
the rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.calibration import parse_calibration
from kvtierd.sim.given import calibrated_prepare, calibrated_tiers, parse_workload
from kvtierd.sim.offers import OfferRule, Offers
from kvtierd.sim.replay import MISS, SimulationConfig, replay
from kvtierd.types import ContextProfile, VariantProfile

# 32 bytes of KV per token: a 1,000-token context is 32,000 bytes, int8 18,000 (0.5625)
MODEL = {"name": "toy", "layers": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 8,
         "active_params": 1e6, "max_context_tokens": 8192, "dtype_bytes": 2}  # fmt: skip
CALIBRATION = """\
prefill: {overhead_s: 0.1, seconds_per_token: 0.001}
tiers:
  - {name: cpu, overhead_s: 0.05, bandwidth_bytes_per_s: 320000}
quality: {int8: 0.99, keydiff@0.5: 0.9, keydiff@0.5+int8: 0.89}
"""


def served(
    placer: str, capacity: int, rule: OfferRule, requests: int = 4, shared: int = 0
) -> list[str]:
    """One 1,000-token context (the first ``shared`` a shared prefix) asked ``requests`` times,
    10 s apart: per request, the variant it was served as (``miss``: prefilled)."""
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": capacity}],
           "contexts": [{"tokens": 1000}], "shared_prefix_tokens": shared,
           "requests": [{"index": k, "at_s": 10.0 * k, "context": 0, "query_tokens": 10}
                        for k in range(requests)]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    cal = parse_calibration(CALIBRATION, "c.yaml", given.workload.model.kv_bytes_per_token)
    prep = calibrated_prepare(given, cal, ("int8", "keydiff@0.5", "keydiff@0.5+int8"))
    cfg = SimulationConfig(placer=placer, warmup_fraction=0.0, offers=rule,
                           tiers=calibrated_tiers(given, cal))  # fmt: skip
    done = replay(cfg, prep)
    names = prep.variants.names
    return [
        "miss" if t == MISS else names[v]
        for t, v in zip(done.tier_hit.tolist(), done.variant.tolist(), strict=True)
    ]


def test_a_token_dropped_form_is_served_once_the_router_can_serve_it() -> None:
    # the paper's model: the form from the first put
    assert served("fixed:keydiff@0.5", 10**6, OfferRule()) == ["miss"] + ["keydiff@0.5"] * 3
    # the daemon's: written after the second request fixed its tokens, served from the third
    got = served("fixed:keydiff@0.5", 10**6, OfferRule(servable_after_requests=2))
    assert got == ["miss", "none", "keydiff@0.5", "keydiff@0.5"]


def test_behind_a_shared_prefix_the_rules_apply_to_the_document() -> None:
    # the prefix is cached whole after the first request; the document's token-dropped form
    # is served from its third request, as without a prefix
    got = served("fixed:keydiff@0.5", 10**6, OfferRule(servable_after_requests=2), shared=256)
    assert got == ["miss", "none", "keydiff@0.5", "keydiff@0.5"]


def test_a_composed_form_is_stored_as_its_quantization_until_servable() -> None:
    # 20,000 bytes hold the int8 form (18,000), not the original (32,000): stored as its
    # quantization, the context is held from its first put; as the original it is not
    got = served("fixed:keydiff@0.5+int8", 20_000, OfferRule(servable_after_requests=2))
    assert got == ["miss"] + ["keydiff@0.5+int8"] * 3
    got = served("fixed:keydiff@0.5", 20_000, OfferRule(servable_after_requests=2))
    # the original fits nowhere, and a context whose bytes are gone has its tokens forgotten:
    # its token-dropped form never becomes servable
    assert got == ["miss"] * 4


def test_a_compressed_form_only_under_a_trusted_profile() -> None:
    # EvicPress: int8 fits the tier, the original does not. Profiled from the start, the
    # context is held int8 from its first put; unprofiled at its first put (the estimator runs
    # after it), it is placed as the original, which is dropped, and missed again
    assert served("evicpress", 20_000, OfferRule()) == ["miss", "int8", "int8", "int8"]
    got = served("evicpress", 20_000, OfferRule(trusted_after_requests=1))
    assert got == ["miss", "miss", "int8", "int8"]


def test_a_fixed_placer_needs_no_profile() -> None:
    assert served("fixed:int8", 20_000, OfferRule(trusted_after_requests=1))[1] == "int8"


def test_offers_forget_the_tokens_when_the_bytes_are_gone() -> None:
    variants = (VariantProfile("none", 100, 1.0), VariantProfile("knorm@0.5", 50, 0.9))
    profile = ContextProfile("c0", variants, 1.0, 1.0)
    offers = Offers(OfferRule(trusted_after_requests=1, servable_after_requests=1), "evicpress")
    assert [v.variant for v in offers.offered(profile).variants] == ["none"]
    offers.served("c0")
    assert offers.offered(profile) == profile
    offers.dropped("c0")  # the profile stays (set aside), the tokens are gone
    assert [v.variant for v in offers.offered(profile).variants] == ["none"]


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_offer_rule_refuses_what_is_not_a_count(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="servable_after_requests must be an integer"):
        OfferRule(servable_after_requests=bad)  # type: ignore[arg-type]


def test_default_config_offers_everything() -> None:
    assert replace(SimulationConfig()).offers == OfferRule()
