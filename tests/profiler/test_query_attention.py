"""``query_attention``: every ratio from one pass of prefix sums equals attending over each
variant as the kernels store it; the question's pass equals the model's own prefill."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler import ContextKV, ProfilingQuery, StoredForm, make_evaluator
from kvtierd.profiler.quality_tables import CALIBRATION, calibrate
from kvtierd.profiler.query_attention import Probes, QueryAttentionEvaluator
from kvtierd.profiler.variant_kv import variant_kvs

L, H, HQ, N, D, T = 2, 2, 4, 256, 32, 5
FORM = StoredForm(chunk_tokens=16)


def structured() -> tuple[ContextKV, Probes]:
    g = torch.Generator().manual_seed(0)
    scale = torch.linspace(0.3, 1.5, N)[torch.randperm(N, generator=g)]
    keys = torch.randn(L, H, N, D, generator=g) * scale[None, None, :, None]
    values = torch.randn(L, H, N, D, generator=g) + 0.5 * keys
    probes = Probes(
        queries=torch.randn(L, HQ, T, D, generator=g),
        own_keys=torch.randn(L, H, T, D, generator=g),
        own_values=torch.randn(L, H, T, D, generator=g),
    )
    return ContextKV(keys=keys, values=values), probes


def reference_errors(kv: ContextKV, variant: str, probes: Probes) -> torch.Tensor:
    """Attention of each probe token over the variant's stored (dequantized) KV plus the
    question's own keys up to itself, against the same over the full KV: ``[L, H, G*T]``."""
    (item,) = variant_kvs(kv, [variant], FORM)
    g = HQ // H
    out = []
    for layer in range(L):
        q = probes.queries[layer].reshape(H, g * T, D) / math.sqrt(D)
        own_k, own_v = probes.own_keys[layer], probes.own_values[layer]  # type: ignore[index]
        rows = []
        for r in range(g * T):
            t = r % T
            qr = q[:, r : r + 1]  # [H, 1, D]

            own = (own_k[:, : t + 1], own_v[:, : t + 1])
            full = _attend(qr, (kv.keys[layer], kv.values[layer]), own)
            var = _attend(qr, (item.keys[layer], item.values[layer]), own)
            err = (var - full).norm(dim=-1) / full.norm(dim=-1)
            rows.append(err.clamp(max=1.0)[:, 0])
        out.append(torch.stack(rows, dim=1))
    return torch.stack(out)


def _attend(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], own: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    k = torch.cat([kv[0], own[0]], dim=1)
    v = torch.cat([kv[1], own[1]], dim=1)
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


@pytest.mark.parametrize(
    "variant", ["knorm@0.5", "keydiff@0.3", "streamingllm@0.25", "int8", "int4", "knorm@0.9"]
)
def test_prefix_sums_equal_attending_over_the_stored_variant(variant: str) -> None:
    kv, probes = structured()
    ev = QueryAttentionEvaluator(calibrate=False, layer_stride=1)
    names = [variant, "knorm@0.7", "keydiff@0.6", "int4"]  # one pass serves several counts
    got = ev.errors(kv, names, probes, FORM)[variant]
    assert torch.allclose(got, reference_errors(kv, variant, probes), atol=2e-5)


def test_composed_variant_is_the_drop_over_the_quantized_context() -> None:
    """knorm@r+int8 quantizes the kept keys in groups of kept tokens; the estimate quantizes
    the whole context: close, not equal (module docstring)."""
    kv, probes = structured()
    ev = QueryAttentionEvaluator(calibrate=False, layer_stride=1)
    got = ev.errors(kv, ["knorm@0.5+int8"], probes, FORM)["knorm@0.5+int8"]
    ref = reference_errors(kv, "knorm@0.5+int8", probes)
    assert (got - ref).abs().mean() < 0.01


def test_original_scores_one_and_harder_drops_score_less() -> None:
    kv, probes = structured()
    ev = QueryAttentionEvaluator(calibrate=False, layer_stride=1)
    names = ["none", "knorm@0.9", "knorm@0.5", "knorm@0.1", "int8", "int4"]
    raw = ev.raw_scores(kv, names, probes, FORM)
    assert raw["none"] == pytest.approx(1.0, abs=1e-6)
    assert 1.0 > raw["knorm@0.9"] > raw["knorm@0.5"] > raw["knorm@0.1"]
    assert 1.0 > raw["int8"] > raw["int4"]


