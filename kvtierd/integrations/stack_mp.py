"""The command lines of ``kvtierd stack --integration offloading`` (docs/integration.md).

vLLM's one flag, ``--kv-offloading-backend lmcache``, selects ``LMCacheMPConnector``, which
needs an LMCache server beside vLLM (``lmcache server``); kvtierd is that server's L2
(``lmcache_l2.py``). So this integration is three processes, as the connector's is: the daemon,
the LMCache server with the kvtierd adapter, and vLLM with the flag. No router: its variants,
store requests and prompt links ride on request tags that only the in-process connector passes
to LMCache.

On a CPU-only vLLM the worker moves KV by copies (LMCache's ``engine_driven`` transfer): the
server must accept it (``--supported-transfer-mode auto``), or vLLM waits 300 s at start-up
for a registration the server refuses ("No handler registered for operation
register_kv_cache_engine_driven_context").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ADAPTER = {
    "type": "plugin",  # LMCache's loader of an adapter class by module and name
    "module_path": "kvtierd.integrations.lmcache_l2",
    "class_name": "KvtierdL2Adapter",
}


def l2_adapter_json(socket_path: str) -> str:
    """``lmcache server --l2-adapter``'s value for the kvtierd daemon at ``socket_path``."""
    return json.dumps({**ADAPTER, "adapter_params": {"socket_path": socket_path}})


def lmcache_server_command(
    *, socket_path: str, host: str, port: int, http_port: int, l1_gib: float, chunk_size: int
) -> list[str]:
    """``lmcache server`` (the request server on ``port``, its HTTP API on ``http_port``) with
    ``l1_gib`` of its own memory in front of the kvtierd daemon."""
    lmcache = str(Path(sys.executable).with_name("lmcache"))
    return [lmcache, "server", "--host", host, "--port", str(port), "--http-host", host,
            "--http-port", str(http_port), "--chunk-size", str(chunk_size), "--l1-size-gb",
            f"{l1_gib:g}", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--l2-adapter", l2_adapter_json(socket_path)]  # fmt: skip


def offloading_args(*, host: str, port: int, size_gib: float) -> list[str]:
    """vLLM's flags for the LMCache server at ``host:port``. ``--kv-offloading-size`` only
    switches the path on: vLLM drops the size (``vllm/config/vllm.py``,
    ``_post_init_kv_transfer_config``), the server's ``--l1-size-gb`` is what holds KV."""
    extra = {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port}
    return ["--kv-offloading-backend", "lmcache", "--kv-offloading-size", f"{size_gib:g}",
            "--kv-transfer-config", json.dumps({"kv_connector_extra_config": extra})]  # fmt: skip
