"""Answer quality in bench_e2e's summary, measured sharply (issue 39, item 5).

* :func:`same_answer` — whether a system's answer is identical to the full KV's (the
  ``prefill`` system's answer to the same request) over its first :data:`EXACT_TOKENS` tokens.
  The client records answers as text, so both are tokenized again by the served model's
  tokenizer (the same way for both: equal texts give equal ids).
* :func:`equal_quality` — when a system's answers count as a baseline's: its share of identical
  answers and its accuracy are each at least the low end of the baseline's 95% interval.
  MiniLM similarity stays in the tables but decides nothing: "within 3 points" of it hid a
  16% drop in identical answers (issue 39, seed 7).
* :func:`frontier_rows` — each EvicPress system against the frontier of the fixed policies
  that ran beside it (``e2e_frontier.py``): ``lru`` (every context kept whole) and every
  ``fixed-<variant>``, with paired bootstrap intervals over the run's requests;
  :func:`frontier_lines` the summary's table of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.e2e.e2e_frontier import Served, judge_bootstrap
from benchmarks.e2e.e2e_stats import Interval

EXACT_TOKENS = 16
"""Answers are identical when their first this many tokens are (issue 39)."""


def same_answer(reference: str, answer: str, tokenize: Callable[[str], Sequence[int]]) -> bool:
    """``answer`` is ``reference`` over the first :data:`EXACT_TOKENS` tokens."""
    return list(tokenize(reference))[:EXACT_TOKENS] == list(tokenize(answer))[:EXACT_TOKENS]


def equal_quality(ours: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
    """``ours`` answers as well as ``base`` (bench_e2e's rows; module docstring). A row from
    before exact-match shares were recorded raises ``ValueError``: similarity does not stand
    in for them."""
    for row in (ours, base):
        if "exact" not in row:
            raise ValueError("a summary row without its exact-match share (from before issue "
                             "39): rerun bench_e2e on its --out to summarise it again (the "
                             "systems' results are kept)")  # fmt: skip
    low = base["intervals"]
    return bool(ours["exact"] >= low["exact"][1] and ours["accuracy"] >= low["accuracy"][1])


def is_fixed(name: str) -> bool:
    """A system of the fixed frontier: one form for every context, LRU eviction."""
    return name == "lru" or name.startswith("fixed-")


def is_ours(name: str) -> bool:
    return name.startswith("evicpress")


def frontier_rows(
    served: Mapping[str, Mapping[int, tuple[bool, float]]],
) -> dict[str, dict[str, Any]]:
    """Per EvicPress system, its judgment against the fixed frontier (module docstring), from
    each system's ``{request index: (identical answer, TTFT)}`` of its requests that did not
    fail; the requests every system of the judgment served. Nothing without a fixed system."""
    fixed = [n for n in served if is_fixed(n)]
    out: dict[str, dict[str, Any]] = {}
    for ours in (n for n in served if is_ours(n)) if fixed else ():
        names = [ours, *fixed]
        common = sorted(set.intersection(*(set(served[n]) for n in names)))
        if not common:
            continue
        paired = {n: Served([served[n][i][0] for i in common], [served[n][i][1] for i in common])
                  for n in names}  # fmt: skip
        j = judge_bootstrap(ours, fixed, paired)
        at_share, at_ttft = j.judgment.ttft_at_share, j.judgment.share_at_ttft
        out[ours] = {
            "fixed": fixed, "requests": len(common),
            "frontier": [p.name for p in j.judgment.front],
            "exact": j.judgment.ours.exact_share, "ttft_mean_s": j.judgment.ours.ttft_s,
            "ttft_at_share_s": [at_share.value, at_share.span.value],
            "share_at_ttft": [at_ttft.value, at_ttft.span.value],
            "speedup": [j.speedup.point, j.speedup.low, j.speedup.high],
            "share_gain": [j.share_gain.point, j.share_gain.low, j.share_gain.high],
        }  # fmt: skip
    return out


def frontier_lines(judged: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The summary's section on ``frontier_rows``' output (nothing when it is empty)."""
    if not judged:
        return []
    some = next(iter(judged.values()))
    lines = [
        "\nAgainst the frontier of fixed policies (issue 39): the piecewise-linear frontier "
        f"through {', '.join(some['frontier'])} (of {', '.join(some['fixed'])}) in (share of "
        f"answers identical to the full KV's over {EXACT_TOKENS} tokens, mean TTFT); speedup: "
        "the frontier's TTFT at the system's share over its TTFT (> 1: faster at equal "
        "answers); answers gained: its share less the frontier's at its TTFT (> 0: more "
        "identical answers as fast); 95% paired bootstrap over the requests; (below)/(above): "
        "outside the frontier's span, the nearest fixed policy's value, a bound:\n",
        "| system | identical answers | TTFT (s) | frontier TTFT at its share (s) | speedup "
        "| frontier share at its TTFT | answers gained |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, j in judged.items():
        at_share, at_ttft = j["ttft_at_share_s"], j["share_at_ttft"]
        lines.append(
            f"| {name} | {j['exact']:.3f} | {j['ttft_mean_s']:.3f} | {_read(at_share)} | "
            f"{Interval(*j['speedup'])}x | {_read(at_ttft)} | {Interval(*j['share_gain'])} |"
        )
    return lines


def _read(reading: Sequence[Any]) -> str:
    value, span = reading
    return f"{value:.3f}" + ("" if span == "inside" else f" ({span})")
