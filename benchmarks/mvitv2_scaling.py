"""How MViTv2-T's cost grows with the image: hybrid windows vs global attention.

Measures, at detection sizes, the forward FLOPs (``FlopCounterMode`` on the meta device, exact and
deterministic; multiply-adds are half of them), the forward time (median of ``--repeats`` runs
under ``torch.inference_mode``) and the peak memory of one forward (growth of the peak resident set
of a fresh worker process, CPU; ``torch.cuda.max_memory_allocated`` on ``--device cuda``) for:

- ``vtdense hybrid``: ``mvitv2_tiny`` with ``window_size=56`` (the detection layout);
- ``vtdense global``: ``mvitv2_tiny`` with global attention everywhere;
- ``timm global``: timm's ``mvitv2_tiny`` in the same run. timm's position tables do not resize,
  so it is built with a square ``img_size`` covering the input (its tables then index in range);
  only its cost is meaningful at these sizes, not its outputs.

Hybrid cost should grow about linearly with the pixel count (x2 per doubling: only the three
global blocks at strides 8/16/32 are quadratic) and global cost quadratically (stage-1 attention
alone is ``HW/16 x HW/256`` logits per head).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/mvitv2_scaling.py            # default sizes
    python benchmarks/mvitv2_scaling.py --sizes 512x768 1024x1536 --repeats 3 --max-global-mpix 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from common import hw_size

MODELS = ("vtdense hybrid", "vtdense global", "timm global")
DEFAULT_SIZES = ("512x768", "500x740", "724x1086", "1024x1536")


def build(model: str, size: tuple[int, int]) -> tuple[torch.nn.Module, Callable[[torch.Tensor], object]]:
    """The model and a function running it on an image batch."""
    if model.startswith("vtdense"):
        import vtdense

        m = vtdense.create_backbone("mvitv2_tiny", window_size=56 if "hybrid" in model else 0).eval()
        return m, m
    import timm

    side = 32 * math.ceil(max(size) / 32)
    m = timm.create_model("mvitv2_tiny", pretrained=False, img_size=side, num_classes=0).eval()
    return m, lambda x: m.forward_intermediates(x, intermediates_only=True)


def count_flops(model: str, size: tuple[int, int]) -> int:
    with torch.device("meta"):
        _, run = build(model, size)
        with FlopCounterMode(display=False) as counter, torch.inference_mode():
            run(torch.empty(1, 3, *size))
    return counter.get_total_flops()


def worker(model: str, size: tuple[int, int], repeats: int, device: str) -> dict[str, float]:
    """Time and peak memory of one model at one size, in this (fresh) process."""
    torch.manual_seed(0)
    m, run = build(model, size)
    m.to(device)
    x = torch.randn(1, 3, *size, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    with torch.inference_mode():
        for _ in range(repeats + (device == "cuda")):  # one warm-up on GPU
            sync()
            t0 = time.perf_counter()
            run(x)
            sync()
            times.append(time.perf_counter() - t0)
    if device == "cuda":
        times = times[1:]
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times.sort()
    return {"ms": 1e3 * times[len(times) // 2], "peak_mb": peak / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parse_size = hw_size("--sizes")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in DEFAULT_SIZES], help="HxW sizes")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--max-global-mpix", type=float, default=0.8,
        help="time/memory of the global models only up to this many megapixels (FLOPs always)",
    )
    p.add_argument("--worker", nargs=4, metavar=("MODEL", "H", "W", "REPEATS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        model, h, w, repeats = args.worker
        print(json.dumps(worker(model, (int(h), int(w)), int(repeats), args.device)))
        return

    sizes = args.sizes
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, repeats {args.repeats}")
    header = f"{'size':>10} {'pix x':>6} | " + " | ".join(f"{m:^34}" for m in MODELS)
    sub = f"{'':>10} {'':>6} | " + " | ".join(f"{'GFLOPs':>8} {'x':>5} {'ms':>8} {'x':>5} {'MB':>5}" for _ in MODELS)
    print(header)
    print(sub)
    first: dict[str, tuple[float, float]] = {}
    base_pix = None
    for size in sizes:
        pix = size[0] * size[1]
        base_pix = base_pix or pix
        cells = []
        for model in MODELS:
            gflops = count_flops(model, size) / 1e9
            ms = peak = float("nan")
            if "hybrid" in model or pix / 1e6 <= args.max_global_mpix:
                cmd = [sys.executable, __file__, "--device", args.device, "--worker", model, str(size[0]), str(size[1]), str(args.repeats)]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout.strip().splitlines()[-1])
                ms, peak = res["ms"], res["peak_mb"]
            f0, t0 = first.setdefault(model, (gflops, ms))
            fx = gflops / f0
            tx = ms / t0 if not math.isnan(ms) and not math.isnan(t0) else float("nan")
            cells.append(f"{gflops:8.1f} {fx:5.2f} {ms:8.0f} {tx:5.2f} {peak:5.0f}")
        print(f"{size[0]:>4}x{size[1]:<5} {pix / base_pix:6.2f} | " + " | ".join(cells), flush=True)
    print("x: relative to the first size; nan: not run (--max-global-mpix)")


if __name__ == "__main__":
    main()
