"""CPU steps in steady state: each contender alone in its own process.

``run.py`` times every contender of a case in one process, one step of each in turn. On the
CPU a step's speed also depends on the state glibc's allocator is left in (which freed blocks it
kept, how much of its heap it returned to the kernel, so how many pages the next step faults in
again), and interleaving the contenders gives each of them the others' leftovers. A user runs
one model for thousands of steps, so here each contender runs alone in a fresh process:
``--warmup`` untimed steps, then ``--steps`` timed steps; the processes of all contenders take
turns ``--rounds`` times, so slow drifts of a shared machine reach every contender alike.
Reported: the median step over all rounds, the ratio to the best peer, and the page faults per
step (each one a few microseconds of kernel time on a virtual machine).

``--mode train`` times a training step (forward and backward); ``--mode infer`` an inference
forward under ``torch.inference_mode``. ``--keep-freed-memory`` has every worker call
:func:`vtdense.allocator.keep_freed_memory` first, as the recipes do; ``--keep-freed-env`` starts the
workers with glibc's environment variables instead (:data:`KEEP_FREED`).

Usage::

    python benchmarks/steady.py --mode train [--family swin_t] [--size 512x768] [--batch 2]
    python benchmarks/steady.py --mode infer --family mvitv2_t --size 224x224 --batch 8
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
    "train": {
        "swin_t": ["vtdense", "vtdense blas", "vtdense unchunked", "timm", "timm fused"],
        "swinv2_t": ["vtdense", "vtdense blas", "vtdense unchunked", "timm"],
    },
    "infer": {
        "swin_t": ["vtdense", "vtdense blas", "timm", "timm fused", "torchvision"],
        "swinv2_t": ["vtdense", "vtdense blas", "timm", "torchvision"],
        "mvitv2_t": ["vtdense", "vtdense blas", "timm"],
    },
}
#: glibc's allocator told to keep freed memory: the environment of ``--keep-freed-env``'s workers.
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
DEFAULTS = {"train": ("512x768", 2, 3, 2), "infer": ("224x224", 8, 7, 3)}  # size, batch, steps, warm-up


def _worker(contender: str, family: str, mode: str, size: tuple[int, int], batch: int, steps: int, threads: int,
            warmup: int = 2, keep_freed: bool = False) -> dict:
    if keep_freed:
        from vtdense.allocator import keep_freed_memory

        if not keep_freed_memory():
            raise SystemExit("--keep-freed-memory: this C library is not glibc")
    import torch

    from contenders import make_step
    from vtdense.layers.chunked import set_cpu_chunking

    torch.set_num_threads(threads)
    set_cpu_chunking(contender != "vtdense unchunked")
    name = "vtdense" if contender == "vtdense unchunked" else contender
    step = make_step(name, dict(family=family, mode=mode, batch=batch, size=size), "cpu")
    for _ in range(warmup):
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
    ap.add_argument("--mode", default="train", choices=sorted(CONTENDERS))
    ap.add_argument("--family", default="swin_t", choices=sorted(CONTENDERS["infer"]))
    ap.add_argument("--size", help="HxW (default: 512x768 to train, 224x224 to infer)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--contenders", nargs="+", help="a subset of the family's contenders")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="each worker calls vtdense.allocator.keep_freed_memory() first, as the recipes do")
    ap.add_argument("--keep-freed-env", action="store_true",
                    help="start the workers with glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ set")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    d_size, d_batch, d_steps, d_warmup = DEFAULTS[args.mode]
    size_s = args.size or d_size
    batch = args.batch or d_batch
    steps = args.steps or d_steps
    warmup = d_warmup if args.warmup is None else args.warmup
    try:
        size = tuple(int(v) for v in size_s.lower().split("x"))
        if len(size) != 2:
            raise ValueError
    except ValueError:
        ap.error(f"--size {size_s!r}: expected HxW, for example 512x768")
    if args.worker:
        print(json.dumps(_worker(args.worker, args.family, args.mode, size, batch, steps, args.threads, warmup,
                                 args.keep_freed_memory)))
        return 0
    known = CONTENDERS[args.mode].get(args.family)
    if known is None:
        ap.error(f"--family {args.family}: no {args.mode} contenders (choose from {sorted(CONTENDERS[args.mode])})")
    chosen = args.contenders or known
    unknown = [c for c in chosen if c not in known]
    if unknown:
        ap.error(f"--contenders {unknown}: not among {known}")
    runs: dict[str, list[dict]] = {c: [] for c in chosen}
    for _ in range(args.rounds):
        for contender in runs:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", contender, "--mode", args.mode,
                   "--family", args.family, "--size", size_s, "--batch", str(batch), "--steps", str(steps),
                   "--warmup", str(warmup), "--threads", str(args.threads)] + ["--keep-freed-memory"] * args.keep_freed_memory
            env = {**os.environ, **KEEP_FREED} if args.keep_freed_env else None
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            runs[contender].append(json.loads(out.strip().splitlines()[-1]))
    med = {c: statistics.median(t for r in rs for t in r["times"]) for c, rs in runs.items()}
    peers = [c for c in runs if not c.startswith("vtdense")]
    best = min((med[c] for c in peers), default=None)
    what = "training step" if args.mode == "train" else "inference"
    print(f"{args.family} {what}, batch {batch} at {size_s}, {args.threads} threads, "
          f"{args.rounds} rounds x {steps} steps per contender after {warmup} warm-up, each in its own process"
          + (", keep_freed_memory()" if args.keep_freed_memory else "")
          + (", glibc's environment keeping freed memory" if args.keep_freed_env else ""))
    print("| contender | median ms | per-round medians | vs best peer | page faults / step |")
    print("|---|---|---|---|---|")
    for c, rs in runs.items():
        faults = statistics.median(r["faults"] for r in rs)
        rounds = " / ".join(f"{statistics.median(r['times']) * 1e3:.0f}" for r in rs)
        ratio = f"{best / med[c]:.2f}" if best else "-"
        print(f"| {c} | {med[c] * 1e3:.0f} | {rounds} | {ratio} | {faults:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
