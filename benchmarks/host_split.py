"""Where a training step's host time goes, without a profiler: forward, backward, optimizer, per contender.

On the H200 the Swin-T training step and the detector's step run at the pace of the host: their kernels
take 29-44 ms of 45-96 ms steps (``benchmarks/RESULTS.md``), and ``torch.profiler`` or cProfile inflate
the host's time two- or threefold, so their tables cannot say where the gap to timm or torchvision is.
This script times each phase of a step on the host with ``time.perf_counter`` and nothing else: on a GPU
the calls only queue kernels, so while the host is the bound, each phase's time is what it costs the host
(the first phase of a step can also wait for the device to drain the previous step's queue, which the
device time per step, from CUDA events, shows). ``--sync`` waits for the device after every phase
instead, giving each phase's full time.

    python benchmarks/host_split.py --device cuda [--case swin|maskrcnn] [--steps 30] [--sync]
    python benchmarks/host_split.py --device cpu --case swin --tiny     # what the test runs

Contenders: ``vtdense``, ``vtdense unfused`` (no training recomputation) and ``timm fused`` for Swin-T
(batch 8 at 512x768, bf16 on CUDA); ``vtdense``, ``vtdense unfused`` and ``torchvision`` for the published Mask R-CNN
(batch 2 at 800x1333). ``--contenders`` names others: any of ``benchmarks/contenders.py``'s, and a
`` compiled`` suffix (the Swin-T model compiled whole; the detector's backbone as ``compile_backbone`` does,
the compile inside the warm-up steps). Medians in ms per step (on CUDA also the peak of ``max_memory_allocated`` over the timed steps,
model, gradients and optimizer state included); AdamW (vtdense's tasks' optimizer) for both cases.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from contenders import _SETTINGS, _autocast, _detection_batch, build_model, features  # noqa: E402

__all__ = ["split_step", "main"]

PHASES = ("forward", "backward", "optimizer")
CASES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "swin": (dict(family="swin_t", mode="train", batch=8, size=[512, 768], dtype="bf16"),
             ("vtdense", "vtdense unfused", "timm fused")),
    "maskrcnn": (dict(family="maskrcnn", mode="train", batch=2, size=[800, 1333], dtype="bf16"),
                 ("vtdense", "vtdense unfused", "torchvision")),
}
TINY = {"swin": dict(batch=1, size=[64, 96]), "maskrcnn": dict(family="maskrcnn_demo", batch=1, size=[128, 192])}


def _phases(contender: str, case: dict[str, Any], device: str) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]:
    """``(forward, backward, optimizer)`` of one training step of ``contender``."""
    from vtdense.tasks.optim import adamw

    torch.manual_seed(0)
    model = build_model(contender, case).to(device).train()
    if contender.endswith(" compiled") and case["family"].startswith("maskrcnn"):
        from vtdense.models.compile import compile_backbone

        compile_backbone(model, "inductor")  # as DetectionTask(compile_backbone=true): the heads stay eager
    elif contender.endswith(" compiled"):
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw([{"params": params}], lr=1e-4, weight_decay=0.05)
    if case["family"].startswith("maskrcnn"):
        images, targets = _detection_batch(case, device, 4 if case["family"] == "maskrcnn_demo" else 80)

        def forward() -> Any:
            with _autocast(case, device):
                return sum(model(images, targets).values())
    else:
        x = torch.randn(case["batch"], 3, *case["size"], generator=torch.Generator().manual_seed(1)).to(device)

        def forward() -> Any:
            with _autocast(case, device):
                return sum(f.float().mean() for f in features(model(x)))

    def optimizer() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, lambda loss: loss.backward(), optimizer


def split_step(contender: str, case: dict[str, Any], device: str, steps: int = 30, warmup: int = 5,
               sync: bool = False) -> dict[str, float]:
    """Median host ms per phase of ``steps`` training steps of ``contender`` (after ``warmup``), the
    median wall ms per step, and on CUDA the device's ms per step (events around each step)."""
    setting = next((make for suffix, make in _SETTINGS.items() if suffix in contender), None)
    forward, backward, optimizer = _phases(contender, case, device)
    cuda = device.startswith("cuda")

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {k: [] for k in (*PHASES, "step", "device")}
    peak = None
    with setting() if setting is not None else contextlib.nullcontext():
        for i in range(warmup + steps):
            if cuda and i == warmup:
                wait()
                torch.cuda.reset_peak_memory_stats()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            loss = forward()
            if sync:
                wait()
            t1 = time.perf_counter()
            backward(loss)
            if sync:
                wait()
            t2 = time.perf_counter()
            optimizer()
            if sync:
                wait()
            t3 = time.perf_counter()
            if cuda:
                end.record()
            if i >= warmup:
                for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                    times[name].append(dt * 1e3)
                times["step"].append((t3 - t0) * 1e3)
                if cuda:
                    end.synchronize()  # (after the step's host work was timed)
                    times["device"].append(start.elapsed_time(end))
    wait()
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    out = {k: statistics.median(v) for k, v in times.items() if v}
    return out if peak is None else {**out, "peak MiB": peak}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--case", default="swin", choices=sorted(CASES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--contenders", nargs="+", help="instead of the case's (e.g. 'vtdense compiled': the detector's "
                   "backbone compiled as compile_backbone does, the Swin-T model compiled whole)")
    p.add_argument("--sync", action="store_true", help="wait for the device after every phase")
    p.add_argument("--tiny", action="store_true",
                   help="a small batch and size (the test's; torchvision's detector still resizes to its own 800 pixels)")
    args = p.parse_args(argv)
    case, contenders = CASES[args.case]
    case = {**case, **(TINY[args.case] if args.tiny else {})}
    if not args.device.startswith("cuda"):
        case = {**case, "dtype": "fp32"}
    cols = [*PHASES, "step"] + (["device", "peak MiB"] if args.device.startswith("cuda") else [])
    print(f"{args.case}, {case['batch']} at {case['size'][0]}x{case['size'][1]}, {case['dtype']}, {args.device}"
          f"{', synchronised after each phase' if args.sync else ''}: median ms per step")
    print("| contender | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols), flush=True)
    results = {}
    for c in args.contenders or contenders:  # each row as it is measured (a compile can outlast a time limit)
        r = results[c] = split_step(c, case, args.device, args.steps, sync=args.sync)
        print(f"| {c} | " + " | ".join(f"{r[k]:.2f}" for k in cols) + " |", flush=True)
    return results


if __name__ == "__main__":
    main()
