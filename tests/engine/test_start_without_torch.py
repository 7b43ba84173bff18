"""A daemon starts without importing torch (issue 42: its import was ~2 s of every start,
also of daemons whose placer never profiles); the profiler imports it at its first profile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

START = """
import asyncio, sys
from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine

async def run():
    tiers = (TierConfig("cpu", "cpu", 1 << 20, options={"staging_bytes": "8MiB"}),)
    config = DaemonConfig(socket_path=sys.argv[1] + "/s", data_dir=sys.argv[1] + "/d",
                          tiers=tiers, policy_file=sys.argv[2])
    engine = Engine(config)
    await engine.start()
    try:
        print(engine.placing.name, engine.policy.estimator, "torch" in sys.modules)
    finally:
        await engine.close()

asyncio.run(run())
"""


@pytest.mark.parametrize(
    ("policy", "placer"), [("", "evicpress"), ("name: lru\nplacer: lru\n", "lru")]
)
def test_a_started_engine_has_not_imported_torch(tmp_path: Path, policy: str, placer: str):
    policy_file = ""
    if policy:
        (tmp_path / "policy.yaml").write_text(policy)
        policy_file = str(tmp_path / "policy.yaml")
    done = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path), policy_file],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [placer, "query_attention", "False"]
