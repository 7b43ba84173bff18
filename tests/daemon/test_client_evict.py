"""``KVClient.evict``: the Admin call the ``served`` evaluator and the benchmarks use."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from benchmarks._support.daemon_proc import DaemonProcess
from kvtierd.client import KVClient
from kvtierd.errors import NotFoundError


def test_evict_drops_every_object_of_the_contexts(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        for cid in ("a", "b", "c"):
            for i in range(2):
                c.put(f"{cid}/{i}", np.full(4096, i, np.uint8), context_id=cid)
        assert c.evict(["a", "b"]) == 2
        assert c.lookup(["a/0", "a/1", "b/0", "c/0", "c/1"]).found == (
            False, False, False, True, True,
        )  # fmt: skip
        assert [x.context_id for x in c.contexts()] == ["c"]
        with pytest.raises(NotFoundError, match="context 'a' not found"):
            c.evict(["a"])
