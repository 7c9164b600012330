"""Shared helpers of the vtdense benchmarks: timing, FLOP counting, matmul peak, peak memory.

Every benchmark script imports from here (one home for the helpers):

- :func:`interleaved_times` times several contenders in the same process, one call of each in
  turn per repeat, so slow drifts of a shared machine hit every contender alike;
- :func:`count_flops` counts the FLOPs of one call with ``torch.utils.flop_counter``;
- :func:`matmul_peak` measures the device's dense matmul throughput in the same run, the yardstick
  for achieved FLOP/s;
- :func:`isolated_peak_rss` runs one call in a fresh worker forked from a clean fork server and
  returns its peak resident-set growth (CPU); :func:`cuda_peak` does the same on a GPU with
  ``max_memory_allocated``;
- :func:`randomize_` gives models random weights that keep every branch alive (timm zero-inits
  some norms).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import subprocess
import time
from typing import Callable

import torch

__all__ = [
    "randomize_",
    "sync",
    "interleaved_times",
    "count_flops",
    "matmul_peak",
    "rss_mib",
    "isolated_peak_rss",
    "cuda_peak",
    "environment",
    "error_line",
    "hw_size",
    "trace_attempts",
]


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with seeded random values (norm weights near 1, V2 logit scales
    in [1, 3], everything else ``N(0, 0.05)``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                v = torch.rand(p.shape, generator=g) * 2 + 1
            elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
                v = torch.rand(p.shape, generator=g) + 0.5
            else:
                v = torch.randn(p.shape, generator=g) * 0.05
            p.copy_(v.to(p.device, p.dtype))
    return model


def error_line(err: BaseException, width: int = 120) -> str:
    """``Type: first line of the message`` for a report (some exceptions have an empty message)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:width]}" if lines else type(err).__name__


def hw_size(option: str) -> Callable[[str], tuple[int, int]]:
    """An argparse ``type`` for ``option``'s ``HxW`` values: ``"512x768"`` -> ``(512, 768)``; anything
    else, or a side under 32 pixels, is an error naming the option and the value."""

    def parse(text: str) -> tuple[int, int]:
        try:
            h, w = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} {text!r}: expected HxW, e.g. 512x768") from None
        if h < 32 or w < 32:
            raise argparse.ArgumentTypeError(f"{option} {text!r}: each side must be at least 32 pixels")
        return h, w

    return parse


def trace_attempts() -> int:
    """Dynamo's traces of a frame since ``torch._dynamo.utils.compilation_time_metrics`` was last
    cleared: 1, or 2 where a trace restarted (floats made graph inputs, then specialised)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(1 for k in compilation_time_metrics if k.startswith("compile_attempt_"))


#: Where a first compile spends its time, as ``torch._dynamo.utils.compilation_time_metrics`` names it:
#: Dynamo's trace; AOT autograd's metadata pass and joint trace; Inductor's lowering, scheduling and
#: code generation; the wait for the compile workers (C++ or Triton kernels). What a first call takes
#: beyond ``compile`` (the whole compile) runs the kernels, and on a GPU autotunes them.
PHASES = {
    "compile": "_compile.compile_inner",
    "dynamo": "bytecode_tracing",
    "aot metadata": "aot_collect_metadata",
    "aot joint": "aot_trace_joint_graph",
    "lowering": "GraphLowering.run",
    "scheduler": "Scheduler.__init__",
    "codegen": "Scheduler.codegen",
    "kernel compile wait": "async_compile.wait",
}


def compile_phases(seconds: float | None = None) -> dict[str, float]:
    """Seconds per :data:`PHASES` entry since ``compilation_time_metrics`` was last cleared (those
    this torch records); with ``seconds``, the first call's whole time, also ``"after compile"``."""
    from torch._dynamo.utils import compilation_time_metrics

    out = {k: round(sum(compilation_time_metrics[name]), 1) for k, name in PHASES.items()
           if compilation_time_metrics.get(name)}
    if seconds is not None and "compile" in out:
        out["after compile"] = round(seconds - out["compile"], 1)
    return out


