"""The GPU check script (benchmarks/gpu_check.py) and its session wrapper work, run here on the CPU at
tiny sizes, so that a lent GPU's few minutes are not lost to a broken script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu_and_reports_parity_and_no_recompilation(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    report = gpu_check.main(["--device", "cpu", "--tiny", "--compile-backend", "eager", "--only", "swinv2_tiny",
                             "--out", str(out)])
    assert out.is_file()
    paths, comp = report["paths"]["swinv2_tiny"], report["compile"]["swinv2_tiny"]
    assert "error" not in paths and "error" not in comp, (paths, comp)
    for path in ("sdpa", "flex"):
        assert paths[f"{path} fp32 max abs diff"] < 1e-5
        assert 0 < paths[f"{path} bf16 max rel err"] < 5e-2  # bf16 really ran, and stays close
        # float32 against the float64 model: a few ulps of outputs of magnitude ~5, for every path
        assert 0 < paths[f"{path} fp32 max abs err vs fp64"] < 1e-5
    assert 1 < paths["output max abs"] < 100 and 0 < paths["math fp32 max abs err vs fp64"] < 1e-5
    assert paths["sdpa fp32 grad max abs diff"] < 1e-5
    assert len(comp["seconds per call"]) == 7
    assert comp["graphs/frames after two sizes"][0] == 1 and not comp["recompiled"]  # one graph, never rebuilt
    assert comp["trace attempts"] == 1  # Dynamo's own capture lowers nothing, so nothing restarts its trace
    assert comp["max abs diff to eager"] < 1e-5
    assert report["cuda graphs"]["swinv2_tiny"] == {"skipped": "CUDA graphs need a GPU"}
    assert "| swinv2_tiny | compile: recompiled | False |" in gpu_check.markdown(report)


def test_gpu_check_reports_a_failing_check_and_goes_on(monkeypatch) -> None:  # noqa: ANN001
    def broken(*args: object) -> dict:
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(gpu_check, "check_paths", broken)
    report = gpu_check.main(["--device", "cpu", "--tiny", "--no-compile", "--only", "mvitv2_tiny"])
    assert report["paths"]["mvitv2_tiny"] == {"error": "RuntimeError: no kernel image is available"}


def test_gpu_session_script_rejects_an_unknown_mode() -> None:
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "bogus"], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    assert "all [TOTAL_SECONDS]" in proc.stderr  # the one-call mode for a 15-minute device budget
    syntax = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr


def test_profile_script_prints_each_contenders_tables(capsys) -> None:
    """``benchmarks/profile_gpu.py`` (the session's last step) on the CPU's demo detector row."""
    import profile_gpu

    assert profile_gpu.main(["--device", "cpu", "--only", "CPU demo", "--top", "3", "--python"]) == 0
    out = capsys.readouterr().out
    assert "===== Mask R-CNN CPU demo train step" in out and ":: vtdense" in out
    assert "wall " in out and "Self CPU" in out
    assert "cProfile: wall" in out and "tottime" in out
    assert "by cumulative time, vtdense's functions:" in out and "vtdense/" in out.split("by cumulative time")[-1]