def test_fallback_probes_without_a_question(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtierd.profiler import quality_tables

    monkeypatch.setattr(quality_tables, "PRIOR", {})  # the probes, not the labels
    kv, _ = structured()
    windowed = ContextKV(kv.keys, kv.values, window_queries=torch.randn(L, HQ, 8, D))
    ev = QueryAttentionEvaluator(fallback_probes=16, calibrate=False)
    assert ev.probes(windowed).queries is windowed.window_queries
    keys = ev.probes(kv)
    assert torch.equal(keys.queries, kv.keys[:, :, N - 16 :]) and keys.own_keys is None
    res = ev.evaluate(kv, ["knorm@0.5", "int8"])
    assert res.num_queries == 16
    assert 0.0 < res["knorm@0.5"] < res["int8"] < 1.0


def test_without_the_model_questions_give_way_to_key_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtierd.profiler import quality_tables

    monkeypatch.setattr(quality_tables, "PRIOR", {})  # the probes, not the labels
    """A policy without profiling.model_dir cannot run questions: the last keys stand in."""
    kv, _ = structured()
    ev = QueryAttentionEvaluator(fallback_probes=16)
    res = ev.evaluate(kv, ["int8"], [ProfilingQuery(token_ids=(1, 2))])
    assert res.num_queries == 16
    assert res["int8"] == ev.evaluate(kv, ["int8"])["int8"]
    with pytest.raises(InvalidArgumentError, match="model_dir"):
        ev.question_probes(kv, (1, 2))


def test_calibration_is_monotone_and_clamped() -> None:
    xs = [x for x, _ in CALIBRATION]
    ys = [y for _, y in CALIBRATION]
    assert xs == sorted(xs) and ys == sorted(ys)
    assert calibrate(-5.0) == ys[0] and calibrate(5.0) == ys[-1]
    assert calibrate(1.0) == pytest.approx(1.0)
    knots = ((0.5, 0.0), (0.9, 0.8), (1.0, 1.0))
    assert calibrate(0.7, knots) == pytest.approx(0.4)
    assert calibrate(0.95, knots) == pytest.approx(0.9)


def test_question_pass_sees_what_the_model_computes(tiny_llama_dir: Path) -> None:
    """The question's queries and own K/V, run after the stored context, equal those of one
    prefill of context + question; and the evaluator's scores come from them."""
    from kvtierd.profiler.window_queries import (
        pass_for_context,
        prefill_with_window_queries,
        window_model,
    )

    model = window_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (1, 96), generator=g)
    n = 80
    cache, queries = prefill_with_window_queries(model, ids, window=16)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    question_ids = ids[0, n:].tolist()
    seen = pass_for_context(str(tiny_llama_dir), keys[:, :, :n], values[:, :, :n], question_ids)
    assert torch.allclose(seen.queries, queries, atol=1e-4)
    assert torch.allclose(seen.keys, keys[:, :, n:], atol=1e-4)
    assert torch.allclose(seen.values, values[:, :, n:], atol=1e-4)
    options = {"model_dir": str(tiny_llama_dir), "calibrate": False, "question_dtype": ""}
    ev = make_evaluator("query_attention", options)
    kv = ContextKV(keys[:, :, :n].contiguous(), values[:, :, :n].contiguous())
    question = [ProfilingQuery(token_ids=tuple(question_ids))]
    res = ev.evaluate(kv, ["knorm@0.5", "int8"], question)
    assert res.num_queries == 1
    probes = Probes(seen.queries, seen.keys, seen.values)
    assert isinstance(ev, QueryAttentionEvaluator)
    direct = ev.raw_scores(kv, ["knorm@0.5", "int8"], probes, StoredForm())
    assert res["knorm@0.5"] == pytest.approx(direct["knorm@0.5"], abs=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_is_the_kernels_quantizer(bits: int, axis: str) -> None:
    from kvtierd.kernels.quant import dequantize, quantize
    from kvtierd.profiler.quant_round_trip import round_trips

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 77, 64, generator=g) * torch.linspace(0.1, 3.0, 64)
    x[0, 0, :40, 5] = 0.25  # a constant group: scale 0
    want = dequantize(quantize(x, bits, 32, axis, "torch"), "torch")  # type: ignore[arg-type]
    assert torch.equal(round_trips(x, [8, 4], 32, axis)[bits], want)


def test_the_last_question_tokens_alone_score_as_they_do_among_all() -> None:
    """Probing with the question's last K tokens (``question_tokens``) gives exactly their
    errors among all T: each still sees every question token before it."""
    kv, probes = structured()
    ev = QueryAttentionEvaluator(calibrate=False, layer_stride=1)
    names = ["knorm@0.5", "int4", "streamingllm@0.25"]
    every = ev.errors(kv, names, probes, FORM)
    last = Probes(probes.queries[:, :, -2:], probes.own_keys, probes.own_values)
    some = ev.errors(kv, names, last, FORM)
    g = HQ // H
    for v in names:
        want = every[v].reshape(L, H, g, T)[..., -2:]
        assert torch.allclose(some[v].reshape(L, H, g, 2), want, atol=1e-6)


