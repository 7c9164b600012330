"""A compiled training step at changing sizes: ``compile_backbone`` against eager, per family.

For each backbone, one training step (forward, a probe loss, backward) at each size in turn, first
compiled and then eager on a copy with the same weights. Printed per size: the seconds of the
compiled step (the first size compiles; a later one that takes about as long compiled again),
Dynamo's graph count after it, the largest difference of the compiled step's outputs and
parameter gradients to eager's, and where it compiled, the seconds of each compile phase. Where a
compile fails, the error's first line.

On ``--device cuda`` both run under bf16 autocast (so the differences are bf16's).
The tests' 16-channel models are the default: on the CPU, Inductor's C++ code generation of
a full-size training step takes much longer. ``compile_backbone`` compiles one graph for sizes
in whole 32-pixel cells and one for the others (``--size-divisible 1``: one graph for all), so the
default sizes, two of each kind, make two graphs.

Usage::

    python benchmarks/compile_train_sizes.py --families "mvitv2 windows" --backend inductor
    python benchmarks/compile_train_sizes.py --families swin --backend aot_eager --sizes 160x192 192x256
    python benchmarks/compile_train_sizes.py --device cuda --full --sizes 512x768 640x800 480x736 --batch 2 1
    TRITON_INTERPRET=1 python benchmarks/compile_train_sizes.py --gpu-path --families swin --sizes 64x96
    python benchmarks/compile_train_sizes.py --full --families swin-s --sizes 512x768 --steps 5 [--flat]

``--flat`` compiles the blocks inline rather than as nested compile regions (a stage's matching
blocks compiled once; ``vtdense.backbones.base.set_compile_regions``). Since 2026-11-28 training graphs
inline every block anyway (torch 2.14.1 trained reused regions wrongly; ``benchmarks/RESULTS.md``,
"Compile: reused regions trained wrongly"), so it changes nothing here; it is kept for a torch that
fixes them.

``--gpu-path`` compiles, on the CPU, the graph a GPU would (attention inputs in the GPU's layout; with
``TRITON_INTERPRET=1`` the Triton window attention's graph ops, run in Triton's interpreter): Inductor's
lowering, where the shapes' symbolic strides are sorted, is the same for both devices.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from typing import Any

import torch

from common import compile_phases, compile_script_options, error_line, hw_size, parsed_with_device, sync

TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "swin": ("swin_tiny", dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)),
    "swinv2": ("swinv2_tiny", dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)),
    "swin-s": ("swin_small", dict(embed_dim=16, depths=(1, 1, 6, 1), num_heads=(1, 2, 2, 4), window_size=4)),
    "mvitv2 global": ("mvitv2_tiny", dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1)),
    "mvitv2 windows": ("mvitv2_tiny", dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8)),
}
FULL: dict[str, tuple[str, dict[str, Any]]] = {
    "swin": ("swin_tiny", {}),
    "swinv2": ("swinv2_tiny", {"window_size": 8}),
    "swin-s": ("swin_small", {}),
    "mvitv2 global": ("mvitv2_tiny", {}),
    "mvitv2 windows": ("mvitv2_tiny", {"window_size": 56}),
}
DEFAULT_SIZES = ("192x256", "224x288", "200x232", "232x264")


def _step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Outputs and parameter gradients of one step with a probe loss (gradients cleared after);
    under bf16 autocast on CUDA."""
    cuda = x.device.type == "cuda"
    with torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext():
        out = list(model(x).values())
    sum(o.float().square().mean() for o in out).backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [o.detach() for o in out] + grads


