"""Running code in Triton's CPU interpreter, for the tests of the Triton kernels (no GPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, timeout: int = 300, **env_vars: str) -> Any:
    """Run ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (set before Triton is imported,
    hence the subprocess) and ``env_vars`` from the repository's root; return the JSON of its last
    output line. A failure raises with the end of its stderr."""
    env = dict(os.environ, TRITON_INTERPRET="1", **env_vars)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: code that stands in for CUDA events and ``torch.cuda.synchronize`` (every elapsed time 1 ms), for
#: running a GPU timing script in the interpreter; ``benchmarks`` on the path
GPU_TIMING_STUB = """
import sys, torch
sys.path.insert(0, "benchmarks")
class Event:
    def __init__(self, **kwargs): pass
    def record(self): pass
    def elapsed_time(self, other): return 1.0
torch.cuda.Event, torch.cuda.synchronize = Event, lambda: None
"""
