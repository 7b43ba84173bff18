"""Each profile's reading (issue 39, item 4) from the fields a profile file has always kept,
so it survives the store's JSON round trip and reads the same from files written before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtierd.profiler.store import ProfileReading, ProfileRecord, ProfileStore
from kvtierd.types import ContextProfile, VariantProfile


@pytest.mark.parametrize(
    ("evaluator", "source", "num_queries", "reading"),
    [
        ("query_attention", "initial", 0, ProfileReading.PRIOR),  # no model, no probes
        ("query_attention", "traffic", 0, ProfileReading.PRIOR),  # questions, but no model
        ("query_attention", "initial", 32, ProfileReading.FIRST_PUT),
        ("attention", "initial", 32, ProfileReading.FIRST_PUT),
        ("query_attention", "user", 2, ProfileReading.TRAFFIC),
        ("query_attention", "traffic", 1, ProfileReading.TRAFFIC),
        ("query_attention", "user+traffic", 3, ProfileReading.TRAFFIC),
        ("answer", "initial", 5, ProfileReading.REFINED),
        ("served", "traffic", 1, ProfileReading.REFINED),
    ],
)
def test_reading_survives_the_store(
    tmp_path: Path, evaluator: str, source: str, num_queries: int, reading: ProfileReading
) -> None:
    record = ProfileRecord(
        profile=ContextProfile("ctx", (VariantProfile("none", 10, 1.0),)),
        evaluator=evaluator, query_source=source, num_queries=num_queries, num_tokens=64,
        profiled_at_s=1.0,
    )  # fmt: skip
    assert record.reading is reading
    store = ProfileStore(tmp_path)
    store.save(record)
    (loaded,) = store.records()
    assert loaded.reading is reading
    # a file from before readings were named (and before repeated_requests) reads the same
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    doc.pop("repeated_requests")
    path.write_text(json.dumps(doc))
    (old,) = store.records()
    assert old.reading is reading
