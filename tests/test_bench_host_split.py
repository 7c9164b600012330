"""benchmarks/host_split.py runs on the CPU at a tiny size and splits each step into its phases."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_split  # noqa: E402


def test_host_split_times_every_phase_of_every_contender(capsys) -> None:  # noqa: ANN001
    results = host_split.main(["--device", "cpu", "--case", "swin", "--tiny", "--steps", "2"])
    assert set(results) == {"vtdense", "vtdense unfused", "timm fused"}
    for r in results.values():
        assert set(r) == {"forward", "backward", "optimizer", "step"}  # no device column off CUDA
        assert all(r[k] > 0 for k in r)
        assert r["step"] >= max(r["forward"], r["backward"], r["optimizer"])
    table = capsys.readouterr().out
    assert "| vtdense unfused |" in table and "median ms per step" in table
