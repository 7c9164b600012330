"""CPU training steps in steady state: each contender alone in its own process.

``run.py`` times every contender of a case in one process, one step of each in turn. That is
fair for inference, but a training step's speed on the CPU also depends on the state glibc's
allocator is left in (which freed blocks it kept, how much of its heap it returned to the
kernel), and interleaving the contenders gives each of them the others' leftovers. A user runs
one model for thousands of steps, so here each contender runs alone in a fresh process: two
warm-up steps, then ``--steps`` timed steps; the processes of all contenders take turns
``--rounds`` times, so slow drifts of a shared machine reach every contender alike. Reported:
the median step over all rounds, and the page faults per step (each one a few microseconds of
kernel time on a virtual machine).

Usage::

    python benchmarks/train_steady.py [--family swin_t] [--size 512x768] [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONTENDERS = {
    "swin_t": ["vtdense", "vtdense unchunked", "timm", "timm fused"],
    "swinv2_t": ["vtdense", "vtdense unchunked", "timm"],
}


def _worker(contender: str, family: str, size: tuple[int, int], batch: int, steps: int, threads: int) -> dict:
    import torch

    from contenders import make_step
    from vtdense.layers.chunked import set_cpu_chunking

    torch.set_num_threads(threads)
    set_cpu_chunking(contender != "vtdense unchunked")
    name = "vtdense" if contender == "vtdense unchunked" else contender
    step = make_step(name, dict(family=family, mode="train", batch=batch, size=size), "cpu")
    step()
    step()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    return {"times": times, "faults": faults}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="swin_t", choices=sorted(CONTENDERS))
    ap.add_argument("--size", default="512x768")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = tuple(int(v) for v in args.size.split("x"))
    if args.worker:
        print(json.dumps(_worker(args.worker, args.family, size, args.batch, args.steps, args.threads)))
        return 0
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS[args.family]}
    for _ in range(args.rounds):
        for contender in runs:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", contender, "--family", args.family,
                   "--size", args.size, "--batch", str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[contender].append(json.loads(out.strip().splitlines()[-1]))
    med = {c: statistics.median(t for r in rs for t in r["times"]) for c, rs in runs.items()}
    peers = [c for c in runs if not c.startswith("vtdense")]
    best = min(med[c] for c in peers)
    print(f"{args.family} training step, batch {args.batch} at {args.size}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.steps} steps per contender, each in its own process")
    print("| contender | median ms | vs best peer | page faults / step |")
    print("|---|---|---|---|")
    for c, rs in runs.items():
        faults = statistics.median(r["faults"] for r in rs)
        print(f"| {c} | {med[c] * 1e3:.0f} | {best / med[c]:.2f} | {faults:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
