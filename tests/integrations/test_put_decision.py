"""The plugin's write-advice handling without vLLM: the decision table, the continuation links,
and the plugin itself against a real daemon with LMCache's own key type (no engine)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from kvtierd.client import KVClient
from kvtierd.errors import ConfigError, CorruptObjectError
from kvtierd.integrations.plugin_settings import ADVISED, PluginSettings
from kvtierd.integrations.put_decision import ContextLinks, decide
from kvtierd.rpc import kvtier_pb2 as pb

L, H, D, T = 2, 2, 64, 16
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "path", ["configs/lmcache/kvtierd.yaml", "configs/gpu-deployment/lmcache.yaml"]
)
def test_shipped_lmcache_configs_follow_the_advice_and_every_key_is_documented(path: str) -> None:
    extra = yaml.safe_load((ROOT / path).read_text())["extra_config"]
    assert extra["kvtierd.variant"] == ADVISED == PluginSettings().variant
    assert PluginSettings.from_extra_config(extra).variant == ADVISED
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(PluginSettings):
        assert f"`kvtierd.{f.name}`" in doc, f.name


def test_a_token_dropping_plugin_variant_is_refused() -> None:
    """It would store every put's chunks as the original and then fail the put: only a router
    store request, which tags its own variant, can drop tokens."""
    extra = {"kvtierd.variant": "knorm@0.5"}
    with pytest.raises(ConfigError, match="only a `kvtierd router` store request"):
        PluginSettings.from_extra_config(extra)
    assert PluginSettings.from_extra_config({"kvtierd.variant": "int4"}).variant == "int4"


def test_the_old_name_of_advised_is_read_as_it_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 17: ``kvtierd.variant: plan`` was the name of ``advised``; a plugin config that
    still says it works for one release and logs what to write instead."""
    with caplog.at_level(logging.WARNING, logger="kvtierd.integrations.plugin_settings"):
        old = PluginSettings.from_extra_config({"kvtierd.variant": "plan"})
    assert old.variant == ADVISED
    (record,) = caplog.records
    assert "'plan' is deprecated, use 'advised'" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtierd.integrations.plugin_settings"):
        assert PluginSettings.from_extra_config({"kvtierd.variant": "advised"}) == old
    assert not caplog.records
    with pytest.raises(ConfigError, match=r"kvtierd.variant: .*\(or 'advised'\)"):
        PluginSettings.from_extra_config({"kvtierd.variant": "planned"})


def advice(variant: str, source: str = "default") -> pb.WriteAdvice:
    return pb.WriteAdvice(variant=variant, source=source, reason="test")


@pytest.mark.parametrize(
    ("forced", "answer", "want"),
    [
        # want: (context id, quantization, advised, a note about what was not applied)
        ("", advice("none"), ("c", "", True, False)),
        ("", advice("int8", "prior"), ("c", "int8", True, False)),
        ("", advice("int4", "placed"), ("c", "int4", True, False)),
        ("", advice("knorm@0.5+int8", "prior"), ("c", "int8", True, True)),
        ("", advice("knorm@0.5"), ("c", "", True, True)),
        # placed in a form the chunks cannot take: the chunks get a context of their own
        ("", advice("knorm@0.5", "placed"), ("c/none", "", True, True)),
        ("int8", advice("none", "placed"), ("c/int8", "int8", False, False)),
        ("int8", advice("int8", "placed"), ("c", "int8", False, False)),
        ("knorm@0.5", advice("none"), ("c", "", False, False)),  # the router's store request
    ],
)
def test_decision_table(forced: str, answer: pb.WriteAdvice, want: tuple[Any, ...]) -> None:
    p = decide("c", forced, answer)
    assert (p.context_id, p.quant, p.advised, bool(p.note)) == want
    assert p.variant == (p.quant or "none")
    if p.note:
        assert "cannot drop tokens" in p.note and answer.variant in p.note


def test_a_rewritten_requests_suffix_continues_the_placeholder_context() -> None:
    placed = advice("knorm@0.5+int8", "placed")  # the placeholder variant's context
    p = decide("d/knorm@0.5+int8", "knorm@0.5+int8", placed, rewritten=True)
    assert (p.context_id, p.variant, p.quant) == ("d/knorm@0.5+int8", "knorm@0.5+int8", "int8")


