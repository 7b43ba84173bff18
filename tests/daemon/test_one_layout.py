"""Issue 40.2: every chunk of one context has one layout. A chunk whose layers, heads, head size
or dtype differ from the chunks its context already has is refused at the put (the error names
the context and both layouts; nothing stored), so no compression of the context can meet two
geometries; and an unexpected error in one context's plan operation sets that context aside
while the daemon keeps serving every other."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtierd import errors
from kvtierd.client import KVClient
from kvtierd.engine import Engine
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.rpc import kvtier_pb2 as pb
from kvtierd.types import ObjectMeta, Operation, OpKind, Placement, Plan
from tests.daemon.test_profiling_engine import _config

T, H, D = 16, 2, 32


def _layout(layers: int) -> str:
    return ChunkFormat((2, layers, T, H * D), "bfloat16", H).layout()


def _chunk(layers: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, layers, T, H * D, generator=g).to(torch.bfloat16)
    return bytes(x.view(torch.uint8).numpy().tobytes())


def test_a_chunk_of_another_layout_is_refused_naming_the_context(start_daemon):
    d = start_daemon(tenants=[{"name": "a"}, {"name": "b"}])
    with KVClient(d.socket_path, tenant="a", timeout_s=20) as a:
        a.put("doc/0", _chunk(2, 0), context_id="doc", layout=_layout(2), token_count=T)
        with pytest.raises(errors.InvalidArgumentError) as refused:
            a.put("doc/1", _chunk(3, 1), context_id="doc", layout=_layout(3), token_count=T)
        message = str(refused.value)
        assert "doc" in message and _layout(2) in message and _layout(3) in message, message
        assert a.lookup(["doc/1"]).found == (False,)  # nothing stored
        a.put("doc/1", _chunk(2, 1), context_id="doc", layout=_layout(2), token_count=T)
        # the same geometry in another context, and another geometry in its own: both fine
        a.put("other/0", _chunk(3, 2), context_id="other", layout=_layout(3), token_count=T)
        assert a.lookup(["doc/0", "doc/1", "other/0"]).found == (True,) * 3
    with KVClient(d.socket_path, tenant="b", timeout_s=20) as b:
        b.put("doc/0", _chunk(3, 3), context_id="doc", layout=_layout(3), token_count=T)
        assert b.status().health == "SERVING"


def test_one_batch_of_two_layouts_is_refused_whole(start_daemon):
    d = start_daemon()
    with KVClient(d.socket_path, timeout_s=20) as c:
        specs = [
            pb.ObjectSpec(
                key=f"mix/{i}",
                context_id="mix",
                size_bytes=len(_chunk(layers, 0)),
                layout=_layout(layers),
                token_count=T,
            )
            for i, layers in enumerate((2, 3))
        ]
        with pytest.raises(errors.InvalidArgumentError, match="mix"):
            c.call(c.kv.Allocate, pb.AllocateRequest(objects=specs))
        assert c.status().allocations == 0


async def test_an_unexpected_error_sets_one_context_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A context whose chunks disagree (as one stored before the check above, or any other
    fault no check foresaw) fails its compression with a non-kvtierd error: that context is
    set aside with the reason, logged with its id; the executor goes on with the next plan
    and health stays SERVING (it was NOT_SERVING until restart)."""
    caplog.set_level(logging.INFO)
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        for i, layers in enumerate((2, 2)):
            data = memoryview(_chunk(layers, i))
            meta = ObjectMeta(key=f"bad/{i}", size_bytes=len(data), context_id="bad",
                              layout=_layout(layers), token_count=T)  # fmt: skip
            await engine.put_bytes(meta, data)
        await engine.executor.idle()
        # what the edge now refuses: the second chunk's bytes described as 4 layers of one head
        obj = engine.index.objects["bad/1"]
        other = ChunkFormat((2, 4, T, D), "bfloat16", 1).layout()  # as many bytes
        obj.meta = obj.meta.replace(layout=other)
        ctx = engine.contexts["bad"]
        where = engine.index.placement_of(ctx)
        compress = Operation(OpKind.COMPRESS, "bad", where, Placement("int8", where.tier), "t")
        engine.executor.submit(Plan((compress,)))
        await engine.executor.idle()
        assert engine.problems() == []
        assert "bad" in engine.executor.set_aside
        assert any("'bad'" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
        # the executor still carries out plans
        data = memoryview(_chunk(2, 9))
        meta = ObjectMeta(key="good/0", size_bytes=len(data), context_id="good",
                          layout=_layout(2), token_count=T)  # fmt: skip
        await engine.put_bytes(meta, data)
        await engine.executor.idle()
        assert "good" in engine.contexts and engine.problems() == []
    finally:
        await engine.close()
