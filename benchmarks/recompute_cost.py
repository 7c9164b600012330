"""What one recomputed layer costs, host and device, against the same layer without recomputation.

    python benchmarks/recompute_cost.py [--device cuda] [--iters 200]

Training's recomputation (:func:`vtdense.layers.mlp.set_activation_recompute`) saves bytes in
proportion to a layer's activation, and costs the host a roughly fixed time per layer (the
saved-tensor hooks or the Python backward, the recomputed op's launch) and the device the
recomputed op's kernel. This times ``norm -> linear`` and ``GELU -> linear``, forward and backward
under bf16 autocast on CUDA (float32 on the CPU), at Swin-T's first-stage and last-stage sizes
(batch 8 at 512x768: 196,608 rows of 96 channels, 3,072 rows of 768), in each form: ``plain`` (no
recomputation), ``hooks`` (saved-tensor hooks, the GPU default) and ``function`` (the autograd
functions). Per form: the host's microseconds per layer (``time.perf_counter`` around issuing the
forward and backward, not waiting for the device) and, on CUDA, the device's (events around a
run of iterations, divided). It also times entering and leaving ``torch.autocast`` alone, which the
hooks' remake once paid per layer. The recomputation's threshold is set to 0 here, so every call
recomputes. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from vtdense.layers import mlp

SIZES = {"stage 1 (196,608 x 96)": (196_608, 96), "stage 4 (3,072 x 768)": (3_072, 768)}
TINY = {"tiny (64 x 8)": (64, 8)}


def _layer(kind: str, rows: int, dim: int, device: str) -> tuple:
    if kind == "norm":
        norm, lin = nn.LayerNorm(dim).to(device), nn.Linear(dim, 3 * dim).to(device)
        x = torch.randn(rows, dim, device=device, requires_grad=True)
        return x, lambda: mlp.norm_linear(x, norm, lin)
    lin = nn.Linear(4 * dim, dim).to(device)
    h = torch.randn(rows, 4 * dim, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                    requires_grad=True)
    return h, lambda: mlp.gelu_linear(h, lin)


def time_layer(kind: str, form: str, rows: int, dim: int, device: str, iters: int) -> tuple[float, float | None]:
    """Median host us per forward+backward of one layer, and the device's mean us (CUDA)."""
    x, fn = _layer(kind, rows, dim, device)
    cuda = device == "cuda"
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=cuda)
    mlp._set_recompute_form("hooks" if form == "hooks" else "function" if form == "function" else "auto")
    host: list[float] = []
    try:
        with mlp.activation_recompute(form != "plain", min_bytes=0):
            for i in range(iters + 10):
                if i == 10 and cuda:
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                with amp:
                    y = fn()
                y.backward(torch.ones_like(y))
                if i >= 10:
                    host.append((time.perf_counter() - t0) * 1e6)
                x.grad = None
            device_us = None
            if cuda:
                end.record()
                end.synchronize()
                device_us = start.elapsed_time(end) * 1e3 / iters
    finally:
        mlp._set_recompute_form("auto")
    return statistics.median(host), device_us


def autocast_us(device: str, iters: int = 2000) -> float:
    """Median us to enter and leave ``torch.autocast(device, bfloat16)`` (nothing inside)."""
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            pass
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--tiny", action="store_true", help="one tiny size (the test's)")
    args = p.parse_args(argv)
    results: dict = {}
    print(f"device {args.device}; entering and leaving torch.autocast: {autocast_us(args.device):.1f} us")
    print("| layer | size | form | host us | device us |\n|---|---|---|---|---|")
    for kind in ("norm", "gelu"):
        for name, (rows, dim) in (TINY if args.tiny else SIZES).items():
            for form in ("plain", "hooks", "function"):
                h, d = time_layer(kind, form, rows, dim, args.device, args.iters)
                results[(kind, name, form)] = (h, d)
                print(f"| {kind} -> linear | {name} | {form} | {h:.0f} | {'-' if d is None else f'{d:.0f}'} |")
    return results


if __name__ == "__main__":
    main()