def test_links_follow_a_prompt_past_its_hit_prefix() -> None:
    links = ContextLinks(capacity=2)
    links.looked_up(["k0", "k1", "k2", "k3"], prefix_hits=2)
    assert links.continued(["k2", "k3"], 0) == ""  # the prefix's context comes from its load
    links.touched("k1", "ctx")
    assert links.continued(["k2", "k3"], 0) == "ctx"
    assert links.continued(["k3"], 0) == ""
    assert links.continued(["k0", "k1", "k2"], 2) == "ctx"  # a re-put of the stored prefix
    links.looked_up(["k0", "k1"], prefix_hits=2)  # a full hit links nothing
    links.looked_up(["a0", "a1"], prefix_hits=1)
    links.looked_up(["b0", "b1"], prefix_hits=1)  # capacity 2: the oldest link goes
    assert links.continued(["k2"], 0) == ""


# -- the plugin against a real daemon -------------------------------------------------------


class _Allocator:
    """LMCache's local CPU backend as far as the plugin uses it; counts what is given back."""

    def __init__(self) -> None:
        self.freed = 0

    def allocate(self, shape: Any, dtype: torch.dtype, fmt: Any) -> Any:
        def free() -> None:
            self.freed += 1

        return SimpleNamespace(tensor=torch.empty(tuple(shape), dtype=dtype), ref_count_down=free)


@pytest.fixture
def plugin_for(start_daemon: Any) -> Iterator[Any]:
    pytest.importorskip("lmcache")
    from kvtierd.integrations.lmcache_plugin import KvtierdStoragePlugin

    made: list[Any] = []
    daemons: list[Any] = []

    def make(
        policy: str, daemon: dict[str, Any] | None = None, **settings: str
    ) -> tuple[Any, KVClient]:
        d = start_daemon(name=f"d{len(made)}", cpu="8MiB", ssd="32MiB", **(daemon or {}))
        daemons.append(d)
        client = KVClient(d.socket_path)
        client.call(client.admin.ApplyPolicy, pb.ApplyPolicyRequest(yaml=policy, source="t"))
        extra = {"kvtierd.socket_path": d.socket_path, **settings}
        metadata = SimpleNamespace(kv_shape=(L, 2, T, H, D), model_name="tiny")
        p = KvtierdStoragePlugin("cpu", SimpleNamespace(extra_config=extra), metadata,
                                 _Allocator())  # fmt: skip
        made.append((p, client))
        return p, client

    make.daemons = daemons  # type: ignore[attr-defined]
    yield make
    for p, client in made:
        p.close()
        client.close()


def _keys(prefix: int, n: int, **tags: str) -> list[Any]:
    from lmcache.utils import CacheEngineKey

    configs = {f"lmcache.tag.{k}": v for k, v in tags.items()}
    return [CacheEngineKey("tiny", 1, 0, prefix * 1000 + i, torch.bfloat16, configs)
            for i in range(n)]  # fmt: skip


def _chunks(n: int, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [SimpleNamespace(tensor=torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16))
            for _ in range(n)]  # fmt: skip


def _objects(client: KVClient, context_id: str) -> list[pb.ObjectInfo]:
    desc = client.call(
        client.admin.DescribeContext, pb.DescribeContextRequest(context_id=context_id)
    )
    return list(desc.objects)


def test_advised_int8_is_applied_on_the_device_and_a_longer_prompt_joins(plugin_for: Any) -> None:
    plugin, client = plugin_for("placer: fixed\nvariant: int8\n")
    keys, objs = _keys(1, 5), _chunks(5)
    plugin.batched_submit_put_task(keys[:3], objs[:3])
    assert (plugin.stats.advised_puts, plugin.stats.advised_chunks) == (1, 3)
    cid = f"tiny@1@0@{keys[0].chunk_hash_hex}@bfloat16"  # named by its first chunk
    objects = _objects(client, cid)
    assert [o.spec.variant for o in objects] == ["int8"] * 3
    assert all(o.spec.layout.endswith(";int8;g=32") for o in objects)
    # A longer prompt: lookup hits the 3 stored chunks, LMCache loads them, then stores the
    # 2 new ones: they join the same context, quantized the same way.
    assert plugin.batched_contains(keys, pin=True) == 3
    loaded = plugin.batched_get_blocking(keys[:3])
    for got, want in zip(loaded, objs[:3], strict=True):
        err = (got.tensor.float() - want.tensor.float()).abs().max().item()
        assert err < 0.05 * want.tensor.float().abs().max().item()
    plugin.batched_submit_put_task(keys[3:], objs[3:])
    assert plugin.stats.continued_puts == 1
    assert (plugin.stats.advised_puts, plugin.stats.advised_chunks) == (2, 5)
    objects = _objects(client, cid)
    assert [o.spec.variant for o in objects] == ["int8"] * 5
    assert plugin.stats.errors == 0, plugin.stats.last_error


