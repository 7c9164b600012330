"""``torch.compile(backbone, dynamic=True)`` at changing detection sizes, against eager, per family.

For each backbone, one image at each size in turn (as a detector meets multi-scale batches):

- the seconds of the first call at each size (the first size compiles; a later one that takes
  seconds recompiled), and Dynamo's graph and frame counts after the first two sizes and at the end;
- then the steady state: eager and compiled, interleaved, ``--repeats`` rounds at every size,
  medians in ms and ``eager / compiled`` (above 1: compiling pays);
- the max abs difference of the compiled maps to eager.

Backbones: Swin-T, SwinV2-T (window 8), MViTv2-T with hybrid windows (56, the detection layout)
and MViTv2-T with global attention. Inductor by default; ``--backend`` picks another. On
``--device cuda`` both run under bf16 autocast.

Usage::

    python benchmarks/compile_sizes.py                                  # CPU, every family
    python benchmarks/compile_sizes.py --families swin_t --sizes 512x768 640x800 480x736 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any, Callable

import torch

from common import (
    compile_script_options, compiled_first_calls, environment, error_line, hw_size, interleaved_times, median,
    parsed_with_device, tiny_backbone_options, write_report,
)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "swin_t": ("swin_tiny", {}),
    "swinv2_t": ("swinv2_tiny", {"window_size": 8}),
    "mvitv2_t windows": ("mvitv2_tiny", {"window_size": 56}),
    "mvitv2_t global": ("mvitv2_tiny", {}),
}
DEFAULT_SIZES = ("512x768", "640x800", "480x736", "576x864")


def _autocast(device: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()


def measure(family: str, sizes: list[tuple[int, int]], device: str, repeats: int, backend: str,
            warmup: int = 1, tiny: bool = False) -> dict[str, Any]:
    """One family's row: first-call seconds per size, Dynamo's counts, steady-state medians per size."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import vtdense

    name, overrides = FAMILIES[family]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    options = dict(overrides, **(tiny_backbone_options(name) if tiny else {}))
    model = vtdense.create_backbone(name, drop_path_rate=0.0, **options).to(device).eval()
    compiled = torch.compile(model, dynamic=True, backend=backend)
    xs = [torch.randn(1, 3, *size, device=device) for size in sizes]
    with torch.inference_mode(), _autocast(device):
        first = compiled_first_calls(compiled, model, xs, device, mark=2)
        steady: dict[str, dict[str, float]] = {}
        for size, x in zip(sizes, xs):
            fns: dict[str, Callable[[], object]] = {"eager": lambda x=x: model(x), "compiled": lambda x=x: compiled(x)}
            times = interleaved_times(fns, device, warmup, repeats)
            steady["x".join(map(str, size))] = {k: round(median(v), 1) for k, v in times.items()}
    return {"first call s": first["seconds"], "graphs/frames after two sizes": list(first["before mark"]),
            "graphs/frames at the end": list(first["end"]), "recompiled": first["recompiled"],
            "steady ms": steady, "max abs diff": first["diff"]}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"### `torch.compile(dynamic=True)` at changing sizes: `python benchmarks/compile_sizes.py --device {report['device']}`",
             "", f"Measured {env.get('date')} on {env.get('gpu', env.get('cpu', report['device']))}; torch "
             f"{env.get('torch')}, vtdense {env.get('vtdense')}; backend {report['backend']}, batch 1, "
             f"{report['repeats']} interleaved repeats{', bf16 autocast' if report['device'].startswith('cuda') else ''}.", "",
             "| backbone | size | first call s | eager ms | compiled ms | eager / compiled |", "|---|---|---|---|---|---|"]
    for family, row in report["families"].items():
        if "error" in row:
            lines.append(f"| {family} | | {row['error']} | | | |")
            continue
        for (size, ms), first in zip(row["steady ms"].items(), row["first call s"]):
            lines.append(f"| {family} | {size} | {first} | {ms['eager']} | {ms['compiled']} | {ms['eager'] / ms['compiled']:.2f} |")
    lines.append("")
    for family, row in report["families"].items():
        if "error" not in row:
            lines.append(f"- {family}: graphs/frames {row['graphs/frames after two sizes']} after two sizes, "
                         f"{row['graphs/frames at the end']} at the end (recompiled: {row['recompiled']}); "
                         f"max abs diff to eager {row['max abs diff']:.1e}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    compile_script_options(p, list(FAMILIES), list(FAMILIES))
    parse_size = hw_size("--sizes")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in DEFAULT_SIZES])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    p.add_argument("--tiny", action="store_true", help="a 16-channel, one-block-per-stage backbone (what the test runs)")
    p.add_argument("--json", default="", help="also write the report here")
    args = parsed_with_device(p, argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"device": args.device, "backend": args.backend, "repeats": args.repeats,
                              "environment": environment(args.device), "families": {}}
    for family in args.families:
        try:
            report["families"][family] = measure(family, args.sizes, args.device, args.repeats, args.backend, tiny=args.tiny)
        except Exception as err:  # one family's failure is reported; the others still run
            report["families"][family] = {"error": error_line(err, 200)}
        print(family, json.dumps(report["families"][family]), flush=True)
    return write_report(report, args.json, markdown(report))


if __name__ == "__main__":
    main()
