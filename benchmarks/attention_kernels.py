"""Which attention kernel every attention call of a backbone runs: the profiler's word, per pass.

A backbone's forward (inference) and its forward plus backward (training step) run under
``torch.profiler``; every ATen op whose name says it is an attention kernel is counted:

- fused: ``_scaled_dot_product_efficient_attention``, ``_scaled_dot_product_flash_attention``,
  ``_scaled_dot_product_cudnn_attention``, ``_flash_attention_forward``,
  ``_scaled_dot_product_flash_attention_for_cpu``, FlexAttention's kernels, and their backwards;
  and vtdense's Triton window attention of Swin's training on a GPU (the profiler labels
  ``vtdense::triton_window_attention`` and its ``_backward``);
- math fallback: ``_scaled_dot_product_attention_math`` (SDPA's unfused path);
- CPU batched matmuls: ``vtdense::window_attention_bmm``, the profiler label of vtdense's fp32 CPU
  inference path for window attention (``baddbmm`` + softmax + ``bmm`` per image, faster than
  SDPA's CPU flash kernel at window sizes; see ``vtdense.layers.attention``).

The report lists the counts per pass and the number of calls that fell back to the math path (0
is the target in bf16 on a GPU). vtdense's own explicit math backend (``set_attention_backend
("math")``) is not SDPA and is not used here. Run alone::

    python benchmarks/attention_kernels.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from vtdense.layers.attention import BMM_LABEL  # noqa: E402
from vtdense.layers.triton_window_attention import LABEL as TRITON_LABEL  # noqa: E402

FUSED = ("efficient_attention", "flash_attention", "cudnn_attention", "flex_attention", "fused_attention")
MATH = ("_scaled_dot_product_attention_math",)

#: backbone -> (vtdense name, input size, batch) of the inference rows of the performance issue
CASES = {"swin_tiny": ((224, 224), 64), "swinv2_tiny": ((256, 256), 64), "mvitv2_tiny": ((224, 224), 64)}


def classify(name: str) -> str | None:
    """``"math"``, ``"fused"``, ``"cpu-bmm"`` or ``None`` (not an attention kernel) for an op name."""
    if name == BMM_LABEL:
        return "cpu-bmm"
    if name in (TRITON_LABEL, TRITON_LABEL + "_backward"):
        return "fused"
    if any(m in name for m in MATH):
        return "math"
    if name.startswith("aten::") and any(f in name for f in FUSED):
        return "fused"
    return None


def kernel_counts(fn: Any, device: str) -> dict[str, int]:
    """``{op name: calls}`` of the attention ops ``fn()`` runs (outermost ATen ops only)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    for ev in prof.events():
        if ev.device_type.name != "CPU" or classify(ev.name) is None:
            continue
        # SDPA's dispatcher op calls its chosen kernel op: count the kernel, not the dispatcher.
        if ev.name == "aten::scaled_dot_product_attention":
            continue
        # On a GPU the SDPA kernel ops call further attention ops through the dispatcher
        # (_scaled_dot_product_efficient_attention -> _efficient_attention_forward, the flash and
        # backward ops alike): count only the outermost attention op of each call.
        if _inside_attention_op(ev):
            continue
        counts[ev.name] += 1
    return dict(counts)


def _inside_attention_op(ev: Any) -> bool:
    parent = ev.cpu_parent
    while parent is not None:
        if classify(parent.name) is not None:
            return True
        parent = parent.cpu_parent
    return False


def run(device: str = "cpu", dtype: str = "bf16", batch: int | None = None) -> dict[str, Any]:
    """Kernel counts for inference and a training step of each backbone of :data:`CASES`."""
    import vtdense

    out: dict[str, Any] = dict(device=device, dtype=dtype, models={})
    cast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    for name, (size, default_batch) in CASES.items():
        b = batch or (default_batch if device == "cuda" else 2)
        torch.manual_seed(0)
        model = vtdense.create_backbone(name, drop_path_rate=0.0).to(device)
        x = torch.randn(b, 3, *size, device=device)

        def infer() -> None:
            model.eval()
            with torch.inference_mode(), cast:
                model(x)

        def train() -> None:
            model.train()
            with cast:
                feats = model(x)
            sum(f.float().mean() for f in feats.values()).backward()

        infer()  # first call: caches built outside the profile
        rows = {}
        for mode, fn in (("inference", infer), ("training step", train)):
            counts = kernel_counts(fn, device)
            rows[mode] = dict(counts=counts, math=sum(n for k, n in counts.items() if classify(k) == "math"),
                              fused=sum(n for k, n in counts.items() if classify(k) == "fused"))
        out["models"][name] = dict(batch=b, size=list(size), **rows)
        del model
    return out


def markdown(report: dict[str, Any]) -> list[str]:
    """The report as Markdown lines (a section of RESULTS.md)."""
    lines = [f"### Attention kernels under the profiler ({report['device']}, {report['dtype']})", "",
             "| backbone | pass | fused calls | math fallback calls | kernels |", "|---|---|---|---|---|"]
    for name, m in report["models"].items():
        for mode in ("inference", "training step"):
            r = m[mode]
            kernels = ", ".join(f"`{k.removeprefix('aten::')}` x{n}" for k, n in sorted(r["counts"].items()))
            lines.append(f"| {name} (batch {m['batch']} at {m['size'][0]}x{m['size'][1]}) | {mode} | {r['fused']} | "
                         f"{r['math']} | {kernels} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=None)
    args = ap.parse_args(argv)
    report = run(args.device, args.dtype, args.batch)
    print("\n".join(markdown(report)))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
