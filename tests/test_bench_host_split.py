"""benchmarks/host_split.py runs on the CPU at a tiny size and splits each step into its phases."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_split  # noqa: E402


def test_host_split_times_every_phase_of_every_contender(capsys) -> None:  # noqa: ANN001
    results = host_split.main(["--device", "cpu", "--case", "swin", "--tiny", "--steps", "2", "--warmup", "1"])
    assert set(results) == {"vtdense", "vtdense unfused", "timm fused"}
    for r in results.values():
        assert set(r) == {"forward", "backward", "optimizer", "step"}  # no device column off CUDA
        assert all(r[k] > 0 for k in r)
        assert r["step"] >= max(r["forward"], r["backward"], r["optimizer"])
    table = capsys.readouterr().out
    assert "| vtdense unfused |" in table and "median ms per step" in table


def test_host_split_takes_named_contenders_and_times_them_in_rounds(monkeypatch) -> None:  # noqa: ANN001
    """``--contenders`` ('_' for a space) replaces the case's; the steps alternate between the
    contenders after each one's warm-up (so a drift of the machine's pace falls on all alike)."""
    order: list[str] = []
    real = host_split._timed_step

    def timed(phases, cuda, sync):  # noqa: ANN001, ANN202
        order.append(names[id(phases)])
        return real(phases, cuda, sync)

    names: dict[int, str] = {}
    real_phases = host_split._phases

    def phases(contender, case, device):  # noqa: ANN001, ANN202
        p = real_phases(contender, case, device)
        names[id(p)] = contender
        return p

    monkeypatch.setattr(host_split, "_timed_step", timed)
    monkeypatch.setattr(host_split, "_phases", phases)
    results = host_split.main(["--device", "cpu", "--case", "swin", "--tiny", "--steps", "3", "--warmup", "2",
                               "--contenders", "vtdense_unfused", "timm_fused"])
    assert list(results) == ["vtdense unfused", "timm fused"]
    warm = ["vtdense unfused"] * 2 + ["timm fused"] * 2
    assert order == warm + ["vtdense unfused", "timm fused"] * 3


def test_a_contender_that_fails_is_named_and_the_others_still_run(capsys) -> None:  # noqa: ANN001
    results = host_split.main(["--device", "cpu", "--case", "swin", "--tiny", "--steps", "1", "--warmup", "1",
                               "--contenders", "vtdense_nonsense-switch", "timm_fused"])
    assert list(results) == ["timm fused"]
    out = capsys.readouterr().out
    assert "vtdense nonsense-switch: failed," in out and "| timm fused |" in out
