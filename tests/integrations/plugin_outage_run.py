"""Run by ``test_plugin_outage_log.py`` as its own process, the way ``vllm serve`` loads the
plugin: no logging configured for ``kvtierd``. Makes the plugin while its daemon is absent,
drops two puts, says ``PUTS DONE``, then waits (at most 240 s) until the plugin caches again."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

from kvtierd.integrations.lmcache_plugin import KvtierdStoragePlugin
from tests.integrations.test_put_decision import D, H, L, T, _Allocator, _chunks, _keys


def main(socket_path: str) -> int:
    extra = {"kvtierd.socket_path": socket_path}
    metadata = SimpleNamespace(kv_shape=(L, 2, T, H, D), model_name="tiny")
    plugin = KvtierdStoragePlugin("cpu", SimpleNamespace(extra_config=extra), metadata,
                                  _Allocator())  # fmt: skip
    plugin.batched_submit_put_task(_keys(1, 3), _chunks(3))
    plugin.batched_submit_put_task(_keys(2, 2), _chunks(2))
    print("PUTS DONE", flush=True)
    deadline = time.monotonic() + 240
    while not plugin.link.up:
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.05)
    time.sleep(0.5)  # the reconnect's INFO line follows link.up on the probe thread
    plugin.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
