"""What ``sim_e2e.py`` reads off a measured ``bench_e2e`` run besides the calibration
(``e2e_calibration.py``), so that the simulator is given what the measured stack had (issue 30):
the KV dtype its vLLM kept, the tier sizes its daemons ran with, the way LMCache alone holds
its tiers, each fixed system's measured quality and what the EvicPress daemon's estimator
profiled."""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import yaml

from benchmarks.e2e.bench_e2e import DTYPE_BYTES, kv_bytes_per_token
from kvtierd.config import parse_size
from kvtierd.sim.given import GivenWorkload

KV_DTYPE = re.compile(r"kv_dtype=torch\.(\w+)")


def kv_dtype_bytes(out: Path, model: Path) -> int:
    """Bytes per KV element as the measured cached systems' vLLM kept them (LMCache's
    ``kv_dtype`` in ``<out>/work/<system>/vllm.log``: float32 on the AMX CPU of issue 26's
    runs, where sizing the contexts as bf16 halved them against the tiers), else what the
    stack would choose on this CPU (:func:`benchmarks.e2e.bench_e2e.kv_bytes_per_token`)."""
    for log in sorted(out.glob("work/*/vllm.log")):
        with log.open(errors="replace") as f:
            for line in f:
                if m := KV_DTYPE.search(line):
                    return DTYPE_BYTES[m.group(1)]
    layers_heads = kv_bytes_per_token(model, "float32") // 4
    return kv_bytes_per_token(model) // layers_heads


def measured_sizes(out: Path) -> dict[str, int] | None:
    """The tier capacities a measured kvtierd system ran with (its daemon's config under
    ``<out>/work``), ``None`` when no such system was measured."""
    for config in sorted(out.glob("work/*/daemon/kvtierd.yaml")):
        tiers = yaml.safe_load(config.read_text())["tiers"]
        return {t["name"]: parse_size(t["capacity"], str(config)) for t in tiers}
    return None


def inclusive(given: GivenWorkload) -> GivenWorkload:
    """``given`` as LMCache alone holds it: its storage manager puts every chunk into each
    backend (the CPU one and the disk one), so the disk holds the CPU's chunks too and adds
    only what it holds beyond them (issue 30: with both tiers apart the simulator gave LMCache
    34 hits where it measured 28 in issue 26's quiet run, as LRU measured with the same
    sizes)."""
    caps = dict(given.capacity_bytes)
    names = list(caps)
    if len(names) < 2 or any(caps[n] is None for n in names[:2]):
        return given
    first, second = names[0], names[1]
    caps[second] = max(0, int(caps[second] or 0) - int(caps[first] or 0))
    return replace(given, capacity_bytes=caps)


def measured_quality(out: Path) -> dict[str, float]:
    """Per variant, the similarity its ``fixed-<variant>`` system measured (``summary.json``)
    : the quality of contexts that neither ``--quality`` nor the calibration give one."""
    summary = out / "summary.json"
    rows = json.loads(summary.read_text()) if summary.exists() else {}
    return {name.removeprefix("fixed-"): float(r["similarity"]) for name, r in rows.items()
            if name.startswith("fixed-")}  # fmt: skip


def estimator_profiles(out: Path) -> dict[int, dict[str, float]]:
    """Per context length (its own tokens), the mean quality per variant that the measured
    daemons' estimator profiled (``<out>/work/<system>/daemon/data/profiler/profiles/``: one
    file per context, its ``num_tokens`` and ``variants``): what an EvicPress daemon's placer
    was offered and decided on. Beside a run without an EvicPress system, nothing (the
    simulator's placer then decides on the measured quality). The estimator gives contexts of
    one length nearly one figure (seed 2 of issue 30's matrix: int4 0.910-0.913 over 30
    contexts), and a context of the rebuilt workload is matched to the daemon's by its length,
    not by id: behind a shared prefix the daemon's ids split differently from the documents."""
    sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(out.glob("work/*/daemon/data/profiler/profiles/*.json")):
        profile = json.loads(path.read_text())
        for v in profile["variants"]:
            sums[int(profile["num_tokens"])][v["variant"]].append(float(v["quality"]))
    return {n: {v: statistics.fmean(qs) for v, qs in d.items()} for n, d in sums.items()}