#: A 16-channel, one-block-per-stage backbone: what the compile scripts build under ``--tiny`` (the tests').
TINY_BACKBONE = dict(embed_dim=16, depths=(1, 1, 1, 1))
TINY_HEADS = {"swin_tiny": (1, 1, 1, 1), "swinv2_tiny": (1, 1, 1, 1), "mvitv2_tiny": 1}  # MViTv2: stage 1's, doubled after


def tiny_backbone_options(name: str) -> dict[str, Any]:
    """``create_backbone`` options of the ``--tiny`` form of backbone ``name``."""
    return dict(TINY_BACKBONE, num_heads=TINY_HEADS[name])


def compile_script_options(p: argparse.ArgumentParser, families: list[str], default: list[str]) -> None:
    """The ``--device`` (``cpu`` or ``cuda``) and ``--families`` options of the compile scripts
    (``compile_sizes.py``, ``compile_first.py``, ``compile_train_sizes.py``)."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--families", nargs="+", default=default, choices=families, metavar="FAMILY",
                   help=f"among {', '.join(families)}")


def parsed_with_device(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)``; an error naming ``--device cuda`` where there is no GPU."""
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here")
    return args


def write_report(report: dict, json_path: str, markdown: str) -> dict:
    """Write ``report`` as JSON to ``json_path`` (if given), print ``markdown``, return ``report``."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    print(markdown)
    return report


def check_device(argv: list[str] | None, doc: str | None) -> str | None:
    """The ``--device`` (default ``cuda``) of a GPU check script whose only option it is, from
    ``argv``; ``None``, with a message, where it asks for CUDA and there is none."""
    import argparse

    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    device = ap.parse_args(argv).device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return None
    return device


def sync(device: str) -> None:
    """Wait for queued GPU work (no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def us_per_call(fn: Callable[[], object], repeats: int, warmup: int = 10) -> float:
    """Microseconds per call of ``fn`` on a GPU: CUDA events around ``repeats`` back-to-back calls
    after ``warmup`` calls (the kernels' pace when the host keeps ahead)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / repeats, 1)


def _time_once(fn: Callable[[], object], device: str) -> float:
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def interleaved_times(
    fns: dict[str, Callable[[], object]], device: str, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Milliseconds per call of each function, measured in turn: warm-up rounds first (not
    recorded), then ``repeats`` rounds of one call per contender. CUDA events on a GPU."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    if not fns:  # every contender of a case failed to build: nothing to time (and no r % 0)
        return times
    for r in range(repeats):
        # Rotate the order so no contender always runs right after the same other one.
        names = list(fns)
        names = names[r % len(names) :] + names[: r % len(names)]
        for k in names:
            times[k].append(_time_once(fns[k], device))
    return times


def compiled_first_calls(compiled: Callable[[torch.Tensor], dict], model: Callable[[torch.Tensor], dict],
                         xs: list[torch.Tensor], device: str, mark: int) -> dict[str, object]:
    """Run a freshly compiled backbone once per input in turn, as a detector meets new sizes: the
    seconds of each call, Dynamo's (graphs, frames) counts before input ``mark`` and at the end, and
    the max abs difference of the compiled maps to ``model``'s. Runs in the caller's grad/autocast
    context."""
    from torch._dynamo.utils import counters

    def counts() -> tuple[int, int]:
        return counters["stats"]["unique_graphs"], counters["frames"]["total"]

    seconds, diff, before = [], 0.0, None
    for i, x in enumerate(xs):
        if i == mark:
            before = counts()
        sync(device)
        t = time.perf_counter()
        got = compiled(x)
        sync(device)
        seconds.append(round(time.perf_counter() - t, 2))
        expected = model(x)
        diff = max(diff, max((got[k].float() - expected[k].float()).abs().max().item() for k in expected))
    end = counts()
    return {"seconds": seconds, "before mark": before or end, "end": end, "recompiled": before is not None and end != before,
            "diff": diff}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def count_flops(fn: Callable[[], object]) -> float:
    """FLOPs of one call (matmuls, convolutions and attention; a multiply-add counts 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def matmul_peak(device: str, dtype: torch.dtype = torch.float32, n: int | None = None, seconds: float = 1.0,
                library: str | None = None) -> float:
    """Dense square matmul throughput of the device in FLOP/s (best of repeated timings).

    On the CPU in float32 ``library`` picks the kernel: ``"blas"`` (``torch.mm``, MKL in the
    official wheels), ``"onednn"`` (the oneDNN matmul vtdense's linear layers may use, see
    :mod:`vtdense.layers.cpu_linear`) or ``None``, the faster of the two. Elsewhere ``torch.mm``."""
    n = n or (1536 if device == "cpu" else 8192)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device == "cpu" and dtype == torch.float32 and library is None and torch.backends.mkldnn.is_available():
        return max(matmul_peak(device, dtype, n, seconds / 2, "blas"), matmul_peak(device, dtype, n, seconds / 2, "onednn"))
    if library == "onednn":
        bt = b.t().contiguous()
        fn = lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], "")  # noqa: E731
    else:
        fn = lambda: torch.mm(a, b)  # noqa: E731
    fn()
    sync(device)
    best, spent = float("inf"), 0.0
    while spent < seconds * 1e3 or best == float("inf"):
        ms = _time_once(fn, device)
        best, spent = min(best, ms), spent + ms
    return 2 * n**3 / (best / 1e3)


