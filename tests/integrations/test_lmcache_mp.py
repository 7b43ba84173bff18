"""kvtierd behind vLLM's ``--kv-offloading-backend lmcache``: the L2 adapter of LMCache's
multiprocess server (``kvtierd/integrations/lmcache_l2.py``), and the whole path with the real
model through ``kvtierd stack --integration offloading`` (docs/integration.md)."""

from __future__ import annotations

import json
import select
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")

from kvtierd.client import KVClient
from kvtierd.integrations.lmcache_l2 import (
    KvtierdL2Adapter,
    KvtierdL2AdapterConfig,
    daemon_key,
)
from kvtierd.integrations.salt import salt_key_prefix

CHUNK_BYTES = 3 * 1000  # odd-sized chunks: a load that copies the wrong span shows


def _obj(values: Any) -> Any:
    """An L1 buffer as LMCache's server hands it to an adapter: a ``TensorMemoryObj``."""
    import torch
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = torch.as_tensor(values, dtype=torch.uint8).clone()
    meta = MemoryObjMetadata(shape=raw.shape, dtype=torch.uint8, address=0,
                             phy_size=raw.numel(), ref_count=1)  # fmt: skip
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def _key(i: int, salt: str = "") -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=bytes([i]) * 16, model_name="org/model", kv_rank=0,
                     cache_salt=salt)  # fmt: skip


