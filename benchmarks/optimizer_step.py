"""The AdamW step of a detector: torch's three implementations, timed side by side and counted.

vtdense's tasks step with torch's fused AdamW where it applies (:func:`vtdense.tasks.optim.adamw`).
This section measures why, on the parameters of the published Swin-T Mask R-CNN and of the CPU
demo's detector, with random gradients:

- ``for-loop``: torch's default on the CPU (several ops per parameter tensor);
- ``foreach``: torch's default on GPUs (multi-tensor ops);
- ``fused``: one kernel per chunk of tensors.

For each: the median step time (interleaved, same process) and the ATen ops dispatched per step,
counted with a ``TorchDispatchMode`` (deterministic: on a GPU each is a kernel launch, the host
cost the performance notes single out). Run alone::

    python benchmarks/optimizer_step.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from common import interleaved_times, median  # noqa: E402
from contenders import build_model  # noqa: E402

IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
MODELS = {"published Mask R-CNN": "maskrcnn", "CPU demo Mask R-CNN": "maskrcnn_demo"}


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += 1
        return func(*args, **(kwargs or {}))


def run(device: str = "cpu", repeats: int = 5) -> dict[str, Any]:
    """Median step time and ATen ops per step of each implementation, for each model of :data:`MODELS`."""
    out: dict[str, Any] = dict(device=device, models={})
    for label, family in MODELS.items():
        model = build_model("vtdense", dict(family=family, size=(512, 768))).to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opts = {k: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, **kw) for k, kw in IMPLS.items()}
        steps = {k: o.step for k, o in opts.items()}
        for step in steps.values():  # first step: state allocated
            step()
        times = interleaved_times(steps, device, warmup=1, repeats=repeats)
        rows = {}
        for k, step in steps.items():
            counter = _OpCount()
            with counter:
                step()
            rows[k] = dict(median_ms=median(times[k]), ops=counter.n)
        out["models"][label] = dict(tensors=len(params), params_m=sum(p.numel() for p in params) / 1e6, rows=rows)
        del model, opts, steps
    return out


def markdown(report: dict[str, Any]) -> list[str]:
    """The report as Markdown lines (a section of RESULTS.md)."""
    lines = [f"### AdamW step ({report['device']}): torch's three implementations on the detectors' parameters", "",
             "| model | implementation | median ms | vs for-loop | ATen ops per step |", "|---|---|---|---|---|"]
    for label, m in report["models"].items():
        base = m["rows"]["for-loop"]["median_ms"]
        for k, r in m["rows"].items():
            lines.append(f"| {label} ({m['tensors']} tensors, {m['params_m']:.1f} M) | {k} | {r['median_ms']:.1f} | "
                         f"{base / r['median_ms']:.2f} | {r['ops']} |")
    lines += ["", "The tasks step fused (`fused_optimizer`, auto) unless gradient clipping under mixed precision or "
              "fp16 loss scaling rules it out."]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    report = run(args.device, args.repeats)
    print("\n".join(markdown(report)))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
