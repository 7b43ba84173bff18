"""The ``answer`` evaluator end to end: a tiny local Llama, our kernels, MiniLM, offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtierd.errors import InvalidArgumentError
from kvtierd.profiler import ProfilingQuery, make_evaluator
from kvtierd.profiler.answer import AnswerEvaluator
from kvtierd.profiler.greedy import greedy_decode
from kvtierd.profiler.variant_kv import pad_left, variant_kvs

CONTEXT = (
    "Marie Curie was born in Warsaw in 1867. She moved to Paris to study physics and "
    "chemistry at the Sorbonne, where she met Pierre Curie. Together they discovered polonium "
    "and radium. She won the Nobel Prize in Physics in 1903 and in Chemistry in 1911. "
) * 3
QUERIES = [
    ProfilingQuery(text="Where was Marie Curie born?"),
    ProfilingQuery(text="Which elements did the Curies discover?"),
    ProfilingQuery(text="When did she win the Nobel Prize in Chemistry?"),
]


@pytest.fixture(scope="module")
def evaluator(tiny_llama_dir: Path) -> AnswerEvaluator:
    ev = make_evaluator("answer", {"model_path": str(tiny_llama_dir), "max_new_tokens": 8})
    assert isinstance(ev, AnswerEvaluator)
    return ev


def test_answers_continue_the_uncompressed_run(evaluator: AnswerEvaluator) -> None:
    """Decoding from the stored KV (positions from N) equals generating from the whole prompt."""
    model, _tok = evaluator.load()
    kv = evaluator.encode_context(CONTEXT)
    q = evaluator.query_ids(QUERIES[0])
    (ours,) = greedy_decode(
        model, pad_left(variant_kvs(kv, ["none"])), q,
        context_tokens=kv.num_tokens, max_new_tokens=8, eos_token_ids=frozenset(),
    )  # fmt: skip
    prompt = torch.tensor([[*kv.token_ids, *q]])
    ref = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert ours == ref[0, prompt.shape[1] :].tolist()


def test_padding_a_row_does_not_change_its_answer(evaluator: AnswerEvaluator) -> None:
    model, _ = evaluator.load()
    kv = evaluator.encode_context(CONTEXT)
    q = evaluator.query_ids(QUERIES[1])
    items = variant_kvs(kv, ["none", "knorm@0.5"])
    alone = greedy_decode(model, pad_left(items[1:]), q, context_tokens=kv.num_tokens,
                          max_new_tokens=8, eos_token_ids=frozenset())  # fmt: skip
    batched = greedy_decode(model, pad_left(items), q, context_tokens=kv.num_tokens,
                            max_new_tokens=8, eos_token_ids=frozenset())  # fmt: skip
    assert batched[1] == alone[0]


def test_quality_of_variants(evaluator: AnswerEvaluator) -> None:
    kv = evaluator.encode_context(CONTEXT)
    names = ["none", "int8", "knorm@0.9", "streamingllm@0.1", "knorm@0.1+int4"]
    res = evaluator.evaluate(kv, names, QUERIES)
    assert res.evaluator == "answer" and res.num_queries == 3
    assert res["none"] == 1.0  # identical answers -> identical strings -> exactly 1
    assert all(0.0 <= res[n] <= 1.0 for n in names)
    assert len(res.per_query["int8"]) == 3
    assert res["streamingllm@0.1"] < 1.0
    assert res["knorm@0.1+int4"] < 1.0
    assert res.elapsed_s > 0


@pytest.mark.model
@pytest.mark.slow
def test_quality_orders_variants_on_the_real_model(real_model: Path) -> None:
    """Which variant is better is a question for a real model (a random one orders noise): on
    a multi-key needle context of the quality benchmark (1k tokens, its three questions), int8
    answers as the full KV does, and a tenth of the tokens loses the needles."""
    from transformers import AutoTokenizer

    from benchmarks.quality.quality_tasks import make_case, split_prompt
    from kvtierd.profiler import StoredForm

    tok = AutoTokenizer.from_pretrained(real_model)
    case = make_case(tok, "niah_multikey", 1024, 0)
    evaluator = AnswerEvaluator(str(real_model))
    kv = evaluator.encode_context(split_prompt(tok, case).context)
    queries = [ProfilingQuery(token_ids=tuple(split_prompt(tok, case, question=q).query))
               for q, _ in case.questions]  # fmt: skip
    names = ["int8", "streamingllm@0.1", "knorm@0.1+int4"]
    res = evaluator.evaluate(kv, names, queries, form=StoredForm(chunk_tokens=16))
    print({v: round(q, 3) for v, q in res.quality.items()})  # measured: 1.0, 0.913, 0.931
    assert res["int8"] > 0.99
    assert res["int8"] > res["streamingllm@0.1"] + 0.05
    assert res["int8"] > res["knorm@0.1+int4"] + 0.05


def test_kv_of_another_model_is_rejected(evaluator: AnswerEvaluator) -> None:
    from kvtierd.profiler import ContextKV

    kv = ContextKV(keys=torch.zeros(3, 2, 8, 16), values=torch.zeros(3, 2, 8, 16))
    with pytest.raises(InvalidArgumentError, match="the model expects"):
        evaluator.evaluate(kv, ["int8"], QUERIES[:1])
    with pytest.raises(InvalidArgumentError, match="at least one"):
        evaluator.evaluate(kv, ["int8"], [])


def test_missing_model_directory_fails_without_downloading(tmp_path: Path) -> None:
    ev = AnswerEvaluator(model_path=str(tmp_path / "absent"))
    with pytest.raises(InvalidArgumentError, match="cannot load a causal LM"):
        ev.load()


def test_exact_match_scores_the_share_of_unchanged_answers(tiny_llama_dir: Path) -> None:
    """``scoring="exact_match"``: 1.0 where a variant's greedy answer is token-identical to the
    full KV's, else 0.0, averaged over queries; no embedder is built."""
    ev = make_evaluator(
        "answer",
        {"model_path": str(tiny_llama_dir), "max_new_tokens": 8, "scoring": "exact_match"},
    )
    assert isinstance(ev, AnswerEvaluator)
    kv = ev.encode_context(CONTEXT)
    names = ["none", "int8", "streamingllm@0.1", "knorm@0.1+int4"]
    res = ev.evaluate(kv, names, QUERIES)
    ids = ev.answer_ids(kv, names, QUERIES)
    for i, v in enumerate(names):
        want = sum(float(q[i] == q[0]) for q in ids) / len(QUERIES)
        assert res[v] == want
    assert res["none"] == 1.0
    assert min(res.quality.values()) < 1.0  # some variant changed some answer
    assert ev._embedder is None


def test_unknown_scoring_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="scoring must be one of similarity, exact"):
        AnswerEvaluator(str(tiny_llama_dir), scoring="bleu")