def rss_mib() -> float:
    """Current resident set of this process in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_rss_worker(make_step: Callable[..., Callable[[], object]], args: tuple, threads: int) -> float:
    torch.set_num_threads(threads)
    step = make_step(*args)
    _trim()
    base = rss_mib()
    if not _reset_hwm():
        return float("nan")
    step()
    return _hwm_mib() - base


_SERVER: mp.context.BaseContext | None = None


def isolated_peak_rss(make_step: Callable[..., Callable[[], object]], args: tuple, threads: int) -> float:
    """Peak resident-set growth (MiB) of the first call of ``make_step(*args)()``, measured in a
    fresh process forked from a fork server that has imported the libraries but run nothing.

    The step is built (model, inputs) before the baseline is taken, so the figure is the memory
    the call itself needs: activations, gradients, workspaces, caches it builds. The first call
    is measured, not a later one, because freed memory a process keeps (malloc arenas) would hide
    a later call's needs. ``make_step`` must be importable (a module-level function).
    """
    global _SERVER
    if _SERVER is None:
        _SERVER = mp.get_context("forkserver")
        _SERVER.set_forkserver_preload(["torch", "timm", "torchvision", "vtdense"])
    with _SERVER.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_peak_rss_worker, (make_step, args, threads))


def cpu_tensor_peak(step: Callable[[], object]) -> float:
    """Peak tensor memory (MiB) one call of ``step`` allocates, from the profiler's memory timeline.

    The CPU counterpart of ``max_memory_allocated``: it counts tensors (activations, saved tensors,
    gradients, temporaries), not what the C allocator keeps mapped after a free, which peak RSS
    includes. Call ``step`` once before (caches built). Slow: it records shapes and stacks.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(s) for s in sizes) / 2**20


def cuda_peak(step: Callable[[], object]) -> float:
    """Peak GPU memory (MiB) one call allocates above what was allocated before it."""
    _trim()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: str) -> dict[str, object]:
    """Date, device, library versions and machine load, for the report header."""
    import timm
    import torchvision

    import vtdense

    env: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "device": device,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timm": timm.__version__,
        "vtdense": f"{vtdense.__version__} ({_git_commit()})",
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
