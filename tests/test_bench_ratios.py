"""``benchmarks/run.py``: ``vs best peer`` with its spread over the rounds of one run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import run  # noqa: E402


def test_paired_ratios_divide_round_by_round_and_sort() -> None:
    # the host slowed down in round 2 for both contenders: the ratio of that round stays near the others
    peer, own = [500.0, 700.0, 510.0], [400.0, 560.0, 425.0]
    assert run.paired_ratios(peer, own) == pytest.approx([1.2, 1.25, 1.25])
    with pytest.raises(ValueError, match="3 peer rounds against 2"):
        run.paired_ratios(peer, own[:2])


def test_the_ratio_cell_shows_the_range_when_there_are_rounds() -> None:
    assert run._ratio_cell({"vs_best_peer": 1.2133, "vs_best_peer_rounds": [1.17, 1.21, 1.244]}) == "1.21 (1.17-1.24)"
    assert run._ratio_cell({"vs_best_peer": 1.2133}) == "1.21"  # results written before the rounds were kept
    assert run._ratio_cell({"vs_best_peer": 1.2133, "vs_best_peer_rounds": [1.2133]}) == "1.21"
    assert run._ratio_cell({}) == ""  # a peer's own row
