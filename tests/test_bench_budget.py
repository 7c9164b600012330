"""``benchmarks/run.py --budget``: the cases come before the four sections that follow them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import run  # noqa: E402


def test_a_short_budget_keeps_at_most_half_for_the_sections() -> None:
    total = sum(run.EXTRAS_SECONDS["cuda"].values())
    assert run.extras_reserve("cuda", 255, True) == 127.5 < total  # the H200 session's budget
    assert run.extras_reserve("cuda", 4000, True) == total
    assert run.extras_reserve("cuda", 0, True) == total  # no budget: nothing to share
    assert run.extras_reserve("cuda", 255, False) == 0.0


def test_a_section_runs_only_if_its_estimate_fits() -> None:
    need = run.EXTRAS_SECONDS["cuda"]["recipe"]
    assert run.extra_fits("cuda", "recipe", None)
    assert run.extra_fits("cuda", "recipe", need)
    assert not run.extra_fits("cuda", "recipe", need - 1)
