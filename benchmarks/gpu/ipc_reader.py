"""A second CUDA process for step ``daemon``: lease one object in place through CUDA IPC and
say whether its bytes are the ones written (``--seed``/``--size``, as daemon_check makes them).

Prints one JSON line: ``{"is_cuda", "equal", "lease_s", "read_bytes_per_s"}``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvtierd.client import KVClient


def payload(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    a = ap.parse_args()
    want = torch.from_numpy(payload(a.seed, a.size)).cuda()
    with KVClient(a.socket) as c:
        t0 = time.perf_counter()
        with c.device_lease(a.key) as (_, view):
            lease_s = time.perf_counter() - t0
            is_cuda = bool(view.is_cuda)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            copy = view.clone()  # a device-to-device read of the daemon's pool
            torch.cuda.synchronize()
            read_s = time.perf_counter() - t1
            same = bool(torch.equal(copy.to(want.device), want))
        leases_after = c.status().leases
    doc = {
        "is_cuda": is_cuda,
        "equal": same,
        "lease_s": lease_s,
        "read_bytes_per_s": a.size / read_s,
        "leases_after": leases_after,
    }
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
