"""Host time of a GPU training step, estimated without a GPU: the backbone's GPU code forms on a tiny model.

    python benchmarks/host_proxy.py [--family swin_t|swinv2_t] [--size 112x112] [--repeats 20]

On the GPUs this project was lent, a Swin-T training step at batch 8 and 512x768 runs close to the
host's pace (``benchmarks/RESULTS.md``, H100 session: device time within 3-4 ms of host time). What
bounds it then is the host's work per step: ATen dispatch and the model's own Python. This script
measures that work on the CPU. The architecture is the real one (every block, every layer), at 8
channels per stage with one head, batch 1, on one thread, so that the kernels themselves cost
little. vtdense takes its GPU forms: attention inputs laid out as on a GPU
(``attention._GPU_LAYOUT_ON_CPU``), the recomputation through saved-tensor hooks (the GPU default;
every layer, since the size threshold applies off the CPU only), under CPU bf16 autocast (the
CPU's chunked and oneDNN paths step aside under autocast).

What it does not reproduce: CPU autocast leaves ``layer_norm`` in the input's dtype where CUDA
autocast runs it in float32 (so the casts around the norms are missing), SDPA takes its math path
(the bias needs a gradient), and the small kernels still run. Compare contenders within one run,
and read the Python call counts (exact, deterministic) beside the times. On the H100 the
forward's host time was 20.1 ms (hooks), 19.2 (``unfused``) and 16.2 (timm fused); this proxy
orders them the same way.

Contenders: ``vtdense`` (hooks form), ``vtdense unfused`` (no recomputation), ``vtdense fn-recompute``
(the autograd functions' Python backward), and timm (``timm fused`` for Swin V1, ``timm`` for V2:
timm's V2 has no fused path), run in alternating rounds; medians.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import randomize_  # noqa: E402

__all__ = ["gpu_forms", "measure", "markdown", "main"]

_NAMES = {"swin_t": ("swin_tiny", "swin_tiny_patch4_window7_224"),
          "swinv2_t": ("swinv2_tiny", "swinv2_tiny_window8_256")}
_TINY = dict(embed_dim=8, num_heads=(1, 1, 1, 1), drop_path_rate=0.0)


@contextlib.contextmanager
def gpu_forms(form: str = "hooks") -> Iterator[None]:
    """vtdense's GPU code forms on the CPU: attention's GPU layout and the recomputation ``form``
    (``"hooks"``, the GPU default, or ``"function"``)."""
    from vtdense.layers import attention, mlp

    before = attention._GPU_LAYOUT_ON_CPU, mlp._form
    attention._GPU_LAYOUT_ON_CPU = True
    mlp._set_recompute_form(form)
    try:
        yield
    finally:
        attention._GPU_LAYOUT_ON_CPU = before[0]
        mlp._set_recompute_form(before[1])


def _settings(contender: str) -> Callable[[], contextlib.AbstractContextManager]:
    from vtdense.layers.mlp import activation_recompute

    if contender == "vtdense":
        return gpu_forms
    if contender == "vtdense unfused":
        return lambda: _stack(gpu_forms(), activation_recompute(False))
    if contender == "vtdense fn-recompute":
        return lambda: gpu_forms("function")
    return contextlib.nullcontext


@contextlib.contextmanager
def _stack(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


def _model(contender: str, family: str, size: tuple[int, int]) -> torch.nn.Module:
    ours, timm_name = _NAMES[family]
    if contender.startswith("vtdense"):
        import vtdense

        return randomize_(vtdense.create_backbone(ours, out_norm=False, **_TINY))
    import timm

    model = timm.create_model(timm_name, pretrained=False, features_only=True, img_size=size, **_TINY)
    if contender == "timm fused":
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = True
    return randomize_(model)


def _calls(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Python calls made by ``fn()`` (cProfile's count, builtins included), and its result."""
    prof = cProfile.Profile()
    prof.enable()
    out = fn()
    prof.disable()
    return sum(v[1] for v in pstats.Stats(prof).stats.values()), out


def measure(family: str = "swin_t", size: tuple[int, int] = (112, 112), repeats: int = 20,
            contenders: list[str] | None = None) -> list[dict[str, Any]]:
    """Forward and backward host ms (medians over ``repeats`` alternating rounds) and the Python
    calls of each, per contender, on one thread under CPU bf16 autocast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peer = "timm fused" if family == "swin_t" else "timm"
        names = contenders or ["vtdense", "vtdense unfused", "vtdense fn-recompute", peer]
        x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0))
        runs = {}
        for name in names:
            torch.manual_seed(0)
            runs[name] = (_model(name, family, size).train(), _settings(name))

        def phases(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
            model, setting = runs[name]

            def forward() -> Any:
                with setting(), torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                feats = list(out.values()) if isinstance(out, dict) else list(out)
                return sum(f.float().mean() for f in feats)

            def backward(loss: Any) -> None:
                with setting():
                    loss.backward()

            return forward, backward

        def clear(name: str) -> None:
            for p in runs[name][0].parameters():
                p.grad = None

        times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for name in names:  # warm-up: caches and first calls
            fwd, bwd = phases(name)
            for _ in range(2):
                bwd(fwd())
                clear(name)
        for _ in range(repeats):
            for name in names:
                fwd, bwd = phases(name)
                t0 = time.perf_counter()
                loss = fwd()
                t1 = time.perf_counter()
                bwd(loss)
                times[name].append((t1 - t0, time.perf_counter() - t1))
                clear(name)
        rows = []
        for name in names:
            fwd, bwd = phases(name)
            n_fwd, loss = _calls(fwd)
            n_bwd, _ = _calls(lambda: bwd(loss))
            clear(name)
            f = statistics.median(a for a, _ in times[name]) * 1e3
            b = statistics.median(b for _, b in times[name]) * 1e3
            rows.append(dict(contender=name, forward_ms=f, backward_ms=b, step_ms=f + b,
                             forward_calls=n_fwd, backward_calls=n_bwd))
        return rows
    finally:
        torch.set_num_threads(threads)


def markdown(rows: list[dict[str, Any]], family: str, size: tuple[int, int]) -> str:
    out = [f"| {family} GPU forms at 8 channels, batch 1 at {size[0]}x{size[1]}, 1 thread, CPU bf16 autocast | "
           "forward ms | backward ms | step ms | Python calls, forward / backward |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['contender']} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['step_ms']:.2f} | "
                   f"{r['forward_calls']} / {r['backward_calls']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="swin_t", choices=sorted(_NAMES))
    p.add_argument("--size", default="112x112", help="HxW (timm's models are built for it)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    size = tuple(int(v) for v in args.size.lower().split("x"))
    if len(size) != 2 or min(size) < 32:
        p.error(f"--size {args.size!r}: give HxW, each at least 32")
    print(markdown(measure(args.family, size, args.repeats), args.family, size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
