"""Issue 42.6: a put logs nothing at INFO. A daemon fed many contexts with no chunk layout (50,000
of them logged 50,000 INFO lines, each saying "its original is not kept", which was not what
happened) logs each decision at DEBUG and an INFO summary with the counts per reason."""

from __future__ import annotations

import re

import numpy as np

from kvtierd.client import KVClient
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.rpc import kvtier_pb2 as pb

N = 40
NO_LAYOUT = "no chunk layout: placed as stored, not profiled"


def test_puts_log_no_info_line_each_and_a_summary_counts_them(start_daemon):
    # policy_file "": the embedded EvicPress, which profiles every context it can
    d = start_daemon(cpu="64MiB", ssd="256MiB", policy_file="", profile_quiet_s=0.1)
    ids = [f"c{i}" for i in range(N)]
    with KVClient(d.socket_path, timeout_s=60) as c:
        for cid in ids:
            c.put(f"{cid}-k", bytes(16 << 10), context_id=cid)  # no layout: opaque bytes
        # every context is asked for now: each one's decision is made before the stop
        reply = c.call(c.admin.Profile, pb.ProfileRequest(context_ids=ids))
        assert reply.profiled == 0 and reply.failed == N, reply
        assert all(NO_LAYOUT in e for e in reply.errors), reply.errors
    assert d.stop() == 0  # the summary of the last interval is logged at stop
    lines = d.logs().splitlines()
    per_context = [ln for ln in lines if " INFO " in ln and re.search(r"context c\d+\b", ln)]
    assert per_context == []
    summaries = [
        re.search(r"contexts not profiled: (\d+) in the last interval \(per reason: (\d+) x "
                  + re.escape(NO_LAYOUT), ln)
        for ln in lines
        if " INFO " in ln
    ]  # fmt: skip
    counted = [int(m.group(2)) for m in summaries if m]
    assert counted and sum(counted) >= N, lines[-30:]


def test_profiled_contexts_log_no_info_line_each(start_daemon):
    """A profiled context was one INFO line each ("context cN: profiled by ... in 0.0 s"):
    at 100k objects, one context in ten with a chunk layout, most of the INFO log."""
    fmt = ChunkFormat((2, 2, 16, 64), "bfloat16", 2)
    values = np.random.default_rng(0).standard_normal((2, 2, 16, 64), np.float32)
    chunk = ((values.view(np.uint32) >> 16).astype(np.uint16)).tobytes()  # bfloat16 bits
    d = start_daemon(cpu="64MiB", ssd="256MiB", policy_file="", profile_quiet_s=0.1)
    ids = [f"c{i}" for i in range(3)]
    with KVClient(d.socket_path, timeout_s=120) as c:
        for cid in ids:
            for j in range(2):
                c.put(f"{cid}-{j}", chunk, context_id=cid, layout=fmt.layout(),
                      token_count=16)  # fmt: skip
        reply = c.call(c.admin.Profile, pb.ProfileRequest(context_ids=ids))
        assert reply.profiled == len(ids), reply
    assert d.stop() == 0
    lines = d.logs().splitlines()
    assert [ln for ln in lines if " INFO " in ln and re.search(r"context c\d+\b", ln)] == []
    counted = [
        int(m.group(1)) for ln in lines if " INFO " in ln
        if (m := re.search(r"contexts profiled: (\d+) in the last interval", ln))
    ]  # fmt: skip
    assert counted and sum(counted) >= len(ids), lines[-30:]
