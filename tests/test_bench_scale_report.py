"""bench_scale judges each of issue 42's goals at the N the issue sets it for, not at the
largest N run (a 1M run's first rebalance is not the 100k goal's)."""

from __future__ import annotations

import pytest

from benchmarks.e2e.bench_scale import ROWS, Figures, goal_mark, report


def test_a_goal_is_judged_at_its_own_n_and_said_not_run_without_it() -> None:
    values = {100_000: 0.25, 1_000_000: 4.3}
    assert goal_mark(values, 2.0, False, 100_000) == "  <= 2 at N=100,000: PASS"
    assert goal_mark({1_000_000: 1.5}, 2.0, False, 100_000) == "  <= 2 at N=100,000: not run"
    assert goal_mark({100_000: 2.5}, 2.0, False, 100_000) == "  <= 2 at N=100,000: FAIL"
    assert goal_mark({100_000: 0.95}, 0.9, True, 100_000) == "  >= 0.9 at N=100,000: PASS"
    assert goal_mark(values, 0, False, 0) == ""


def test_every_goal_names_an_n_and_every_field_is_a_figure() -> None:
    fields = set(Figures.__dataclass_fields__)
    for field, _label, goal, _higher, at_n in ROWS:
        assert field in fields
        assert (goal == 0) == (at_n == 0), field


def test_the_report_marks_the_100k_goal_from_the_100k_run(capsys: pytest.CaptureFixture[str]):
    small, large = Figures(100_000), Figures(1_000_000)
    small.first_rebalance_pass_s, large.first_rebalance_pass_s = 0.25, 4.3
    report([small, large])
    line = next(x for x in capsys.readouterr().out.splitlines() if "placer's pass" in x)
    assert line.endswith("<= 2 at N=100,000: PASS"), line
