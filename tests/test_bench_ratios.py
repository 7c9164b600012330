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


def _report(allocator: str) -> dict:
    env = dict(date="2026-11-28 08:51 UTC", cpu="AMD EPYC", threads=2, torch="2", torchvision="0", timm="1", vtdense="0",
               load_average_at_start=[0.5, 0.5, 0.5], cpu_count=2, allocator=allocator)
    row = dict(contender="vtdense", median_ms=400.0, min_ms=390.0, max_ms=420.0, images_per_s=20.0, gflops_per_s=None,
               pct_of_peak=None, memory_mib=None, vs_best_peer=1.2, vs_best_peer_rounds=[1.1, 1.2, 1.3])
    case = dict(name="Swin-T inference, batch 8 at 224", rows=[row], errors={}, repeats=3)
    return dict(device="cpu", tier="default", environment=env, peak_gflops=200.0, peak_dtype="float32", peak_by_library={},
                cases=[case], skipped="", left_out="", budget_s=None, extras={}, seconds=1.0)


def test_the_table_says_which_allocator_the_timed_rows_ran_with() -> None:
    steady = run.markdown(_report("keep_freed_memory()"))
    assert "Allocator: keep_freed_memory() (timed rows; `--keep-freed-memory`)." in steady
    assert "| 1.20 (1.10-1.30) |" in steady
    assert "Allocator" not in run.markdown(_report("default"))  # what `make bench` runs: a default process
