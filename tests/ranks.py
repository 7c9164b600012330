"""Run a command that starts several processes (a launcher and its ranks), and never leave one behind.

``subprocess.run(..., timeout=)`` kills only the process it started: the ranks a launcher spawned
stay, and a rank left waiting in a gloo collective for a peer that is gone spins on the CPU until the
machine is rebooted, slowing every later test. :func:`run_ranks` starts the command in a session of
its own. On a timeout it sends the whole group ``SIGABRT`` first, so that every rank started with
``PYTHONFAULTHANDLER=1`` prints its Python stacks (where it hung), then ``SIGKILL``, and fails the
test with the end of that output.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

import pytest


def run_ranks(cmd: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` with the process group ended on a timeout."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGABRT, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # the session's group: the launcher and every rank it started
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                out, err = "", ""
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived their launcher
        except ProcessLookupError:
            pass
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n--- stderr (every rank's stacks) ---\n{(err or '')[-8000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
