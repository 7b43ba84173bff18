"""Issue 40 (3, 4): the tree's invariants hold after every operation, not only at put. Random
sequences of puts (joining or branching off the tree by ``after_key``, durable or not), Advise
splits, drops, durable holds, rebalances and policy applications drive an engine over real
tiers; after each step: no chain deeper than ``MAX_DEPTH``, no cycle, the index's children
match its parents, and the placer's links are the index's less the held contexts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.policies.loader import parse_policy
from kvtierd.policies.tree_placement import MAX_DEPTH
from kvtierd.types import DROPPED, ObjectMeta, Operation, OpKind, Plan

KiB = 1 << 10
STEPS = 120


def _config(tmp: Path) -> DaemonConfig:
    tiers = (
        TierConfig("cpu", "cpu", 256 * KiB, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 2048 * KiB, str(tmp / "ssd")),
    )
    return DaemonConfig(socket_path=str(tmp / "s"), data_dir=str(tmp / "d"), tiers=tiers)


def check_tree(engine: Engine) -> None:
    index, placer = engine.index, engine.placing.placer
    contexts = index.contexts
    for ctx in contexts.values():
        seen, at, depth = {ctx.context_id}, ctx, 0
        while at.parent and at.parent in contexts:
            at = contexts[at.parent]
            depth += 1
            assert at.context_id not in seen, f"cycle through {ctx.context_id!r}"
            seen.add(at.context_id)
        assert depth <= MAX_DEPTH, (ctx.context_id, depth)
        if ctx.parent:
            assert ctx.context_id in index.children.get(ctx.parent, ()), ctx.context_id
    for parent, kids in index.children.items():
        for kid in kids:
            assert contexts[kid].parent == parent, (kid, parent)
    for kid, parent in placer.parents.items():
        if kid not in contexts or parent not in contexts:
            continue  # the placer keeps a dropped context (no bytes, not in the index)
        assert not contexts[kid].durable_held and not contexts[parent].durable_held, (kid, parent)
        assert contexts[kid].parent == parent, (kid, parent)


async def _put(engine: Engine, rng: random.Random, n: int) -> None:
    """A prompt of one to three chunks, after a random chunk of the tree (a branch, an
    extension or a split) or at the root."""
    keys = list(engine.objects)
    after = rng.choice(keys) if keys and rng.random() < 0.8 else ""
    place = await engine.join("", f"p{n}", after)
    durable = rng.random() < 0.3
    for i in range(rng.randint(1, 3)):
        data = memoryview(bytes([n % 251]) * (16 * KiB))
        meta = ObjectMeta(key=f"p{n}/{i}", size_bytes=len(data), context_id=place.context_id,
                          parent_context_id=place.parent)  # fmt: skip
        await engine.put_bytes(meta, data, durable=durable)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_operations_keep_the_tree_valid(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    engine = Engine(_config(tmp_path))
    await engine.start()
    try:
        await engine.apply_policy(parse_policy("placer: evicpress\n", "p.yaml"))
        for n in range(STEPS):
            step = rng.choices(
                ["put", "advise", "drop", "hold", "rebalance", "policy"],
                weights=[8, 4, 2, 2, 1, 1],
            )[0]
            contexts = list(engine.contexts.values())
            if step == "put" or not contexts:
                await _put(engine, rng, n)
            elif step == "advise":  # a split where the key is inside its context
                await engine.join("", f"adv{n}", rng.choice(list(engine.objects)))
            elif step == "drop":
                ctx = rng.choice(contexts)
                where = engine.index.placement_of(ctx)
                op = Operation(OpKind.DROP, ctx.context_id, where, DROPPED, "test")
                engine.executor.submit(Plan((op,)))
            elif step == "hold":
                held = [c for c in contexts if engine.index.unread_durable(c)]
                if held:
                    await engine.durable.hold(rng.choice(held), "drop")
            elif step == "rebalance":
                engine.executor.submit(await engine.rebalance())
            else:
                await engine.apply_policy(parse_policy("placer: evicpress\n", "p.yaml"))
            await engine.executor.idle()
            assert engine.problems() == [], (n, step)
            check_tree(engine)
    finally:
        await engine.close()