def measure(family: str, sizes: list[tuple[int, int]], batch: int | list[int], backend: str, tiny: bool,
            device: str = "cpu", size_divisible: int | None = None, steps: int = 0) -> list[dict[str, Any]]:
    """Rows of one family: size, compiled-step seconds, graphs so far, max abs diff to eager, and
    where the step compiled, its seconds per compile phase (``common.compile_phases``). Every size
    runs at the first ``batch``; further batch sizes run at the last size after them
    (``compile_backbone`` makes one graph for every batch). With ``steps``, a last row: the median
    seconds of ``steps`` more compiled and eager steps at the last size, alternating."""
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics, counters

    import vtdense
    from vtdense.models.compile import compile_backbone

    name, overrides = (TINY if tiny else FULL)[family]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = vtdense.create_backbone(name, drop_path_rate=0.0, **overrides).to(device).train()
    compiled = compile_backbone(copy.deepcopy(eager), backend, size_divisible=size_divisible)
    batches = [batch] if isinstance(batch, int) else list(batch)
    rows = []
    for n, size in [(batches[0], s) for s in sizes] + [(b, sizes[-1]) for b in batches[1:]]:
        x = torch.randn(n, 3, *size, device=device)
        compilation_time_metrics.clear()
        start = time.perf_counter()
        try:
            got = _step(compiled, x)
            sync(device)
        except Exception as err:  # noqa: BLE001 - a failed compile is a result
            rows.append({"size": size, "batch": n, "error": error_line(err)})
            print(f"{family} {size[0]}x{size[1]} (batch {n}): {rows[-1]['error']}", flush=True)
            break
        seconds = time.perf_counter() - start
        want = _step(eager, x)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        phases = compile_phases(seconds)
        rows.append({"size": size, "batch": n, "seconds": round(seconds, 1),
                     "graphs": counters["stats"]["unique_graphs"], "max abs diff": diff,
                     **({"phases": phases} if phases else {})})
        print(f"{family} {size[0]}x{size[1]} (batch {n}): {seconds:.1f} s, graphs {rows[-1]['graphs']}, max abs diff {diff:.1e}"
              + (f"; compile phases, s: {phases}" if phases else ""), flush=True)
    if steps and rows and "error" not in rows[-1]:
        times: dict[str, list[float]] = {"compiled": [], "eager": []}
        for _ in range(steps):
            for label, model in (("compiled", compiled), ("eager", eager)):
                start = time.perf_counter()
                _step(model, x)
                sync(device)
                times[label].append(time.perf_counter() - start)
        medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
        rows.append({"size": sizes[-1], "steady s": medians})
        print(f"{family} {sizes[-1][0]}x{sizes[-1][1]}, {steps} more steps, median s: {medians}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parse_size = hw_size("--sizes")
    compile_script_options(p, list(TINY), [f for f in TINY if f != "swin-s"])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in DEFAULT_SIZES])
    p.add_argument("--batch", type=int, nargs="+", default=[2],
                   help="the batch size of every size; more values: those batch sizes at the last size after them")
    p.add_argument("--full", action="store_true", help="the published tiny configs instead of the tests' 16-channel ones")
    p.add_argument("--size-divisible", type=int, default=None,
                   help="compile_backbone's size_divisible (default: the backbone's deepest stride; 1: one graph for all sizes)")
    p.add_argument("--flat", action="store_true",
                   help="compile the blocks inline (set_compile_regions(False)); training graphs inline them anyway since 2026-11-28")
    p.add_argument("--steps", type=int, default=0,
                   help="then time this many more compiled and eager steps at the last size (medians)")
    p.add_argument("--gpu-path", action="store_true",
                   help="on the CPU, trace what a GPU compiles: attention inputs laid out as on a GPU, and with "
                        "TRITON_INTERPRET=1 Swin's Triton window attention (its graph ops) run in Triton's interpreter "
                        "in float32")
    args = parsed_with_device(p, argv)
    if args.gpu_path:
        if args.device != "cpu":
            p.error("--gpu-path: for --device cpu (a GPU takes its own path)")
        import vtdense.layers.attention as attention_mod
        from vtdense.layers import triton_window_attention as twa

        attention_mod._GPU_LAYOUT_ON_CPU = True
        if os.environ.get("TRITON_INTERPRET") == "1":
            twa.set_triton_window_attention(True)
    if args.flat:
        from vtdense.backbones.base import set_compile_regions

        set_compile_regions(False)
    if args.steps < 0:
        p.error(f"--steps {args.steps}: must be at least 0")
    for b in args.batch:
        if b < 1:
            p.error(f"--batch {b}: must be at least 1")
    if args.size_divisible is not None and args.size_divisible < 1:
        p.error(f"--size-divisible {args.size_divisible}: must be at least 1")
    return {f: measure(f, args.sizes, args.batch, args.backend, not args.full, args.device, args.size_divisible,
                       args.steps)
            for f in args.families}


if __name__ == "__main__":
    main()
