"""Seconds to a backbone's first compiled call: ``torch.compile(dynamic=True)`` beside ``compile_backbone``.

With ``dynamic=True`` Dynamo makes each Python float the model reads a graph input (every
LayerNorm's ``eps``). ``layer_norm`` takes ``eps`` as a number, so lowering the graph specialises
it, and torch then restarts the whole trace with those floats constant: the backbone is traced
twice before its first call returns. :func:`vtdense.models.compile.compile_backbone` traces with
the floats constant from the start, and it traces an image whose sides are multiples of 32 (the
default 256x384) in 32-pixel cells, so that its sizes are the cell counts; ``compile_backbone any-size``
(``size_divisible=1``) is the one graph for every size that it compiled before. This script times
these on the same backbone, each in a fresh process with an empty Inductor cache (so none reuses
another's kernels), and reports Dynamo's
trace attempts (2 = one restart) and the largest difference of the outputs (and, in training, of
the input's gradient) to eager.

    python benchmarks/compile_first.py                       # CPU, aot_eager and inductor, inference and training
    python benchmarks/compile_first.py --families swin_t --backends aot_eager --modes train
    python benchmarks/compile_first.py --device cuda --families swin_t --backends inductor --modes train
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    compile_phases, compile_script_options, environment, error_line, hw_size, parsed_with_device, tiny_backbone_options,
    trace_attempts, write_report,
)

__all__ = ["first_call", "measure", "markdown", "main"]

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "swin_t": ("swin_tiny", {}),
    "swinv2_t": ("swinv2_tiny", {"window_size": 8}),
    "mvitv2_t windows": ("mvitv2_tiny", {"window_size": 56}),
}
# "compile_backbone any-size": compile_backbone(size_divisible=1), one graph for every size (what it
# compiled before sizes in whole 32-pixel cells got their own graph: RESULTS.md, "Compile: sizes in whole cells")
HOWS = ("torch.compile", "compile_backbone any-size", "compile_backbone")


def first_call(family: str, how: str, backend: str, mode: str, size: tuple[int, int], tiny: bool = False,
               device: str = "cpu") -> dict[str, Any]:
    """In this process: build ``family``, compile it ``how``, and time its first call at ``size``
    (forward, and in ``mode="train"`` the backward of the maps' sum; on CUDA under bf16 autocast).
    Returns the seconds, Dynamo's trace attempts, the largest difference to eager and the seconds
    per compile phase (``common.compile_phases``)."""
    import torch._dynamo.utils as dynamo_utils

    import vtdense
    from vtdense.models.compile import compile_backbone

    name, overrides = FAMILIES[family]
    kwargs = dict(overrides, drop_path_rate=0.0, out_norm=False, **(tiny_backbone_options(name) if tiny else {}))
    torch.manual_seed(0)
    model = vtdense.create_backbone(name, **kwargs).train(mode == "train").to(device)
    eager = vtdense.create_backbone(name, **kwargs).train(mode == "train").to(device)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(1)).to(device)

    def run(m: torch.nn.Module) -> list[torch.Tensor]:
        xi = x.clone().requires_grad_(mode == "train")
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
        with torch.set_grad_enabled(mode == "train"), amp:
            maps = [f.float() for f in m(xi).values()]
            if mode == "train":
                sum(f.sum() for f in maps).backward()
                return [f.detach() for f in maps] + [xi.grad]
        return maps

    dynamo_utils.compilation_time_metrics.clear()
    start = time.perf_counter()
    if how == "torch.compile":
        compiled = torch.compile(model, dynamic=True, backend=backend)
    else:
        compiled = compile_backbone(model, backend, size_divisible=1 if how.endswith("any-size") else None)
    got = run(compiled)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    attempts, phases = trace_attempts(), compile_phases(seconds)
    want = run(eager)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    return {"seconds": round(seconds, 1), "attempts": attempts, "max abs diff": diff, "phases": phases}


def measure(family: str, how: str, backend: str, mode: str, size: tuple[int, int], tiny: bool = False,
            device: str = "cpu") -> dict[str, Any]:
    """:func:`first_call` in a fresh Python process with an empty Inductor cache directory."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); from compile_first import first_call; "
                f"print('RESULT', json.dumps(first_call({family!r}, {how!r}, {backend!r}, {mode!r}, {tuple(size)!r}, {tiny!r}, {device!r})))")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": tail[:200]}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    size = "x".join(map(str, report["size"]))
    lines = [f"### First compiled call: `python benchmarks/compile_first.py` (batch 1 at {size})", "",
             f"Measured {env.get('date')} on {env.get('gpu', env.get('cpu', report['device']))}, {env.get('threads', '')} CPU threads; torch "
             f"{env.get('torch')}, vtdense {env.get('vtdense')}. Each cell ran in a fresh process with an empty Inductor cache.", "",
             "| backbone | backend | mode | `torch.compile(dynamic=True)` s (attempts) | `compile_backbone(size_divisible=1)` s "
             "(attempts) | `compile_backbone` s (attempts) | first / last | max abs diff to eager |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        cells = [row.get(how, {"error": "not run"}) for how in HOWS]
        timed = [c for c in cells if "error" not in c]
        text = [c.get("error") or f"{c['seconds']} ({c['attempts']})" for c in cells]
        ratio = f"{timed[0]['seconds'] / timed[-1]['seconds']:.2f}x" if len(timed) > 1 else ""
        diffs = " / ".join(f"{c['max abs diff']:.1e}" for c in timed)
        lines.append(f"| {row['family']} | {row['backend']} | {row['mode']} | {' | '.join(text)} | {ratio} | {diffs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    compile_script_options(p, list(FAMILIES), ["swin_t", "mvitv2_t windows"])
    p.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    p.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    p.add_argument("--hows", nargs="+", default=list(HOWS), choices=HOWS, help="ways of compiling to time (default: all)")
    p.add_argument("--size", type=hw_size("--size"), default=(256, 384), help="HxW of the one image (default 256x384)")
    p.add_argument("--tiny", action="store_true", help="a 16-channel, one-block-per-stage backbone (what the test runs)")
    p.add_argument("--json", default="", help="also write the report here")
    args = parsed_with_device(p, argv)
    size = args.size
    report: dict[str, Any] = {"device": args.device, "size": list(size), "environment": environment(args.device), "rows": []}
    report["environment"]["threads"] = torch.get_num_threads()
    for family in args.families:
        for backend in args.backends:
            for mode in args.modes:
                row: dict[str, Any] = {"family": family, "backend": backend, "mode": mode}
                for how in args.hows:
                    try:
                        row[how] = measure(family, how, backend, mode, size, args.tiny, args.device)
                    except Exception as err:  # one cell's failure is reported; the others still run
                        row[how] = {"error": error_line(err, 200)}
                print(json.dumps(row), flush=True)
                report["rows"].append(row)
    return write_report(report, args.json, markdown(report))


if __name__ == "__main__":
    main()