def test_without_model_or_probes_the_labels_prior_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No question, no window queries, no model: the per-method prior (linear in the ratio
    between its knots); a variant it does not know sends every variant to the key probes."""
    from kvtierd.profiler import quality_tables

    table = {"knorm": ((0.1, 0.0), (0.5, 0.6)), "int8": ((1.0, 0.95),)}
    monkeypatch.setattr(quality_tables, "PRIOR", table)
    kv, _ = structured()
    ev = QueryAttentionEvaluator()
    res = ev.evaluate(kv, ["knorm@0.3", "knorm@0.9", "int8"])
    assert res.quality == pytest.approx({"knorm@0.3": 0.3, "knorm@0.9": 0.6, "int8": 0.95})
    assert res.num_queries == 0
    probed = ev.evaluate(kv, ["knorm@0.3", "keydiff@0.5"])
    assert probed.num_queries == ev.fallback_probes


def test_calibrated_scores_are_averaged_with_the_prior(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtierd.profiler import quality_tables

    monkeypatch.setattr(quality_tables, "PRIOR", {"knorm": ((0.1, 0.2), (0.9, 0.8))})
    monkeypatch.setattr(quality_tables, "CALIBRATION", ((0.0, 0.0), (1.0, 1.0)))
    kv, _ = structured()
    windowed = ContextKV(kv.keys, kv.values, window_queries=torch.randn(L, HQ, 8, D))
    names = ["knorm@0.5", "knorm@0.9"]
    raw = QueryAttentionEvaluator(calibrate=False).evaluate(windowed, names)
    both = QueryAttentionEvaluator().evaluate(windowed, names)
    alone = QueryAttentionEvaluator(prior_weight=0.0).evaluate(windowed, names)
    assert both["knorm@0.5"] == pytest.approx(0.5 * raw["knorm@0.5"] + 0.5 * 0.5)
    assert both["knorm@0.9"] == pytest.approx(0.5 * raw["knorm@0.9"] + 0.5 * 0.8)
    assert alone["knorm@0.5"] == pytest.approx(raw["knorm@0.5"])


GRID = [
    *(f"{m}@{r}" for m in ("knorm", "keydiff") for r in (0.9, 0.7, 0.5, 0.3, 0.1)),
    *(f"knorm@{r}+int8" for r in (0.9, 0.7, 0.5, 0.3, 0.1)),
    *(f"streamingllm@{r}" for r in (0.5, 0.25, 0.1)),
    "int8",
    "int4",
    "none",
]


@pytest.mark.parametrize("own", [True, False], ids=["question", "key-probes"])
def test_fast_path_equals_the_old_computation_on_the_whole_grid(own: bool) -> None:
    """The segment matmuls over permuted rows, with every in-place output read as the sum of
    an ordered pass's segments, give the old gather-and-prefix-sum errors (issue 26's
    speed-up): the same numbers up to float rounding, for every variant of the label grid."""
    from kvtierd.profiler.query_attention_reference import reference_errors

    kv, probes = structured()
    if not own:
        probes = Probes(probes.queries)
    got = QueryAttentionEvaluator(calibrate=False, layer_stride=1).errors(kv, GRID, probes, FORM)
    want = reference_errors(kv, GRID, probes, FORM)
    for v in GRID:
        assert torch.allclose(got[v], want[v], atol=1e-5, rtol=0), v
    assert float(got["none"].abs().max()) < 1e-5
    assert float(got["knorm@0.1"].mean()) > float(got["knorm@0.9"].mean()) > 0.0


def test_layer_stride_reads_every_kth_layer_of_the_same_errors() -> None:
    kv, probes = structured()
    every = QueryAttentionEvaluator(calibrate=False, layer_stride=1).errors(kv, GRID, probes, FORM)
    strided = QueryAttentionEvaluator(calibrate=False, layer_stride=2).errors(
        kv, GRID, probes, FORM
    )
    assert QueryAttentionEvaluator().layer_stride == 5  # the default (RESULTS.md, issue 26)
    for v in GRID:
        assert strided[v].shape[0] == math.ceil(L / 2)
        assert torch.allclose(strided[v], every[v][::2], atol=1e-6, rtol=0), v
    with pytest.raises(InvalidArgumentError, match="layer_stride"):
        QueryAttentionEvaluator(layer_stride=0)


def test_question_pass_skips_the_lm_head_and_runs_in_the_asked_dtype(
    tiny_llama_dir: Path,
) -> None:
    """The pass without the LM head sees the same queries and K/V as with it; in bfloat16 the
    scores stay within bf16's rounding of float32's."""
    from kvtierd.profiler.window_queries import pass_for_context

    g = torch.Generator().manual_seed(3)
    model = str(tiny_llama_dir)
    ev32 = QueryAttentionEvaluator(model, calibrate=False, question_dtype="float32")
    keys, values = structured_real_kv(tiny_llama_dir, g)
    ids = torch.randint(3, 200, (12,), generator=g).tolist()
    bare = pass_for_context(model, keys, values, ids)
    full = pass_for_context(model, keys, values, ids, lm_head=True)
    assert torch.equal(bare.queries, full.queries) and torch.equal(bare.keys, full.keys)
    kv = ContextKV(keys, values)
    names = ["knorm@0.5", "knorm@0.1", "int4"]
    r32 = ev32.raw_scores(kv, names, ev32.question_probes(kv, ids), StoredForm())
    ev16 = QueryAttentionEvaluator(model, calibrate=False)  # bfloat16, the default
    probes16 = ev16.question_probes(kv, ids)
    assert probes16.queries.dtype == torch.bfloat16
    r16 = ev16.raw_scores(kv, names, probes16, StoredForm())
    for v in names:
        assert r16[v] == pytest.approx(r32[v], abs=0.02), v


def structured_real_kv(tiny_llama_dir: Path, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A context of 64 random tokens prefilled on the tiny model: its KV ``[L, H, 64, D]``."""
    from kvtierd.profiler.window_queries import prefill_with_window_queries, window_model

    model = window_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 200, (1, 64), generator=g)
    cache, _ = prefill_with_window_queries(model, ids, window=1)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys.contiguous(), values.contiguous()


