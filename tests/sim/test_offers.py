"""What the daemon lets a placer choose (``kvtierd/sim/offers.py``, issue 30): a compressed form
only under a trusted profile, a token-dropped one only once the router can serve it (until then
a composed form is stored as its quantization), of a compressed context only what its form can
make, and the variants the estimator profiled at the profile's quality (``given.py``), each
checked on a replay that differs without the rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.calibration import Calibration, parse_calibration
from kvtierd.sim.given import GivenWorkload, calibrated_prepare, calibrated_tiers, parse_workload
from kvtierd.sim.offers import DAEMON, OfferRule, Offers, can_make
from kvtierd.sim.replay import MISS, Prepared, SimulationConfig, replay, run_simulation
from kvtierd.types import ContextProfile, Placement, VariantProfile

# 32 bytes of KV per token: a 1,000-token context is 32,000 bytes, int8 18,000 (0.5625)
MODEL = {"name": "toy", "layers": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 8,
         "active_params": 1e6, "max_context_tokens": 8192, "dtype_bytes": 2}  # fmt: skip
CALIBRATION = """\
prefill: {overhead_s: 0.1, seconds_per_token: 0.001}
tiers:
  - {name: cpu, overhead_s: 0.05, bandwidth_bytes_per_s: 320000}
quality: {int8: 0.99, keydiff@0.5: 0.9, keydiff@0.5+int8: 0.89}
"""
GRID = ("int8", "keydiff@0.5", "keydiff@0.5+int8")


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
    prep = calibrated_prepare(given, cal, GRID)
    return _served_forms(placer, rule, given, cal, prep)


def _served_forms(
    placer: str, rule: OfferRule, given: GivenWorkload, cal: Calibration, prep: Prepared
) -> list[str]:
    """Replay ``prep`` under ``placer`` and ``rule``: per request, the variant it was served
    as (``miss``: prefilled)."""
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


def two_contexts(
    capacity: int, rule: OfferRule, grid: tuple[str, ...] = (*GRID, "int4")
) -> list[str]:
    """EvicPress (alpha 1) on two 1,000-token contexts asked A, B, A, A, 10 s apart, in one
    tier of ``capacity`` bytes: per request, the variant it was served as."""
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": capacity}],
           "contexts": [{"tokens": 1000}, {"tokens": 1000}],
           "requests": [{"index": k, "at_s": 10.0 * k, "context": c, "query_tokens": 10}
                        for k, c in enumerate([0, 1, 0, 0])]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    with_int4 = CALIBRATION.replace("int8: 0.99,", "int8: 0.99, int4: 0.9,")
    cal = parse_calibration(with_int4, "c.yaml", 32)
    prep = calibrated_prepare(given, cal, grid)
    return _served_forms("evicpress", rule, given, cal, prep)


def test_a_compressed_context_never_gets_a_finer_form_back() -> None:
    # 45,000 bytes: A (freq 2) is pushed to int4 (10,000) beside B whole (32,000); when A's
    # token-dropped forms become servable it is placed again. With the original at hand it
    # goes back to int8 (18,000, B compressed for it); the daemon, which keeps only A's int4
    # chunks (no unbounded tier for a reference copy), can make nothing finer from them
    paper = OfferRule(trusted_after_requests=1, servable_after_requests=2)
    assert two_contexts(45_000, paper) == ["miss", "miss", "int4", "int8"]
    assert two_contexts(45_000, replace(paper, original_kept=False)) == [
        "miss", "miss", "int4", "int4"]  # fmt: skip
    assert not DAEMON.original_kept


@pytest.mark.parametrize(
    ("form", "target", "made"),
    [("none", "knorm@0.5", True), ("int8", "int8", True), ("int8", "int4", True),
     ("int8", "keydiff@0.5+int8", True), ("int8", "keydiff@0.5+int4", True),
     ("int8", "none", False), ("int4", "int8", False), ("int8", "keydiff@0.5", False),
     ("keydiff@0.5", "keydiff@0.5+int8", False), ("keydiff@0.5+int8", "int4", False)],
)  # fmt: skip
def test_what_a_kept_form_can_make(form: str, target: str, made: bool) -> None:
    assert can_make(form, target) is made


def test_offers_follow_the_form_the_context_keeps() -> None:
    variants = tuple(VariantProfile(v, 100, 1.0) for v in ("none", "int8", "int4", "knorm@0.5"))
    profile = ContextProfile("c0", variants, 1.0, 1.0)
    offers = Offers(DAEMON, "evicpress")
    offers.served("c0")
    offers.served("c0")  # trusted and servable: everything
    assert offers.offered(profile) == profile
    assert offers.make("c0", "int8")
    assert [v.variant for v in offers.offered(profile).variants] == ["int8", "int4"]
    assert not offers.make("c0", "none")  # refused: the context stays int8
    assert offers.form("c0") == "int8"
    offers.dropped("c0")  # a put after the next miss brings the original again
    assert offers.form("c0") == "none"
    # an unbounded tier keeps a reference copy of every original: nothing is narrowed
    kept = Offers(DAEMON, "evicpress", reference_tier=True)
    kept.served("c0")
    kept.served("c0")
    assert kept.make("c0", "int4") and kept.make("c0", "none")
    assert kept.offered(profile) == profile


def test_a_composed_form_written_as_its_quantization_keeps_that() -> None:
    offers = Offers(DAEMON, "evicpress")
    offers.served("c0")  # trusted, not servable yet: keydiff@0.5+int8 is written as int8
    assert offers.make("c0", "keydiff@0.5+int8")
    assert offers.form("c0") == "int8"


def profiled(profile: dict[str, float] | None, own: dict[str, float] | None = None) -> object:
    """One 1,000-token context asked three times in a 15,000-byte tier (int4, 10,000 bytes,
    fits; int8, 18,000, does not); the calibration measured int8 only."""
    ctx: dict[str, object] = {"tokens": 1000, "quality": own or {}}
    if profile is not None:
        ctx["profile"] = profile
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": 15_000}],
           "contexts": [ctx],
           "requests": [{"index": k, "at_s": 10.0 * k, "context": 0, "query_tokens": 10}
                        for k in range(3)]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    cal = parse_calibration(CALIBRATION, "c.yaml", 32)
    prep = calibrated_prepare(given, cal, ("int8", "int4"))
    cfg = SimulationConfig(placer="evicpress", warmup_fraction=0.0,
                           tiers=calibrated_tiers(given, cal))  # fmt: skip
    return run_simulation(cfg, prep)


def test_the_placer_is_offered_what_the_estimator_profiled() -> None:
    # int4 has no measured quality: without a profile it is not offered, and nothing fits
    assert profiled(None).served_as() == ["miss"] * 3
    # the daemon's estimator profiled it (0.9): stored int4 and served from the second request
    # at the profile's quality, the only one known
    got = profiled({"none": 1.0, "int8": 1.0, "int4": 0.9})
    assert got.served_as() == ["miss", "cpu", "cpu"]
    assert got.quality.tolist() == [1.0, 0.9, 0.9]
    # a measured quality is what a request is served at; the placer still decides on the profile
    got = profiled({"none": 1.0, "int8": 1.0, "int4": 0.9}, own={"int4": 0.97})
    assert got.quality.tolist() == [1.0, 0.97, 0.97]


def test_a_profile_names_what_is_offered() -> None:
    # a profile without int8: the daemon's placer would not be offered it, measured or not
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": 10**6}],
           "contexts": [{"tokens": 1000, "profile": {"none": 1.0, "int4": 0.9}}],
           "requests": [{"index": 0, "at_s": 0.0, "context": 0, "query_tokens": 10}]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    prep = calibrated_prepare(given, parse_calibration(CALIBRATION, "c.yaml", 32), ("int8", "int4"))
    assert [v.variant for v in prep.profiles[0].variants] == ["none", "int4"]


@pytest.mark.parametrize("bad", [{"int4": 1.5}, {"int4": "high"}, ["int4"]])
def test_a_bad_profile_is_refused(bad: object) -> None:
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": 10**6}],
           "contexts": [{"tokens": 1000, "profile": bad}],
           "requests": [{"index": 0, "at_s": 0.0, "context": 0, "query_tokens": 10}]}  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"contexts\[0\].profile"):
        parse_workload(doc, "w.json")


def test_a_plan_for_a_form_that_cannot_be_made_leaves_the_kept_one_where_it_put_it() -> None:
    # three 1,000-token contexts asked 0, 2, 0, 1, 0, 0 in a 40,000-byte CPU tier over a
    # 10,000-byte SSD: c0 is held int4 in the SSD when c1's put has the placer plan it back to
    # int8 in the CPU tier. The daemon's executor cannot make int8 from int4 chunks: it moves
    # them there, and the placer adopts c0 as int4 (without the adoption the placer believes
    # it int8 and c0 is served so)
    calibration = CALIBRATION.replace("int8: 0.99,", "int8: 0.99, int4: 0.9,").replace(
        "320000}\n", "320000}\n  - {name: ssd, overhead_s: 0.2, bandwidth_bytes_per_s: 100000}\n"
    )
    doc = {"model": MODEL, "contexts": [{"tokens": 1000}] * 3,
           "tiers": [{"name": "cpu", "capacity_bytes": 40_000},
                     {"name": "ssd", "capacity_bytes": 10_000}],
           "requests": [{"index": k, "at_s": 10.0 * k, "context": c, "query_tokens": 10}
                        for k, c in enumerate([0, 2, 0, 1, 0, 0])]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    cal = parse_calibration(calibration, "c.yaml", 32)
    prep = calibrated_prepare(given, cal, (*GRID, "int4"))
    cfg = SimulationConfig(placer="evicpress", warmup_fraction=0.0, offers=DAEMON,
                           tiers=calibrated_tiers(given, cal))  # fmt: skip
    done = replay(cfg, prep)
    names, tiers = prep.variants.names, ("cpu", "ssd")
    got = ["miss" if t == MISS else f"{names[v]} in {tiers[t]}"
           for t, v in zip(done.tier_hit.tolist(), done.variant.tolist(), strict=True)]  # fmt: skip
    assert got == ["miss", "miss", "int4 in ssd", "miss", "int4 in cpu", "int4 in cpu"]
    assert done.placer.placement("c0") == Placement("int4", "cpu")


def test_a_drop_that_breaks_a_cycle_keeps_the_bytes() -> None:
    # plan_order takes a context out of a cycle with a drop the same plan places again; the
    # daemon's executor keeps its bytes meanwhile, so its form and servable tokens stay
    from typing import cast

    from kvtierd.policies.base import Placer
    from kvtierd.policies.plan_order import BREAK_CYCLE
    from kvtierd.sim.executing import ExecutingPlacer
    from kvtierd.types import Operation, OpKind, Plan

    int4 = Placement("int4", "ssd")
    plan = Plan((Operation(OpKind.DROP, "c0", int4, Placement("none", None), BREAK_CYCLE),
                 Operation(OpKind.PLACE, "c0", Placement("none", None), Placement("int4", "cpu"),
                           "move")))  # fmt: skip

    class Planned:
        def insert(self, profile: ContextProfile) -> Plan:
            return plan

    offers = Offers(DAEMON, "evicpress")
    offers.served("c0")
    offers.served("c0")
    assert offers.make("c0", "int4")
    variants = (VariantProfile("none", 100, 1.0), VariantProfile("int4", 30, 0.9),
                VariantProfile("keydiff@0.5+int4", 15, 0.8))  # fmt: skip
    profile = ContextProfile("c0", variants, 1.0, 1.0)
    executing = ExecutingPlacer(cast(Placer, Planned()), offers, lambda cid: profile)
    executing.insert(profile, 0.0)
    assert offers.form("c0") == "int4"
    # still servable (a real drop forgets the tokens: the composed form would be priced as
    # int4 until two more requests), and never the original again
    assert offers.offered(profile).variants == variants[1:]
