import numpy as np

from kvtierd.client import KVClient


def test_put_get_drain_promote(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path) as c:
        x = np.arange(1 << 20, dtype=np.float32)
        info = c.put("k1", x, context_id="ctx")
        assert info.tier == "cpu"
        assert np.array_equal(c.get("k1"), x)
        assert c.drain("cpu").moved == 1
        assert c.lookup(["k1"]).tiers == ("ssd",)
        assert np.array_equal(c.get("k1"), x)