def test_question_pass_of_some_layers_stops_after_the_last(tiny_llama_dir: Path) -> None:
    """``layers``: the same queries and own K/V as the whole pass's rows of those layers, and
    the layers after the last asked are never run; the evaluator's strided probes score as
    the whole pass's read at the same stride."""
    from kvtierd.profiler.window_queries import pass_for_context, window_model

    g = torch.Generator().manual_seed(5)
    model_dir = str(tiny_llama_dir)
    keys, values = structured_real_kv(tiny_llama_dir, g)
    count = int(keys.shape[0])
    assert count >= 2  # a layer after the last asked one
    rows = sorted({0, count - 2})
    ids = torch.randint(3, 200, (9,), generator=g).tolist()
    whole = pass_for_context(model_dir, keys, values, ids)
    model = window_model(model_dir, torch.float32, torch.device("cpu"))
    ran: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
             for i, layer in enumerate(model.model.layers)]  # fmt: skip
    try:
        some = pass_for_context(model_dir, keys, values, ids, layers=rows)
    finally:
        for h in hooks:
            h.remove()
    assert ran == list(range(count - 1))  # the last layer never ran
    assert torch.equal(some.queries, whole.queries[rows])
    assert torch.equal(some.keys, whole.keys[rows]) and torch.equal(some.values, whole.values[rows])
    for bad in ([], [1, 0], [0, 0], [count]):
        with pytest.raises(InvalidArgumentError, match="layers must be"):
            pass_for_context(model_dir, keys, values, ids, layers=bad)

    ev = QueryAttentionEvaluator(model_dir, calibrate=False, layer_stride=2,
                                 question_dtype="float32")  # fmt: skip
    kv = ContextKV(keys, values)
    strided = ev.question_probes(kv, ids)
    assert strided.layer_stride == 2 and strided.queries.shape[0] == math.ceil(count / 2)
    names = ["knorm@0.5", "keydiff@0.3", "int4"]
    every = Probes(whole.queries, whole.keys, whole.values)
    assert ev.raw_scores(kv, names, strided, StoredForm()) == ev.raw_scores(
        kv, names, every, StoredForm()
    )
    with pytest.raises(InvalidArgumentError, match="cannot be read at stride"):
        QueryAttentionEvaluator(model_dir, layer_stride=3).raw_scores(kv, names, strided,
                                                                      StoredForm())  # fmt: skip


# -- a child context, scored after its ancestors' KV (issue 29) --------------------------------


def with_prefix(kv: ContextKV, p: int = 64) -> ContextKV:
    """``kv`` as a child after ``p`` tokens of an ancestor's KV."""
    g = torch.Generator().manual_seed(9)
    pk = torch.randn(L, H, p, D, generator=g) * 1.2
    pv = torch.randn(L, H, p, D, generator=g)
    return ContextKV(kv.keys, kv.values, prefix_keys=pk, prefix_values=pv)


