"""Token-dropped forms of contexts stored in chunks keep whole chunks, as the daemon sizes them
(``kvtierd/sim/variant_space.py``, ``shape``; a workload file's ``chunk_tokens``), and a composed
form offered before it can be served is priced at its quantization's own size."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.calibration import parse_calibration
from kvtierd.sim.given import calibrated_prepare, parse_workload
from kvtierd.sim.offers import DAEMON, Offers
from kvtierd.sim.variant_space import Form, shape
from kvtierd.types import ContextProfile, VariantProfile
from tests.sim.test_offers import CALIBRATION, MODEL

PER_TOKEN = 46_080.0  # SmolLM2-135M's KV in float32: 30 layers x 3 heads x 64 x 2 x 4 B


@pytest.mark.parametrize(
    ("variant", "kept"),
    [("keydiff@0.5", [512, 1024]), ("keydiff@0.75", [512, 1280]), ("knorm@0.25", [256, 512]),
     ("int8", [768, 1792])],
)  # fmt: skip
def test_in_chunks_a_token_dropped_form_keeps_whole_chunks(variant: str, kept: list[int]) -> None:
    # the daemon's profiles of seed 2 of issue 30's matrix: keydiff@0.5 of a 768-token context
    # 512 tokens, of a 1,792-token one 1,024 (23,592,960 B in float32 for knorm@0.25)
    tokens = np.array([768.0, 1792.0])
    got = shape(Form.of(variant), tokens, PER_TOKEN, 4, chunk_tokens=256)
    assert got.kept_tokens.tolist() == kept
    by_token = shape(Form.of(variant), tokens, PER_TOKEN, 4)  # the synthetic workloads' rule
    if variant != "int8":
        assert by_token.kept_tokens.tolist() != kept


def test_a_composed_form_in_chunks_is_the_daemons_size() -> None:
    # issue 26's fixed keydiff@0.5+int8 daemon: "compressed to keydiff@0.5+int8: 23224320 ->
    # 13271040 bytes" for a 1,792-token context (1,024 tokens kept, int8 with its scales)
    got = shape(Form.of("keydiff@0.5+int8"), np.array([1792.0]), PER_TOKEN, 4, chunk_tokens=256)
    assert got.size_bytes.tolist() == [13_271_040]
    int8 = shape(Form.of("int8"), np.array([1792.0]), PER_TOKEN, 4, chunk_tokens=256)
    assert int8.size_bytes.tolist() == [23_224_320]


def test_a_workload_file_says_its_chunks() -> None:
    doc = {"model": MODEL, "tiers": [{"name": "cpu", "capacity_bytes": 10**6}],
           "contexts": [{"tokens": 768}], "chunk_tokens": 256,
           "requests": [{"index": 0, "at_s": 0.0, "context": 0, "query_tokens": 10}]}  # fmt: skip
    given = parse_workload(doc, "w.json")
    prep = calibrated_prepare(given, parse_calibration(CALIBRATION, "c.yaml", 32), ["keydiff@0.5"])
    assert prep.variants.kept_tokens[0].tolist() == [768, 512]
    without = parse_workload({k: v for k, v in doc.items() if k != "chunk_tokens"}, "w.json")
    prep = calibrated_prepare(
        without, parse_calibration(CALIBRATION, "c.yaml", 32), ["keydiff@0.5"]
    )
    assert prep.variants.kept_tokens[0].tolist() == [768, 384]
    for bad in (0, True, 2.5):
        with pytest.raises(InvalidArgumentError, match="chunk_tokens"):
            parse_workload(doc | {"chunk_tokens": bad}, "w.json")


def test_before_it_is_servable_a_composed_form_is_priced_as_its_quantization() -> None:
    variants = (VariantProfile("none", 82_575_360, 1.0), VariantProfile("int8", 23_224_320, 1.0),
                VariantProfile("keydiff@0.5+int8", 13_271_040, 0.7))  # fmt: skip
    offers = Offers(DAEMON, "evicpress")
    offers.served("c0")  # trusted, not servable: the composed form is written as int8
    got = offers.offered(ContextProfile("c0", variants, 1.0, 1.0)).variant("keydiff@0.5+int8")
    assert got.size_bytes == 23_224_320  # not 13,271,040 / 0.5 = 26,542,080
    alone = Offers(DAEMON, "evicpress")  # no int8 in the profile: its size over its ratio
    alone.served("c0")
    profile = ContextProfile("c0", (variants[0], variants[2]), 1.0, 1.0)
    assert alone.offered(profile).variant("keydiff@0.5+int8").size_bytes == 26_542_080
