"""The compile-at-changing-sizes benchmark runs, counts recompilation and compares with eager
(no timing is asserted: speed is for the benchmark itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compile_sizes  # noqa: E402


def test_reports_first_calls_recompilation_and_steady_state(capsys: pytest.CaptureFixture[str]) -> None:
    # Dynamo's own capture (backend "eager") keeps it within seconds; both sizes share one graph
    report = compile_sizes.main(["--families", "swin_t", "--sizes", "64x96", "96x64", "--repeats", "1", "--backend", "eager",
                                 "--tiny"])
    row = report["families"]["swin_t"]
    assert "error" not in row, row
    assert len(row["first call s"]) == 2 and row["graphs/frames at the end"][0] == 1 and not row["recompiled"]
    assert list(row["steady ms"]) == ["64x96", "96x64"]
    assert all(v["eager"] > 0 and v["compiled"] > 0 for v in row["steady ms"].values())
    assert row["max abs diff"] < 1e-4
    assert "| swin_t | 96x64 |" in capsys.readouterr().out


def test_bad_options_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        compile_sizes.main(["--sizes", "512"])
    assert "--sizes '512'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compile_sizes.main(["--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err


def test_first_call_script_times_a_way_of_compiling_in_a_fresh_process(capsys: pytest.CaptureFixture[str]) -> None:
    """``compile_first.py``: ``compile_backbone`` timed in a fresh process, its trace attempts and its
    difference to eager (Dynamo's own capture, backend "eager", keeps it within seconds; the restart
    the script is written to show needs a lowering backend: ``test_mvitv2_rel_pos_fold``)."""
    import compile_first

    report = compile_first.main(["--tiny", "--families", "swin_t", "--backends", "eager", "--modes", "infer",
                                 "--size", "64x64", "--hows", "compile_backbone"])
    (row,) = report["rows"]
    cell = row["compile_backbone"]
    assert cell["attempts"] == 1 and cell["seconds"] > 0 and cell["max abs diff"] < 1e-5, row
    phases = cell["phases"]  # Dynamo's trace within the compile, the compile within the first call
    assert 0 < phases["dynamo"] <= phases["compile"] <= cell["seconds"] + 0.1, phases
    assert f"| swin_t | eager | infer | not run | not run | {cell['seconds']} (1) |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compile_first.main(["--size", "64"])
    assert "--size '64'" in capsys.readouterr().err


def test_training_script_compares_a_compiled_step_with_eager_at_each_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``compile_train_sizes.py``: a compiled training step per size, the graph count after it and
    the difference of outputs and parameter gradients to eager (Dynamo's own capture, backend
    "eager", keeps it within seconds; both sizes share one graph)."""
    import compile_train_sizes

    report = compile_train_sizes.main(["--families", "mvitv2 windows", "--backend", "eager", "--sizes", "64x96", "96x64",
                                       "--batch", "2", "1"])
    rows = report["mvitv2 windows"]
    assert [(r["batch"], r["size"]) for r in rows] == [(2, (64, 96)), (2, (96, 64)), (1, (96, 64))], rows
    assert all("error" not in r for r in rows), rows
    assert [r["graphs"] for r in rows] == [1, 1, 1]  # nor the batch of 1
    assert rows[0]["phases"]["dynamo"] > 0 and "phases" not in rows[1] and "phases" not in rows[2], rows
    assert all(0 <= r["max abs diff"] < 1e-5 for r in rows), rows
    assert "mvitv2 windows 96x64 (batch 1):" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compile_train_sizes.main(["--batch", "0"])
    assert "--batch 0" in capsys.readouterr().err
