"""snapkv in the daemon's own grid: the daemon recomputes the window queries a stored KV cache
does not keep from the policy's ``profiling.model_dir`` and the context's registered token ids
(engine/profiling/observation_window.py), then profiles and builds snapkv variants with them.

The tiny locally built Llama checks the mechanics (what is computed from what, and what is left
out without token ids); the real model checks that a daemon profiles a snapkv variant with the
queries the context's own prefill attended with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks._support.tiny_vllm_model import VOCAB, build_tiny_llama
from kvtierd.config import DaemonConfig, TierConfig
from kvtierd.engine import Engine
from kvtierd.engine.context_kv import SEPARATOR
from kvtierd.engine.profiling.observation_window import context_queries
from kvtierd.kernels.api import compress_dense, to_kv_2ltd
from kvtierd.kernels.chunk_codec import ChunkFormat
from kvtierd.kernels.placeholder import ModelCard, model_card_key
from kvtierd.kernels.rope import RopeSpec
from kvtierd.policies.loader import parse_policy
from kvtierd.profiler import ContextKV, ProfilingQuery, make_evaluator
from kvtierd.profiler.window_queries import prefill_with_window_queries
from kvtierd.types import ObjectMeta

T, N, WINDOW = 16, 128, 64  # a 64-token prefix to score before the default window


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    tiers = (
        TierConfig("cpu", "cpu", 1 << 26, options={"staging_bytes": "32MiB"}),
        TierConfig("ssd", "ssd", 0, str(tmp_path / "ssd")),  # unbounded: keeps the originals
    )
    e = Engine(DaemonConfig(socket_path=str(tmp_path / "s"), data_dir=str(tmp_path / "data"),
                            tiers=tiers))  # fmt: skip
    await e.start()
    e.profiling.settle_s = float("inf")  # only the profiles a test asks for
    yield e
    await e.close()


def prefill(model_dir: Path, ids: list[int]) -> ContextKV:
    """The context's bf16 KV ``[L, H, N, D]`` and the queries its prefill attended with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    cache, queries = prefill_with_window_queries(model, torch.tensor([ids]), WINDOW)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return ContextKV(keys, values, window_queries=queries, token_ids=tuple(ids))


async def put_lmcache_context(engine: Engine, cid: str, model: str, kv: ContextKV) -> None:
    """The KV as the LMCache plugin puts it (bf16 ``KV_2LTD`` chunks under LMCache's keys) and
    the model's card, so that its token-dropped variants can be served (engine/servable.py)."""
    heads, dim = int(kv.keys.shape[1]), int(kv.keys.shape[3])
    data = to_kv_2ltd(kv.keys, kv.values).to(torch.bfloat16)
    for i in range(0, data.shape[2], T):
        x = data[:, :, i : i + T].contiguous()
        raw = memoryview(x.view(torch.uint8).numpy().tobytes())
        meta = ObjectMeta(key=f"{model}@1@0@{cid}-{i // T:04d}@bfloat16", size_bytes=len(raw),
                          context_id=cid, dtype="bfloat16", shape=tuple(x.shape),
                          layout=ChunkFormat(tuple(x.shape), "bfloat16", heads).layout(),
                          token_count=T)  # fmt: skip
        await engine.put_bytes(meta, raw)
    card = ModelCard(model, dim, RopeSpec.standard(dim).inv_freq, VOCAB, (0, 1, 2))
    engine.learn_card(ObjectMeta(key=model_card_key(model), size_bytes=1), card.to_bytes())
    await engine.executor.idle()


def stored_kept(engine: Engine, cid: str) -> torch.Tensor:
    """The kept indices ``[L, H, M]`` of the daemon-made variant, from its chunks' metadata
    (keys ``ctx\0variant\0i``, in chunk order)."""
    metas = sorted((engine.objects[k].meta for k in engine.contexts[cid].keys),
                   key=lambda m: int(m.key.rsplit(SEPARATOR, 1)[-1]))  # fmt: skip
    fmt = ChunkFormat.parse(metas[0].layout)
    shape = (fmt.shape[1], fmt.num_kv_heads, fmt.shape[2])
    parts = [np.frombuffer(m.kept_indices, "<i4").reshape(shape) for m in metas]
    return torch.from_numpy(np.concatenate(parts, axis=2))


