"""Where a step's time goes, side by side: ``torch.profiler`` tables of vtdense and its peers.

    python benchmarks/profile_gpu.py --device cuda [--only REGEX] [--top 25]

For each selected case of :func:`run.cases` (default: the GPU rows where vtdense trails), every contender
runs 3 warm-up steps and 3 profiled steps; the script prints the wall time per step, the summed device
(or CPU) self time, and the top operators by self device time. Used to choose optimisations, not to
check targets (``run.py`` does that).
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import sync
from contenders import make_step
from run import cases

DEFAULT = r"Swin-T inference, batch 64|Swin-T train step, batch 8|published heads train step.*800x1333, (bf16|TF32)$"


def profile_step(step, device: str, top: int, host_table: bool = False) -> str:
    for _ in range(3):
        step()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(3):
            step()
        sync(device)
    wall = (time.perf_counter() - t0) / 3 * 1e3
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    total = sum(getattr(e, key) for e in events) / 3 / 1e3
    table = events.table(sort_by=key, row_limit=top, max_name_column_width=70)
    text = f"wall {wall:.1f} ms/step, summed self {'device' if device == 'cuda' else 'cpu'} time {total:.1f} ms/step\n{table}"
    if host_table and device == "cuda":
        text += "\nby host time:\n" + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    return text


def python_profile(step, device: str, top: int) -> str:
    """``cProfile`` over 5 steps after 3 warm-up steps: where the host's Python time goes, by function
    (the operators' own time shows up under their Python entry points), then vtdense's own functions
    by cumulative time. cProfile adds about a
    microsecond per Python call, so compare contenders, not absolute times."""
    import cProfile
    import io
    import pstats

    for _ in range(3):
        step()
    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(5):
        step()
    sync(device)
    prof.disable()
    wall = (time.perf_counter() - t0) / 5 * 1e3
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    calls = sum(v[1] for v in stats.stats.values()) / 5
    stats.sort_stats("tottime").print_stats(top)
    own = io.StringIO()  # where vtdense's own functions spend, callees included (forward vs backward, per layer)
    pstats.Stats(prof, stream=own).sort_stats("cumulative").print_stats(r"vtdense", top)
    return (f"cProfile: wall {wall:.1f} ms/step, {calls:.0f} Python calls/step\n" + out.getvalue()[-12000:]
            + "\nby cumulative time, vtdense's functions:\n" + own.getvalue()[-8000:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--only", default=DEFAULT)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host", action="store_true", help="also the table by host time for every case (always for detectors)")
    ap.add_argument("--python", action="store_true", help="also cProfile's table of Python functions by own time")
    ap.add_argument("--contenders", default="", help="regular expression over contender names (default: all but compiled)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device here")
            return 0
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    for case in cases():
        if case["device"] != args.device or not re.search(args.only, case["name"]):
            continue
        for contender in case["contenders"]:
            if "compiled" in contender or "ckpt" in contender or (args.contenders and not re.search(args.contenders, contender)):
                continue
            print(f"\n===== {case['name']} :: {contender}", flush=True)
            try:
                step = make_step(contender, case, args.device)
                print(profile_step(step, args.device, args.top, args.host or case['family'].startswith('maskrcnn')), flush=True)
                if args.python:
                    print(python_profile(step, args.device, args.top), flush=True)
            except Exception as err:  # noqa: BLE001 - one contender's failure does not end the report
                print(f"failed: {type(err).__name__}: {err}", flush=True)
            del step
            torch.cuda.empty_cache() if args.device == "cuda" else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
