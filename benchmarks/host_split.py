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
the compile inside the warm-up steps). The contenders are timed in rounds of one step each (:func:`split_steps`). Medians in ms per step (on
CUDA also each contender's peak MiB above what was allocated before it was built, its model, gradients and
optimizer state included); AdamW (vtdense's tasks' optimizer) for both cases.
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

from contenders import _SETTINGS, _autocast, _detection_batch, build_model, compiled_if_asked, features  # noqa: E402

__all__ = ["split_steps", "main"]

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
    model = compiled_if_asked(contender, case, build_model(contender, case).to(device).train())
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


def _timed_step(phases: tuple, cuda: bool, sync: bool) -> dict[str, float]:
    """One training step: host ms per phase and per step, and on CUDA the device's ms (events)."""
    forward, backward, optimizer = phases

    def wait() -> None:
        if cuda:
            torch.cuda.synchronize()

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
    out = {name: dt * 1e3 for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2))}
    out["step"] = (t3 - t0) * 1e3
    if cuda:
        end.record()
        end.synchronize()  # (after the step's host work was timed)
        out["device"] = start.elapsed_time(end)
    return out


def split_steps(contenders: list[str], case: dict[str, Any], device: str, steps: int = 30, warmup: int = 5,
                sync: bool = False, report: Callable[[str, dict[str, float]], None] | None = None
                ) -> dict[str, dict[str, float]]:
    """Median host ms per phase of ``steps`` training steps of each contender, the median host ms
    per step, and on CUDA the device's ms per step and the peak MiB. The contenders are built one
    after the other, each warmed up by ``warmup`` steps (a compile happens there), then timed in
    rounds of one step each, so that a drift of the machine's pace over the run (seen on the H100:
    the same contender 39 then 45 ms a step, minutes apart) falls on all of them alike. Peak MiB:
    ``max_memory_allocated`` over the warm-up above what was allocated before the contender was
    built (its weights, gradients, optimizer state and activations). ``report(name, row)`` is
    called for each contender as its row is ready. A contender that fails to build or warm up is
    named with its error and left out."""
    cuda = device.startswith("cuda")
    built: dict[str, tuple[tuple, Callable[[], contextlib.AbstractContextManager]]] = {}
    peaks: dict[str, float] = {}
    for c in contenders:
        setting = next((make for suffix, make in _SETTINGS.items() if suffix in c), None) or contextlib.nullcontext
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        try:
            phases = _phases(c, case, device)
            with setting():
                for _ in range(warmup):
                    _timed_step(phases, cuda, sync)
        except Exception as err:  # noqa: BLE001 (one contender's failure must not lose the others' rows)
            print(f"{c}: failed, {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}", flush=True)
            continue
        if cuda:
            peaks[c] = (torch.cuda.max_memory_allocated() - base) / 2**20
        built[c] = phases, setting
    times: dict[str, list[dict[str, float]]] = {c: [] for c in built}
    for _ in range(steps):
        for c, (phases, setting) in built.items():
            with setting():
                times[c].append(_timed_step(phases, cuda, sync))
    results = {}
    for c, rows in times.items():
        r = results[c] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        if cuda:
            r["peak MiB"] = peaks[c]
        if report is not None:
            report(c, r)
    return results


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--case", default="swin", choices=sorted(CASES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each contender first (a compile happens there)")
    p.add_argument("--contenders", nargs="+", help="instead of the case's (e.g. 'vtdense compiled': the detector's "
                   "backbone compiled as compile_backbone does, the Swin-T model compiled whole); '_' stands for a space")
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
    chosen = [c.replace("_", " ") for c in args.contenders] if args.contenders else list(contenders)
    return split_steps(chosen, case, args.device, args.steps, warmup=args.warmup, sync=args.sync,
                       report=lambda c, r: print(f"| {c} | " + " | ".join(f"{r[k]:.2f}" for k in cols) + " |", flush=True))


if __name__ == "__main__":
    main()