def test_a_plugin_configured_with_the_old_name_still_asks_the_advice(plugin_for: Any) -> None:
    """``kvtierd.variant: plan`` (``advised`` before issue 17) in an LMCache config: the plugin
    still stores what the daemon's write advice says."""
    plugin, client = plugin_for("placer: fixed\nvariant: int8\n", **{"kvtierd.variant": "plan"})
    assert plugin.settings.variant == "advised"
    keys, objs = _keys(7, 2), _chunks(2, seed=5)
    plugin.batched_submit_put_task(keys, objs)
    assert (plugin.stats.advised_puts, plugin.stats.advised_chunks) == (1, 2)
    cid = f"tiny@1@0@{keys[0].chunk_hash_hex}@bfloat16"
    assert [o.spec.variant for o in _objects(client, cid)] == ["int8"] * 2
    assert plugin.stats.errors == 0, plugin.stats.last_error


def test_token_dropping_advice_stores_the_original_and_says_why_once(
    plugin_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin, _ = plugin_for("placer: fixed\nvariant: knorm@0.5\n")
    keys = _keys(2, 4, kvtierd_context="doc")
    objs = _chunks(4, seed=1)
    with caplog.at_level(logging.WARNING, "kvtierd.integrations.lmcache_plugin"):
        plugin.batched_submit_put_task(keys[:2], objs[:2])
        plugin.batched_submit_put_task(keys[2:], objs[2:])
    notes = [r.getMessage() for r in caplog.records if "cannot drop tokens" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "knorm@0.5" in notes[0] and "stores the original" in notes[0]
    assert (plugin.stats.advised_puts, plugin.stats.advised_chunks, plugin.stats.put_chunks) == (
        2,
        0,
        4,
    )
    assert plugin.stats.errors == 0, plugin.stats.last_error


def test_a_requests_later_puts_join_its_first_puts_context(plugin_for: Any) -> None:
    """vLLM prefills a prompt longer than ``max_num_batched_tokens`` in several steps, and
    LMCache puts each step's chunks (chunked prefill): the request's lookup covered the whole
    prompt, so each later put continues the context of the put before it — one context, not
    one per step."""
    plugin, client = plugin_for("placer: lru\n")
    keys, objs = _keys(6, 7), _chunks(7, seed=4)
    assert plugin.batched_contains(keys, pin=True) == 0  # a fresh prompt: nothing hit
    for step in ((0, 3), (3, 5), (5, 7)):  # three prefill steps
        plugin.batched_submit_put_task(keys[slice(*step)], objs[slice(*step)])
    (ctx,) = client.contexts()
    assert (ctx.context_id, ctx.objects) == (f"tiny@1@0@{keys[0].chunk_hash_hex}@bfloat16", 7)
    assert plugin.stats.continued_puts == 2
    assert plugin.stats.errors == 0, plugin.stats.last_error


def test_forced_variant_beside_a_placed_context_gets_its_own_id(plugin_for: Any) -> None:
    plugin, client = plugin_for("placer: lru\n")
    keys, objs = _keys(3, 3), _chunks(3, seed=2)
    plugin.batched_submit_put_task(keys[:2], objs[:2])
    forced = _keys(3, 3, kvtierd_variant="int8")
    plugin.batched_contains(keys, pin=False)
    plugin.batched_get_blocking(keys[:2])
    plugin.batched_submit_put_task(forced[2:], objs[2:])
    contexts = {c.context_id: c for c in client.contexts()}
    base = f"tiny@1@0@{keys[0].chunk_hash_hex}@bfloat16"
    assert contexts[base].variant == "none" and contexts[base].objects == 2
    assert contexts[f"{base}/int8"].variant == "int8" and contexts[f"{base}/int8"].objects == 1
    assert plugin.stats.advised_puts == 1  # the forced put does not count as advised


def test_failures_are_answered_never_raised(plugin_for: Any) -> None:
    """LMCache does not catch a plugin's exceptions on the load path (they kill vLLM's
    worker): a chunk that cannot be decoded frees its buffer, a chunk that cannot be loaded is
    ``None`` with every chunk after it, a refused batch is retried chunk by chunk, a daemon that
    is down is a miss and an unstored put."""
    plugin, client = plugin_for("placer: lru\n")
    keys, objs = _keys(4, 3), _chunks(3, seed=3)
    plugin.batched_submit_put_task(keys, objs)
    names = [f"tiny@1@0@{k.chunk_hash_hex}@bfloat16" for k in keys]
    # A chunk whose bytes do not match its layout gives its buffer back. The daemon refuses
    # such a put since issue 27, so the plugin's decode is given half a chunk directly.
    with client.lease(names[1]) as (info, view), pytest.raises(CorruptObjectError, match="says"):
        plugin._decode(names[1], info, view[: len(view) // 2])
    assert plugin.local_cpu_backend.freed == 1  # the buffer of the chunk that failed
    client.delete([names[1]])  # the daemon now refuses the whole batch (NOT_FOUND)
    got = plugin.batched_get_blocking(keys)
    assert got[0] is not None and got[1:] == [None, None]
    assert plugin.stats.errors == 2  # refused batch; missing chunk

    placeholder = _keys(4, 3, kvtierd_placeholder_tokens=str(3 * T))
    assert plugin.batched_contains(keys) == 1
    assert plugin.batched_contains(placeholder) == 3  # so that the load fails, closed
    assert plugin.stats.claimed_chunks == 2

    plugin_for.daemons[0].kill()
    assert plugin.batched_contains(keys) == 0
    assert plugin.batched_contains(placeholder) == 3
    plugin.batched_submit_put_task(_keys(5, 1), _chunks(1))
    assert plugin.batched_get_blocking(keys) == [None, None, None]
    # A daemon that went away is no error per request (issue 32): one WARNING, then the calls
    # are answered without it until the link's probe finds it again.
    assert plugin.stats.errors == 2 and plugin.stats.put_chunks == 3
    assert plugin.stats.unreachable == 1 and not plugin.link.up
    assert plugin.stats.offline["puts"] == 1 and plugin.stats.offline["gets"] == 1


def test_three_documents_after_one_system_prompt_make_a_tree(plugin_for: Any) -> None:
    """Issue 29 with LMCache's own keys: three prompts share a system prompt of three chunks
    and continue with different documents (their keys differ from the fourth chunk on, as
    LMCache's prefix hashes do). The second prompt's lookup hits the system prompt, its put
    branches there: the first prompt's context is split, and each document is a child."""
    plugin, client = plugin_for("placer: lru\n")
    system, objs = _keys(8, 3), _chunks(5, seed=6)
    docs = [_keys(10 + d, 2) for d in range(3)]
    for d, doc in enumerate(docs):
        prompt = [*system, *doc]
        assert plugin.batched_contains(prompt, pin=True) == (0 if d == 0 else 3)
        new = prompt if d == 0 else doc  # LMCache puts only the chunks it does not hold
        plugin.batched_submit_put_task(new, objs[: len(new)])
    names = [f"tiny@1@0@{k.chunk_hash_hex}@bfloat16" for k in (system[0], *(d[0] for d in docs))]
    tree = {c.context_id: (c.parent_context_id, c.objects) for c in client.contexts()}
    assert tree == {names[0]: ("", 3), **{n: (names[0], 2) for n in names[1:]}}
    assert plugin.stats.branched_puts == 2  # the first document became a child by the split
    assert plugin.stats.errors == 0, plugin.stats.last_error


def test_only_vllms_prompt_lookup_asks_to_load_or_recompute(
    plugin_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 41: the pinned lookup of a prompt (vLLM's) reports what the daemon's decision
    loads — here none (``lookup_decision: recompute``) — and logs it at DEBUG; LMCache's other
    lookups (its retrieve's block mapping, a put's presence check) still see every chunk."""
    plugin, _ = plugin_for("placer: lru\n", daemon={"lookup_decision": "recompute"})
    keys, objs = _keys(7, 3), _chunks(3)
    plugin.batched_submit_put_task(keys, objs)
    with caplog.at_level(logging.DEBUG, logger="kvtierd.integrations.lmcache_plugin"):
        assert plugin.batched_contains(keys, pin=True) == 0
    assert "kvtierd plugin: lookup recompute: lookup_decision: recompute (always)" in caplog.text
    assert plugin.batched_contains(keys) == 3
    assert plugin.contains(keys[0], pin=True)
    assert plugin.stats.errors == 0, plugin.stats.last_error
