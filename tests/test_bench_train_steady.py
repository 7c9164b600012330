"""The steady-state training benchmark's worker runs both vtdense variants and reports what it
measured (no timing is asserted: speed is for the benchmark itself)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import train_steady  # noqa: E402

from vtdense.layers.chunked import set_cpu_chunking  # noqa: E402


def test_worker_runs_chunked_and_unchunked_steps() -> None:
    try:
        for contender in ("vtdense", "vtdense unchunked"):
            out = train_steady._worker(contender, "swin_t", (64, 96), 1, 2, 1)
            assert len(out["times"]) == 2 and all(t > 0 for t in out["times"]) and out["faults"] >= 0
    finally:
        set_cpu_chunking(True)
    assert set(train_steady.CONTENDERS) == {"swin_t", "swinv2_t"}
