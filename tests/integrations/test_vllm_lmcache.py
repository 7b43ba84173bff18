"""End-to-end on a real vLLM-CPU + LMCache + kvtierd daemon (issue 6, tests a, b, d).

One scenario, run once for the module, with two engine processes (each engine start costs
~10-45 s on this machine):

1. engine 1 stores context A (plugin ``durable``: an SSD copy too); the daemon is restarted;
2. engine 2 (a fresh process): A again -> every stored chunk hits, from the SSD tier (d), and
   the tokens are identical (a); context B with ``kvtierd_variant=int8`` stores int8 chunks,
   prefix cache reset, B again loads them (b); then the plugin corrupts what it loads and A
   again must change its tokens (a's negative control: the loaded KV is what vLLM uses);
   context C under two ``cache_salt`` values of one namespace (issue 41.2): the second salt
   reads nothing of the first's, the first salt reads its own chunks back.
3. load or recompute (issue 41): context S is stored, then every context is drained to a
   remote tier made slow on purpose (a one-node Redis Cluster behind a proxy that sleeps per
   block it returns, ``benchmarks/_support/throttled_proxy.py``, 1 MB/s); S again is
   recomputed (its lookup reports no chunk: the daemon predicts its load slower than its
   prefill), while context F, stored in the CPU tier, is loaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._support.daemon_proc import DaemonProcess, lookup_decisions, write_config
from benchmarks._support.throttled_proxy import throttled_redis
from kvtierd.client import KVClient
from kvtierd.integrations.salt import salt_key_prefix
from tests.integrations.harness import (
    CHUNK,
    INT8_TOLERANCE,
    first_token_logprob_diffs,
    lmcache_config,
    run_vllm,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CONTEXT_A = [10 + (7 * i) % 900 for i in range(70)]  # 4 full chunks of 16 + 6 tokens
CONTEXT_B = [20 + (13 * i) % 900 for i in range(50)]  # 3 full chunks
CONTEXT_C = [30 + (11 * i) % 900 for i in range(50)]  # 3 full chunks, asked under two salts
ALICE, BOB = "team-a:alice-secret", "team-a:bob-secret"  # one namespace, two users
CONTEXT_S = [30 + (17 * i) % 900 for i in range(70)]  # 4 full chunks, then on the slow tier
CONTEXT_F = [40 + (19 * i) % 900 for i in range(70)]  # 4 full chunks, in the CPU tier
RESET = {"op": "reset_prefix_cache"}
# The remote tier's link: a 16 KiB chunk (float32) takes ~16 ms, its 16 tokens' prefill at the
# daemon's prefill_tokens_per_s (5,000, nothing served teaches it here) 3.2 ms: recompute.
# A CPU-tier chunk loads in microseconds: load.
SLOW_BYTES_PER_S = 1e6


@pytest.fixture(scope="module")
def scenario(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("e2e")
    with throttled_redis(work / "redis", SLOW_BYTES_PER_S) as (address, _):
        yield from _scenario(tiny_model, work, address)


def _scenario(tiny_model: Path, work: Path, remote: str) -> Iterator[dict[str, Any]]:
    config = write_config(work / "daemon", cpu="64MiB", ssd="256MiB",
                          extra_tiers=[slow_remote_tier(remote)], metrics_port="any")  # fmt: skip
    sock = str(work / "daemon" / "kvtierd.sock")
    daemon = DaemonProcess(config, sock, work / "daemon" / "daemon.log").start()
    lm = lmcache_config(sock, durable=True)
    try:
        # float32: the int8 test bounds int8's own rounding by a constant, which holds on every
        # CPU only in float32 (in bfloat16 vLLM-CPU's arithmetic differs with and without
        # AVX-512, issue 25); the lossless tests are exact in any dtype.
        first = run_vllm(work, tiny_model, [gen("a1", CONTEXT_A)], lm, dtype="float32")
        daemon.stop()
        daemon = DaemonProcess(config, sock, work / "daemon" / "daemon.log").start()
        with KVClient(sock) as c:
            tiers_after_restart = {ctx.tier for ctx in c.contexts()}
        int8 = {"lmcache.tag.kvtierd_variant": "int8"}
        steps = [
            gen("a2", CONTEXT_A),
            # vLLM's own prefix cache keeps salts apart; reset it so that the same salt's
            # second request can only hit through LMCache and the plugin
            gen("c_alice1", CONTEXT_C, salt=ALICE),
            RESET,
            gen("c_bob1", CONTEXT_C, salt=BOB),
            RESET,
            gen("c_alice2", CONTEXT_C, salt=ALICE),
            gen("b1", CONTEXT_B, int8),
            RESET,
            gen("b2", CONTEXT_B, int8),
            RESET,
            {"op": "corrupt_next_get"},
            gen("a3", CONTEXT_A),
            # load or recompute (issue 41); loads from here on are corrupted: only the
            # plugin's counters and the daemon's decisions are asserted
            gen("s1", CONTEXT_S),
            {"op": "sync", "name": "slow"},  # every context moves to the throttled remote
            RESET,
            gen("s2", CONTEXT_S),
            gen("f1", CONTEXT_F),
            RESET,
            gen("f2", CONTEXT_F),
        ]
        second: dict[str, Any] = {}

        def run() -> None:
            try:
                # more steps than engine 1 and a sync: the sidecar test's budget
                second.update(run_vllm(work, tiny_model, steps, lm, dtype="float32",
                                       log_level="DEBUG", timeout_s=360))  # fmt: skip
            except BaseException as e:
                second["error"] = e

        vllm = threading.Thread(target=run)
        vllm.start()
        try:
            _reached(work, "slow", vllm)
            with KVClient(sock) as c:
                c.drain("cpu")
                c.drain("ssd")
                on_remote = {"tiers": [ctx.tier for ctx in c.contexts()]}
        finally:
            (work / "slow.go").touch()  # never leave vLLM waiting
            vllm.join(600)
        if "error" in second:
            raise second["error"]
        with KVClient(sock) as c:
            status = c.status()
            contexts = c.contexts()
        yield {**first, **second, "tiers_after_restart": tiers_after_restart, "status": status,
               "contexts": contexts, "on_remote": on_remote, "decisions": lookup_decisions(daemon),
               "vllm_log": Path(second["_log"]).read_text(errors="replace")}  # fmt: skip
    finally:
        daemon.kill()


def slow_remote_tier(address: str) -> dict[str, Any]:
    """The remote tier behind the throttled proxy (``throttled_proxy.py``): its start-up
    calibration reads 2 MiB through it, so the tier's read fit is the proxy's rate. A lookup
    may wait 2 s on it (not the default 50 ms): past its budget the tier's breaker counts
    what it holds as not found, and S's lookup would find nothing to decide on (seen at a
    load average of 50)."""
    return {"name": "remote", "kind": "remote", "capacity": 0,
            "options": {"nodes": [address], "namespace": "e2e", "value_bytes": "64KiB",
                        "op_timeout_s": 30.0, "lookup_budget_s": 2.0}}  # fmt: skip


def _reached(work: Path, name: str, vllm: threading.Thread, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not (work / f"{name}.reached").exists():
        if not vllm.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"vLLM did not reach sync step {name!r}")
        time.sleep(0.05)


def gen(
    name: str, prompt: list[int], params: dict[str, str] | None = None, salt: str | None = None
) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompt_ids": prompt, "max_tokens": 8,
            "logprobs": 5, "kv_transfer_params": params or {}, "cache_salt": salt}  # fmt: skip


def delta(scenario: dict[str, Any], before: str, after: str, counter: str) -> int:
    return int(scenario[after]["stats"][counter] - scenario[before]["stats"][counter])


def test_first_run_stores_every_full_chunk(scenario: dict[str, Any]) -> None:
    stats = scenario["a1"]["stats"]
    assert stats["errors"] == 0, stats["last_error"]
    assert stats["hit_chunks"] == 0
    assert stats["put_chunks"] == len(CONTEXT_A) // CHUNK


def test_context_survives_restart_on_ssd(scenario: dict[str, Any]) -> None:
    assert scenario["tiers_after_restart"] == {"ssd"}
    stats = scenario["a2"]["stats"]
    assert stats["hit_chunks"] == len(CONTEXT_A) // CHUNK
    assert stats["get_chunks"] == len(CONTEXT_A) // CHUNK
    assert scenario["status"].hits >= len(CONTEXT_A) // CHUNK


def test_lossless_hit_gives_identical_tokens(scenario: dict[str, Any]) -> None:
    # Once (local CI, 2026-11-29) the logprobs differed by 3.6e-3 with the same tokens, and a1's
    # counters read 2 lookups and 4 hits; both requests' counters are in the message.
    counters = {name: scenario[name]["stats"] for name in ("a1", "a2")}
    assert scenario["a2"]["stats"]["errors"] == 0, scenario["a2"]["stats"]["last_error"]
    assert scenario["a2"]["token_ids"] == scenario["a1"]["token_ids"], counters
    assert scenario["a2"]["logprobs"] == scenario["a1"]["logprobs"], counters


def test_corrupted_kv_changes_the_output(scenario: dict[str, Any]) -> None:
    before = scenario["b2"]["stats"]["get_chunks"]
    assert scenario["a3"]["stats"]["get_chunks"] == before + len(CONTEXT_A) // CHUNK
    assert scenario["a3"]["token_ids"] != scenario["a1"]["token_ids"]


def test_int8_variant_loads_and_stays_close(scenario: dict[str, Any]) -> None:
    b1, b2 = scenario["b1"], scenario["b2"]
    full_chunks = len(CONTEXT_B) // CHUNK
    assert b2["stats"]["errors"] == 0, b2["stats"]["last_error"]
    assert b2["stats"]["get_chunks"] - b1["stats"]["get_chunks"] == full_chunks
    assert b2["token_ids"][0] == b1["token_ids"][0]
    diffs = first_token_logprob_diffs(b1, b2)
    assert len(diffs) >= 3
    assert max(diffs) < INT8_TOLERANCE, diffs
    assert b2["logprobs"] != b1["logprobs"]  # int8 really was loaded (not the bf16 chunks)


def test_cache_salts_never_share_chunks(scenario: dict[str, Any]) -> None:
    """Issue 41.2: same prompt, another salt: no hit, no load, its own chunks stored."""
    full_chunks = len(CONTEXT_C) // CHUNK
    assert scenario["c_alice2"]["stats"]["errors"] == 0, scenario["c_alice2"]["stats"]
    assert delta(scenario, "a2", "c_alice1", "hit_chunks") == 0
    assert delta(scenario, "a2", "c_alice1", "put_chunks") == full_chunks
    assert delta(scenario, "c_alice1", "c_bob1", "lookups") >= 1
    assert delta(scenario, "c_alice1", "c_bob1", "hit_chunks") == 0
    assert delta(scenario, "c_alice1", "c_bob1", "get_chunks") == 0
    assert delta(scenario, "c_alice1", "c_bob1", "put_chunks") == full_chunks
    # The same salt shares: every full chunk of C read back, and the tokens are C's own.
    assert delta(scenario, "c_bob1", "c_alice2", "hit_chunks") == full_chunks
    assert delta(scenario, "c_bob1", "c_alice2", "get_chunks") == full_chunks
    assert scenario["c_alice2"]["token_ids"] == scenario["c_alice1"]["token_ids"]
    assert scenario["c_bob1"]["token_ids"] == scenario["c_alice1"]["token_ids"]


def test_cache_salts_have_their_own_daemon_contexts(scenario: dict[str, Any]) -> None:
    """The daemon holds C twice, once per salt, each in namespace team-a; only Alice's was
    read."""
    alice, bob = (salt_key_prefix(s) for s in (ALICE, BOB))
    assert alice.startswith("ns:team-a:") and bob.startswith("ns:team-a:") and alice != bob
    assert "alice-secret" not in alice  # the salt itself never reaches the daemon
    mine = {who: [c for c in scenario["contexts"] if c.context_id.startswith(prefix)]
            for who, prefix in (("alice", alice), ("bob", bob))}  # fmt: skip
    assert [c.objects for c in mine["alice"]] == [len(CONTEXT_C) // CHUNK]
    assert [c.objects for c in mine["bob"]] == [len(CONTEXT_C) // CHUNK]
    assert mine["alice"][0].hits >= 1  # its second request's read (a context's hits count reads)
    assert mine["bob"][0].hits == 0


def test_slow_tier_hit_recomputed_fast_tier_hit_loaded(scenario: dict[str, Any]) -> None:
    chunks = len(CONTEXT_S) // CHUNK
    assert scenario["on_remote"]["tiers"] == ["remote"] * len(scenario["on_remote"]["tiers"])
    s1, s2 = scenario["s1"]["stats"], scenario["s2"]["stats"]
    f1, f2 = scenario["f1"]["stats"], scenario["f2"]["stats"]
    for stats in (s2, f2):
        assert stats["errors"] == 0, stats["last_error"]
    # S is held (on the slow tier) but nothing of it is reported or loaded: recomputed
    assert (s2["hit_chunks"], s2["get_chunks"]) == (s1["hit_chunks"], s1["get_chunks"])
    assert s2["put_chunks"] == s1["put_chunks"]  # and not stored again: the daemon has it
    # F, in the CPU tier, is loaded whole
    assert f2["hit_chunks"] - f1["hit_chunks"] == chunks
    assert f2["get_chunks"] - f1["get_chunks"] == chunks
    assert scenario["decisions"]["recompute"] >= 1 and scenario["decisions"]["load"] >= 1
    log = scenario["vllm_log"]
    assert "kvtierd plugin: lookup recompute: 4 chunks found (remote)" in log
    assert "kvtierd plugin: lookup load: 4 chunks found (cpu)" in log
