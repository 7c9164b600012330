"""vtdense.allocator.keep_freed_memory: glibc keeps freed CPU memory, so repeated forwards stop
faulting pages in, and the recipes' entry point applies it unless the environment says not to."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vtdense import allocator, cli

_GLIBC = allocator._glibc() is not None

# A tiny Swin at 448x448, batch 2: stage-1 tensors of a few MiB, as in a real forward. Prints the
# minor page faults per forward after two warm-up forwards.
_WORKLOAD = """
import json, resource, sys, torch
torch.set_num_threads(1)
from vtdense.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
import vtdense
m = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]).eval()
x = torch.randn(2, 3, 448, 448)
with torch.inference_mode():
    m(x); m(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        m(x)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
    out = subprocess.run([sys.executable, "-c", _WORKLOAD, mode], check=True, capture_output=True, text=True,
                         env=env, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not _GLIBC, reason="keep_freed_memory acts on glibc only")
def test_kept_memory_stops_the_page_faults_of_repeated_forwards() -> None:
    default, kept = _faults("default"), _faults("keep")
    assert kept["applied"] is True
    # measured (one thread): about 9,900 faults per forward by default, about 340 with the setting
    assert default["faults"] > 2000, default
    assert kept["faults"] < default["faults"] / 10, (default, kept)


def test_out_of_range_thresholds_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="mmap_threshold"):
        allocator.keep_freed_memory(mmap_threshold=64 << 20)
    with pytest.raises(ValueError, match="trim_threshold"):
        allocator.keep_freed_memory(trim_threshold=1 << 31)


@pytest.mark.parametrize("value, called", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_run_script_keeps_freed_memory_unless_the_environment_says_no(monkeypatch: pytest.MonkeyPatch,
                                                                      value: str | None, called: bool) -> None:
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    if value is None:
        monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(allocator.ENV_VAR, value)
    ran = []
    cli.run_script(lambda: ran.append(1))
    assert ran == [1] and calls == ([1] if called else [])