def _wait(adapter: KvtierdL2Adapter, fd: int, poll: Any, timeout_s: float = 30) -> Any:
    """The task's result once its event fd fires, as the server's controllers wait for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        select.select([fd], [], [], 0.5)
        result = poll()
        if result:
            return result
    raise AssertionError(f"no result within {timeout_s} s")


def _bits(bitmap: Any, n: int) -> list[int]:
    return [int(bitmap.test(i)) for i in range(n)]


def test_adapter_stores_finds_and_loads_chunks_through_the_daemon(start_daemon: Any) -> None:
    import torch

    daemon = start_daemon()
    adapter = KvtierdL2Adapter(KvtierdL2AdapterConfig(socket_path=daemon.socket_path))
    try:
        chunks = [torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8) for _ in range(3)]
        keys = [_key(i) for i in range(3)]
        task = adapter.submit_store_task(keys, [_obj(c) for c in chunks])
        done = _wait(adapter, adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
        assert done[task].is_successful() and done[task].bytes_transferred() == 3 * CHUNK_BYTES

        # the same chunk under another user's salt is another object; a fourth was never stored
        asked = [*keys, _key(0, salt="alice"), _key(9)]
        task = adapter.submit_lookup_and_lock_task(asked, {})
        fd = adapter.get_lookup_and_lock_event_fd()
        found = _wait(adapter, fd, lambda: adapter.query_lookup_and_lock_result(task))
        assert _bits(found, 5) == [1, 1, 1, 0, 0]
        adapter.submit_unlock(asked)

        out = [_obj(torch.zeros(CHUNK_BYTES, dtype=torch.uint8)) for _ in range(4)]
        task = adapter.submit_load_task([keys[2], _key(9), keys[0], keys[1]], out)
        fd = adapter.get_load_event_fd()
        loaded = _wait(adapter, fd, lambda: adapter.query_load_result(task))
        assert _bits(loaded, 4) == [1, 0, 1, 1]
        assert torch.equal(out[0].raw_tensor, chunks[2])
        assert torch.equal(out[2].raw_tensor, chunks[0])
        assert torch.equal(out[3].raw_tensor, chunks[1])
        assert not out[1].raw_tensor.any()  # the missing chunk's buffer is left alone

        with KVClient(daemon.socket_path) as client:
            (ctx,) = client.contexts()  # one store task: one context
            assert ctx.objects == 3 and ctx.context_id == daemon_key(keys[0])
            assert client.status().hits == 3
    finally:
        adapter.close()


def test_salted_chunks_are_keyed_by_the_salts_digest(start_daemon: Any) -> None:
    import torch

    daemon = start_daemon()
    adapter = KvtierdL2Adapter(KvtierdL2AdapterConfig(socket_path=daemon.socket_path))
    try:
        key = _key(1, salt="alice-secret")
        task = adapter.submit_store_task([key], [_obj(torch.ones(CHUNK_BYTES))])
        done = _wait(adapter, adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
        assert done[task].is_successful()
        name = daemon_key(key)
        assert name.startswith(salt_key_prefix("alice-secret")) and "alice-secret" not in name
        with KVClient(daemon.socket_path) as client:
            assert client.lookup([name]).found == (True,)
            assert client.lookup([daemon_key(_key(1))]).found == (False,)
    finally:
        adapter.close()


def test_adapter_without_a_daemon_misses_and_drops_stores(tmp_path: Path) -> None:
    import torch

    config = KvtierdL2AdapterConfig(socket_path=str(tmp_path / "none.sock"), timeout_s=2)
    adapter = KvtierdL2Adapter(config)
    try:
        task = adapter.submit_store_task([_key(1)], [_obj(torch.ones(8))])
        done = _wait(adapter, adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)
        assert not done[task].is_successful()
        task = adapter.submit_lookup_and_lock_task([_key(1)], {})
        fd = adapter.get_lookup_and_lock_event_fd()
        found = _wait(adapter, fd, lambda: adapter.query_lookup_and_lock_result(task))
        assert _bits(found, 1) == [0]
        assert adapter.report_status()["is_healthy"] is False
    finally:
        adapter.close()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "needs socket_path"),
        ({"socket_path": ""}, "socket_path must be a non-empty string"),
        ({"socket_path": "/s", "hold": 3}, "unknown adapter_params ['hold']; known are"),
        ({"socket_path": "/s", "hold_s": -1}, "hold_s must be a number > 0, got -1"),
        ({"socket_path": "/s", "timeout_s": "5"}, "timeout_s must be a number > 0, got '5'"),
        ({"socket_path": "/s", "durable": "yes"}, "durable must be true or false"),
    ],
)
def test_bad_adapter_params_are_refused_with_the_reason(params: dict[str, Any], message: str):
    with pytest.raises(ValueError) as e:
        KvtierdL2AdapterConfig.from_dict(params)
    assert message in str(e.value)


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)  # fmt: skip


def _complete(base: str, model: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                       "logprobs": 3}).encode()  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


@pytest.mark.vllm
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_flag_path_loads_chunks_from_kvtierd(real_model: Path, tmp_path: Path) -> None:
    """``--kv-offloading-backend lmcache``: a prompt's chunks go to the daemon through the
    LMCache server; with the server's own memory cleared, the same prompt is served from them."""
    from kvtierd.integrations.stack import Stack, StackConfig

    config = StackConfig(model=real_model, work_dir=tmp_path / "stack", cpu="512MiB",
                         ssd="1GiB", vllm_port=0, max_model_len=2048, prefix_caching=False,
                         integration="offloading", served_name="smollm2")  # fmt: skip
    prompt = " ".join(f"Item {i} of the list is the number {i * 7}." for i in range(130))
    with Stack(config) as stack, KVClient(stack.socket_path) as client:
        first = _complete(stack.serve_url, "smollm2", prompt)
        tokens = first["usage"]["prompt_tokens"]
        chunks = tokens // config.chunk_size  # LMCache stores whole chunks only
        assert chunks >= 4
        deadline = time.monotonic() + 60  # the server stores into its L2 after answering
        while sum(c.objects for c in client.contexts()) < chunks:
            assert time.monotonic() < deadline, [str(c) for c in client.contexts()]
            time.sleep(0.5)
        (ctx,) = client.contexts()
        assert ctx.context_id.startswith("lmcache-mp@") and ctx.objects == chunks
        reads = client.status().hits

        lmcache = f"http://{config.host}:{stack.lmcache_http_port}"
        urllib.request.urlopen(
            urllib.request.Request(f"{lmcache}/cache/clear", data=b"", method="POST"), timeout=30
        ).close()
        second = _complete(stack.serve_url, "smollm2", prompt)

        assert client.status().hits - reads == chunks  # every chunk read back from the daemon
        hits = _metric(f"{stack.vllm_url}/metrics", "vllm:external_prefix_cache_hits_total")
        assert hits == chunks * config.chunk_size  # and loaded into vLLM: no prefill of them
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        log = (config.work_dir / "lmcache.log").read_text(errors="replace")
        assert f"{chunks}/{chunks} retained keys (0 L1, {chunks} L2)" in log


def test_offloading_stack_runs_vllm_with_the_one_flag(tmp_path: Path) -> None:
    from kvtierd.integrations.stack import Stack, StackConfig

    stack = Stack(StackConfig(model=tmp_path, work_dir=tmp_path, integration="offloading"))
    stack.lmcache_port = 5599
    cmd = stack.vllm_command()
    at = cmd.index("--kv-offloading-backend")
    assert cmd[at : at + 4] == ["--kv-offloading-backend", "lmcache", "--kv-offloading-size", "1"]
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5599}
    assert stack.serve_url == stack.vllm_url  # no router on this path


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"integration": "mp"}, "integration must be one of connector, offloading, got 'mp'"),
        ({"integration": "offloading", "backend": "none"}, "needs backend 'kvtierd'"),
        ({"lmcache_cpu_gb": 0}, "lmcache_cpu_gb (--offloading-gib) must be > 0, got 0"),
    ],
)
def test_bad_stack_integration_is_refused(tmp_path: Path, settings: dict[str, Any], message: str):
    from kvtierd.errors import ConfigError
    from kvtierd.integrations.stack import StackConfig

    with pytest.raises(ConfigError) as e:
        StackConfig(model=tmp_path, work_dir=tmp_path, **settings)
    assert message in str(e.value)
