"""The steady-state benchmark's worker runs every vtdense variant, training and inference, and
reports what it measured (no timing is asserted: speed is for the benchmark itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import steady  # noqa: E402

from vtdense.layers.chunked import set_cpu_chunking  # noqa: E402


def test_worker_runs_chunked_and_unchunked_training_steps() -> None:
    try:
        for contender in ("vtdense", "vtdense unchunked"):
            out = steady._worker(contender, "swin_t", "train", (64, 96), 1, 2, 1)
            assert len(out["times"]) == 2 and all(t > 0 for t in out["times"]) and out["faults"] >= 0
    finally:
        set_cpu_chunking(True)
    assert set(steady.CONTENDERS["train"]) == {"swin_t", "swinv2_t"}


def test_worker_runs_inference_for_every_family() -> None:
    for family in steady.CONTENDERS["infer"]:
        out = steady._worker("vtdense", family, "infer", (64, 64), 1, 1, 1, warmup=0)
        assert len(out["times"]) == 1 and out["times"][0] > 0


def test_bad_options_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        steady.main(["--mode", "train", "--family", "mvitv2_t"])
    assert "--family mvitv2_t" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        steady.main(["--mode", "infer", "--size", "224"])
    assert "--size '224'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        steady.main(["--mode", "infer", "--contenders", "timm compiled"])
    assert "timm compiled" in capsys.readouterr().err
