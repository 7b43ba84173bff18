"""bench_e2e's workload where contexts differ (``--workload kinds``, issue 39) and its systems,
without a model: a whitespace tokenizer with a stand-in chat template takes SmolLM2's place
(lengths and token ids only); and ``--help`` of every command changed for it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.e2e.bench_e2e import systems, workload_args
from benchmarks.e2e.e2e_workload import (
    WORKLOADS,
    kind_prompts,
    length_class,
    make_documents,
    make_kind_contexts,
    make_requests,
)
from benchmarks.quality.context_kinds import KINDS
from kvtierd.policies.loader import parse_policy

REPO = Path(__file__).resolve().parents[1]
LENGTHS = [300, 600]


class Chat:
    """Counts words as tokens; a word's id is its order of first sight; the chat template
    wraps each message in role markers and opens the assistant's turn."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def ids(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": self.ids(text)}

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> list[int]:  # fmt: skip
        turns = "".join(f"<start>{m['role']} {m['content']} <end> " for m in messages)
        return self.ids(turns + "<start>assistant")


def test_kind_contexts_are_deterministic_and_cover_every_kind_at_every_length() -> None:
    one = make_kind_contexts(Chat(), 30, LENGTHS, seed=1)
    assert one == make_kind_contexts(Chat(), 30, LENGTHS, seed=1)
    assert one != make_kind_contexts(Chat(), 30, LENGTHS, seed=2)
    assert [c.kind for c in one[:7]] == [*KINDS, KINDS[0]]
    assert [c.length for c in one] == [length_class(i, LENGTHS) for i in range(30)]
    assert {(c.kind, c.length) for c in one} == {(k, n) for k in KINDS for n in LENGTHS}
    assert [c.seed for c in one[:3]] == [1000, 1001, 1002]  # as make_contexts seeds its cases


def test_kind_prompts_ask_each_question_and_open_the_reply_with_its_lead() -> None:
    tok = Chat()
    contexts = make_kind_contexts(tok, 6, LENGTHS, seed=0)
    table = kind_prompts(tok, contexts, 16)
    for case, row in zip(contexts, table, strict=True):
        assert len(row) == len(case.questions) >= 1
        lengths = {p.context_tokens for p in row}
        assert len(lengths) == 1 and lengths.pop() % 16 == 0  # one context per document
        for (question, lead, answer), p in zip(case.questions, row, strict=True):
            assert p.answers == (answer,)
            lead_ids, asked = tok.ids(lead), tok.ids(question)
            assert list(p.ids[-len(lead_ids) :]) == lead_ids  # the reply starts with the lead
            before = list(p.ids[: -len(lead_ids)])
            at = len(before) - len(asked) - 2  # the question, then <end> <start>assistant
            assert before[at : at + len(asked)] == asked


def test_make_documents_picks_the_workload_by_name() -> None:
    docs = make_documents(Chat(), "kinds", n=6, lengths=LENGTHS, seed=3, chunk_tokens=16)
    tok = Chat()
    assert docs.contexts == tuple(make_kind_contexts(tok, 6, LENGTHS, 3))
    assert [len(row) for row in docs.table] == [len(c.questions) for c in docs.contexts]
    assert set(WORKLOADS) == {"tasks", "kinds"}
    with pytest.raises(ValueError, match="unknown workload 'poems'; known: tasks, kinds"):
        make_documents(Chat(), "poems", n=1, lengths=LENGTHS, seed=0, chunk_tokens=16)


def test_kind_requests_keep_the_arrivals_and_ask_existing_questions() -> None:
    contexts = make_kind_contexts(Chat(), 12, LENGTHS, seed=1)
    gaps = [0.5, 2.0, 1.0, 0.1, 3.0, 0.4] * 10
    reqs = make_requests(contexts, num=40, qps=0.5, zipf_s=1.0, seed=1, gaps=gaps)
    assert reqs == make_requests(contexts, num=40, qps=0.5, zipf_s=1.0, seed=1, gaps=gaps)
    assert all(r.question < len(contexts[r.context].questions) for r in reqs)
    # fewer questions per context change which are asked, never when: the same arrivals
    fewer = [replace(c, questions=c.questions[:2]) for c in contexts]
    other = make_requests(fewer, num=40, qps=0.5, zipf_s=1.0, seed=1, gaps=gaps)
    assert [r.at_s for r in other] == [r.at_s for r in reqs]
    assert all(r.question < 2 for r in other)


def test_the_new_systems_are_the_preset_policies_they_name(tmp_path: Path) -> None:
    fixed = ["int8", "int4", "keydiff@0.7+int8"]
    every = systems([2.0], fixed, tmp_path, ["knorm", "int4"], [1.0, 0.5], profile_share=0.5)
    assert list(every) == ["prefill", "lmcache", "lru", "fixed-int8", "fixed-int4",
                           "fixed-keydiff@0.7+int8", "evicpress-a2",
                           "evicpress-prior-a2"]  # fmt: skip
    for v in fixed:
        policy = parse_policy(yaml.safe_dump(every[f"fixed-{v}"].policy), f"fixed-{v}")
        assert (policy.placer, policy.fixed_variant) == ("fixed", v)
    ours, prior = every["evicpress-a2"].policy, every["evicpress-prior-a2"].policy
    assert ours is not None and prior is not None
    assert ours["profiling"] == {"estimator": "query_attention", "max_share": 0.5,
                                 "model_dir": str(tmp_path)}  # fmt: skip
    # the same daemon and policy, profiles from the prior only: no model to read
    assert prior["profiling"] == {"estimator": "query_attention", "max_share": 0.5}
    assert {k: v for k, v in prior.items() if k not in ("name", "profiling")} == {
        k: v for k, v in ours.items() if k not in ("name", "profiling")
    }
    assert parse_policy(yaml.safe_dump(prior), "evicpress-prior-a2").placer == "evicpress"


def test_the_workload_arguments_default_to_the_tasks_and_the_fixed_frontier() -> None:
    import argparse

    p = argparse.ArgumentParser()
    workload_args(p)
    args = p.parse_args([])
    assert args.workload == "tasks"
    assert {"int8", "int4", "keydiff@0.7+int8"} <= set(args.fixed)
    assert p.parse_args(["--workload", "kinds"]).workload == "kinds"


@pytest.mark.parametrize(
    ("module", "says"),
    [
        ("benchmarks.e2e.bench_e2e", ["--workload {tasks,kinds}", "keydiff@0.7+int8"]),
        ("benchmarks.e2e.e2e_matrix", ["kinds-seed1", "kinds-seed2", "without lmcache"]),
        ("benchmarks.e2e.sim_e2e", ["--workload {tasks,kinds}"]),
    ],
)
def test_every_changed_command_answers_help(module: str, says: list[str]) -> None:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps help at the terminal's width
    for s in says:
        assert s in text, (s, text)