def same_kept(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of ``a``'s kept tokens that ``b`` keeps too, per layer and head."""
    rows = [torch.isin(x, y).float().mean() for x, y in zip(a.flatten(0, 1), b.flatten(0, 1),
                                                           strict=True)]  # fmt: skip
    return float(torch.stack(rows).mean())


async def test_the_placer_builds_snapkv_with_the_prefills_own_queries(
    engine: Engine, tiny: Path
) -> None:
    """A fixed snapkv@0.5 policy with model_dir: the daemon stores the context as snapkv@0.5,
    keeping exactly the tokens snapkv keeps from the queries the transformers prefill captured
    (recomputed from the stored prefix KV and the last 64 registered ids)."""
    ids = [3 + (37 * i) % (VOCAB - 3) for i in range(N)]
    kv = prefill(tiny, ids)
    await put_lmcache_context(engine, "doc", str(tiny), kv)
    await engine.profiling.inputs.set_tokens("doc", ids)
    policy = f"placer: fixed\nvariant: snapkv@0.5\nprofiling:\n  model_dir: {tiny}\n"
    await engine.apply_policy(parse_policy(policy, "snapkv.yaml"))
    await engine.executor.idle()
    assert engine.contexts["doc"].variant == "snapkv@0.5"
    want = compress_dense(kv.keys, kv.values, "snapkv@0.5", queries=kv.window_queries,
                          chunk_tokens=T).kept  # fmt: skip
    assert torch.equal(stored_kept(engine, "doc"), want.to(torch.int32))


def snapkv_policy(model_dir: Path, evaluator: str = "attention") -> str:
    return (f"placer: evicpress\nvariants:\n  methods: [knorm, snapkv]\n  ratios: [0.5]\n"
            f"profiling:\n  evaluator: {evaluator}\n  model_dir: {model_dir}\n"
            "  min_queries: 1\n")  # fmt: skip


async def test_snapkv_is_profiled_with_recomputed_queries_and_left_out_without_ids(
    engine: Engine, tiny: Path
) -> None:
    """The attention evaluator's score of snapkv@0.5 in the daemon's profile is the one it
    gives in-process with the prefill's own window queries; a context whose ids the daemon
    does not know is profiled without its snapkv variant (and still with knorm)."""
    await engine.apply_policy(parse_policy(snapkv_policy(tiny), "snapkv.yaml"))
    ids = [3 + (53 * i) % (VOCAB - 3) for i in range(N)]
    kv = prefill(tiny, ids)
    question = (ProfilingQuery(text="a question"),)
    for cid, known in (("known", ids), ("unknown", [])):
        await put_lmcache_context(engine, cid, str(tiny), kv)
        if known:
            await engine.profiling.inputs.set_tokens(cid, known)
        assert await engine.profiling.profile_context(engine.contexts[cid], question)
    profiled = {
        cid: {v.variant: v.quality for v in engine.profiling.record(cid).profile.variants}
        for cid in ("known", "unknown")
    }
    assert set(profiled["known"]) == {"none", "knorm@0.5", "snapkv@0.5"}
    assert set(profiled["unknown"]) == {"none", "knorm@0.5"}
    stored = ContextKV(*await engine.mover.context_tensors(engine.contexts["known"]),
                       window_queries=kv.window_queries)  # fmt: skip
    direct = make_evaluator("attention").evaluate(stored, ["snapkv@0.5"], question)
    assert profiled["known"]["snapkv@0.5"] == pytest.approx(direct["snapkv@0.5"], abs=1e-3)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_daemon_with_the_real_model_profiles_snapkv(
    engine: Engine, real_model: Path
) -> None:
    """On SmolLM2 (a quality-benchmark needle case put as vLLM's bf16 chunks, its question a
    routed prompt), the ``answer`` profile scores snapkv@0.5, with window queries equal to the
    prefill's up to bf16 rounding and the same kept tokens."""
    from transformers import AutoTokenizer

    from benchmarks.quality.bench_profile_quality import profile_case
    from benchmarks.quality.quality_tasks import make_case, split_prompt

    await engine.apply_policy(parse_policy(snapkv_policy(real_model, "answer"), "snapkv.yaml"))
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    case = make_case(tokenizer, "niah_single", 1024, 1)
    profiler: Any = engine.profiling.profiler
    evaluator = profiler.evaluator_for(True)  # answer: it refines the estimator (issue 26)
    profile = await profile_case(engine, evaluator, tokenizer, case)
    print(case.name, {v: round(q, 3) for v, q in profile.items()})
    assert set(profile) == {"none", "knorm@0.5", "snapkv@0.5"}
    assert 0.0 < profile["snapkv@0.5"] <= 1.0

    split = split_prompt(tokenizer, case)
    captured = prefill(real_model, list(split.context))
    keys, values = await engine.mover.context_tensors(engine.contexts[case.name])
    tokens = profiler.queries.tokens(case.name, int(keys.shape[2]))
    again = context_queries(str(real_model), ["snapkv@0.5"], keys, values, tokens)
    want: Any = captured.window_queries
    assert again is not None and again.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(again.float(), want.float(), dim=-1)
    print("window query cosine, min:", cos.min().item())
    assert cos.min() > 0.99
    kept = [compress_dense(keys, values, "snapkv@0.5", queries=q, chunk_tokens=T).kept
            for q in (again, want)]  # fmt: skip
    same = same_kept(*kept)
    print("kept tokens equal to the prefill's:", same)
    assert same > 0.95
