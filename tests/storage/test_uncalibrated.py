"""A tier whose start-up calibration cannot time a read (issue 15) prices loads with its kind's
prior, never with a bandwidth of 0: generated from the tier registry, each kind is started
under a real condition that stops its calibration, and the TTFT model must get finite, positive
figures from it. The model itself refuses a bandwidth it cannot divide by.

How each kind is kept from calibrating (no mocks, no root):

* cpu: an arena smaller than the smallest copy the meter records;
* ssd: the tier runs in a child process whose RLIMIT_FSIZE (2 MiB) lets the 1 MiB probe file
  be written but not the large one - deterministic on any filesystem, unlike filling a disk
  (a small tmpfs needs root; tests/fault/test_small_ssd.py uses one where it can);
* remote: a cluster whose nodes have ``maxmemory`` below their use refuses the probe object;
* gpu: a pool smaller than the smallest copy the meter records (device machine only).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvtierd.config import TierConfig
from kvtierd.policies.model import UtilityTable
from kvtierd.storage import create_tier
from kvtierd.storage.base import TransferFit
from kvtierd.types import ContextProfile, TierModel, VariantProfile
from kvtierd.utility import check_tiers, load_ttft_s

KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Uncalibrated:
    fit: TransferFit
    prior: TransferFit
    error: str
    detail: str


async def _in_process(config: TierConfig) -> Uncalibrated:
    tier = create_tier(config)
    await tier.start()
    try:
        return Uncalibrated(
            tier.load_fit(), tier.read_prior, tier.calibration_error, tier.stats().detail
        )
    finally:
        await tier.close()


async def _cpu(tmp: Path, request: pytest.FixtureRequest) -> Uncalibrated:
    return await _in_process(
        TierConfig("cpu", "cpu", 256 * KiB, options={"staging_bytes": 256 * KiB})
    )


_SSD_CHILD = """
import asyncio, dataclasses, json, resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
from kvtierd.config import TierConfig
from kvtierd.storage.ssd import SsdTier
async def main(path):
    t = SsdTier(TierConfig("ssd", "ssd", 1 << 30, path, {"fsync": True}))
    await t.start()
    out = {"fit": dataclasses.asdict(t.load_fit()), "prior": dataclasses.asdict(t.read_prior),
           "error": t.calibration_error, "detail": t.stats().detail,
           "calibrated": t.calibrated}
    await t.close()
    print(json.dumps(out))
asyncio.run(main(sys.argv[1]))
"""


async def _ssd(tmp: Path, request: pytest.FixtureRequest) -> Uncalibrated:
    done = subprocess.run(
        [sys.executable, "-c", _SSD_CHILD, str(tmp / "ssd")],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert not out["calibrated"]
    assert "bandwidth not calibrated" in done.stderr  # logged, once
    assert done.stderr.count("bandwidth not calibrated") == 1
    return Uncalibrated(
        TransferFit(**out["fit"]), TransferFit(**out["prior"]), out["error"], out["detail"]
    )


async def _remote(tmp: Path, request: pytest.FixtureRequest) -> Uncalibrated:
    cluster = request.getfixturevalue("fresh_redis_cluster")
    for node in cluster.nodes:
        cluster.client(node.port).config_set("maxmemory", "1")  # below use: writes refused
    options = {"nodes": cluster.addresses, "namespace": "uncalibrated", "op_timeout_s": 5.0}
    return await _in_process(TierConfig("remote", "remote", 0, options=options))


async def _gpu(tmp: Path, request: pytest.FixtureRequest) -> Uncalibrated:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("gpu tier: no CUDA on this machine (run with -m gpu on the device machine)")
    return await _in_process(TierConfig("gpu", "gpu", 512 * KiB))


STARTS: dict[str, Callable[[Path, pytest.FixtureRequest], Awaitable[Uncalibrated]]] = {
    "cpu": _cpu,
    "ssd": _ssd,
    "remote": _remote,
    "gpu": _gpu,
}


async def test_an_uncalibrated_tier_prices_loads_with_its_prior(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind not in STARTS:
        pytest.fail(f"tier kind {kind!r} is registered but has no uncalibrated start in STARTS")
    got = await STARTS[kind](tmp_path, request)
    assert got.error, "the calibration should not have timed a read here"
    assert got.fit == got.prior and got.prior.bytes_per_s > 0 and got.prior.overhead_s >= 0
    assert "bandwidth not calibrated" in got.detail and got.error in got.detail
    assert "prior" in got.detail  # kvtierctl tiers says what the load model assumes
    # What the engine gives the placer (tier_models): a tier read into the arena, then copied.
    arena = TransferFit(0.0, 8e9)
    load = got.fit.then(arena)
    model = TierModel(kind, 1 << 30, load.bytes_per_s, load.overhead_s)
    check_tiers([model])
    ttft = float(load_ttft_s(np.array([MiB], np.float64), np.zeros(1), model)[0])
    assert math.isfinite(ttft) and 0 < ttft < 1.0
    profile = ContextProfile("c", (VariantProfile("none", MiB),), frequency=1.0, prefill_s=60.0)
    table = UtilityTable.from_profiles([profile], [model], alpha=1.0)
    assert np.isfinite(table.util).all()
    assert table.util[0, 0, 0] > table.drop_util[0]  # caching beats a 60 s recompute


@pytest.mark.parametrize(
    ("bandwidth", "overhead", "bad"),
    [(0.0, 0.0, "load_bandwidth"), (math.nan, 0.0, "load_bandwidth"),
     (math.inf, 0.0, "load_bandwidth"), (-1e9, 0.0, "load_bandwidth"),
     (1e9, math.nan, "load_overhead"), (1e9, -1.0, "load_overhead")],
)  # fmt: skip
def test_the_ttft_model_refuses_a_bandwidth_it_cannot_divide_by(bandwidth, overhead, bad):
    tier = TierModel("ssd", 1 << 30, bandwidth, overhead)
    with pytest.raises(ValueError, match=f"tier 'ssd': {bad}"):
        load_ttft_s(np.array([MiB], np.float64), np.zeros(1), tier)
    profile = ContextProfile("c", (VariantProfile("none", MiB),))
    with pytest.raises(ValueError, match=f"tier 'ssd': {bad}"):
        UtilityTable.from_profiles([profile], [tier], alpha=1.0)


@pytest.mark.parametrize("field", ["frequency", "prefill_s", "size_bytes", "quality"])
def test_the_utility_table_refuses_non_finite_inputs(field):
    tier = TierModel("cpu", 1 << 30, 1e9)
    values = {"size_bytes": MiB, "quality": 1.0, "frequency": 1.0, "prefill_s": 1.0}
    values[field] = math.nan
    profile = ContextProfile(
        "c", (VariantProfile("none", values["size_bytes"], values["quality"]),),
        frequency=values["frequency"], prefill_s=values["prefill_s"],
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"{field} must be finite"):
        UtilityTable.from_profiles([profile], [tier], alpha=1.0)
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        UtilityTable.from_profiles([ContextProfile("c", ())], [tier], alpha=0.0)
