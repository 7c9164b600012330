"""The multi-process test runner (``tests/ranks.py``) leaves no rank behind when a run times out."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ranks import run_ranks

# a "launcher" that starts a "rank" and both wait forever, as a hung gloo collective would
HANG = """
import os, subprocess, sys, time
quiet = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}  # one stack printed, not interleaved
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=quiet)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def test_a_timed_out_run_dumps_the_stacks_and_kills_every_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    with pytest.raises(pytest.fail.Exception, match=r"timed out after 3 s(.|\n)*Fatal Python error: Aborted(.|\n)*most recent call first"):
        run_ranks([sys.executable, "-c", HANG, str(pid_file)], cwd=tmp_path, env=env, timeout=3)
    child = int(pid_file.read_text())
    for _ in range(50):  # the rank is gone too (reaped by init once killed)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"rank {child} outlived its timed-out launcher")
    ok = run_ranks([sys.executable, "-c", "print('fine')"], cwd=tmp_path, env=env, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "fine"