def prefixed_reference(kv: ContextKV, variant: str, probes: Probes) -> torch.Tensor:
    """As :func:`reference_errors`, each output over the prefix (kept whole in every variant)
    then the context (the variant's, or the original) then the question's own keys."""
    (item,) = variant_kvs(ContextKV(kv.keys, kv.values), [variant], FORM)
    pk, pv = kv.prefix_keys, kv.prefix_values
    assert pk is not None and pv is not None
    g = HQ // H
    out = []
    for layer in range(L):
        q = probes.queries[layer].reshape(H, g * T, D) / math.sqrt(D)
        own_k, own_v = probes.own_keys[layer], probes.own_values[layer]  # type: ignore[index]
        rows = []
        for r in range(g * T):
            t = r % T
            own = (own_k[:, : t + 1], own_v[:, : t + 1])
            ctx = (
                torch.cat([pk[layer], kv.keys[layer]], 1),
                torch.cat([pv[layer], kv.values[layer]], 1),
            )
            var = (
                torch.cat([pk[layer], item.keys[layer]], 1),
                torch.cat([pv[layer], item.values[layer]], 1),
            )
            full = _attend(q[:, r : r + 1], ctx, own)
            got = _attend(q[:, r : r + 1], var, own)
            rows.append(((got - full).norm(dim=-1) / full.norm(dim=-1)).clamp(max=1.0)[:, 0])
        out.append(torch.stack(rows, dim=1))
    return torch.stack(out)


@pytest.mark.parametrize("variant", ["knorm@0.5", "int8", "int4"])
def test_a_child_is_scored_with_its_ancestors_kv_before_it(variant: str) -> None:
    """The prefix's entries join every output (the variant compresses the child's own only):
    the errors are those of attending over prefix + child, and not those of the child alone."""
    from kvtierd.profiler.query_attention_reference import reference_errors as old_way

    alone, probes = structured()
    child = with_prefix(alone)
    ev = QueryAttentionEvaluator(calibrate=False, layer_stride=1)
    got = ev.errors(child, [variant, "int4"], probes, FORM)[variant]
    assert torch.allclose(got, prefixed_reference(child, variant, probes), atol=2e-5)
    assert torch.allclose(got, old_way(child, [variant], probes, FORM)[variant], atol=1e-5)
    without = ev.errors(alone, [variant], probes, FORM)[variant]
    assert float((got - without).abs().max()) > 1e-3  # the prefix changes what is read
    strided = QueryAttentionEvaluator(calibrate=False, layer_stride=2)
    assert torch.allclose(strided.errors(child, [variant], probes, FORM)[variant], got[::2],
                          atol=1e-6)  # fmt: skip


def test_a_childs_question_runs_after_its_ancestors(tiny_llama_dir: Path) -> None:
    """The question's pass reads the ancestors' KV and runs at positions after them and the
    child: its queries are those of one prefill of ancestors + child + question, which the
    child's own KV alone does not give."""
    from kvtierd.profiler.window_queries import prefill_with_window_queries, window_model

    model = window_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 200, (1, 96), generator=g)
    p, n = 48, 32  # ancestors' tokens, the child's
    cache, queries = prefill_with_window_queries(model, ids, window=16)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    ev = QueryAttentionEvaluator(str(tiny_llama_dir), calibrate=False, question_dtype="",
                                 layer_stride=1)  # fmt: skip
    child = ContextKV(keys[:, :, p : p + n].contiguous(), values[:, :, p : p + n].contiguous(),
                      prefix_keys=keys[:, :, :p], prefix_values=values[:, :, :p])  # fmt: skip
    question = ids[0, p + n :].tolist()
    seen = ev.question_probes(child, question)
    assert torch.allclose(seen.queries, queries, atol=1e-4)
    assert torch.allclose(seen.own_keys, keys[:, :, p + n :], atol=1e-4)  # type: ignore[arg-type]
    alone = ev.question_probes(ContextKV(child.keys, child.values), question)
    assert not torch.allclose(alone.queries, queries, atol=1e-2)
    names = ["knorm@0.5", "int4"]
    res = ev.evaluate(child, names, [ProfilingQuery(token_ids=tuple(question))])
    direct = ev.raw_scores(child, names, seen, StoredForm())
    assert res["int4"] == pytest.approx(direct["int4"], abs=1e-5)
    assert direct != ev.raw_scores(ContextKV(child.keys, child.values), names, alone, StoredForm())
