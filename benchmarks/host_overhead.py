"""Host (Python) time of one forward, without a GPU: the models run on fake CUDA tensors.

    python benchmarks/host_overhead.py [--family swin_t|swinv2_t|mvitv2_t] [--train] [--batch 64] [--top 15]

On a GPU, a step whose kernels take less time than the host needs to launch them runs at the host's
pace: the H200 profile in RESULTS.md found vtdense's Swin-T forward at batch 64 with 9.1 ms of kernels
and 14.6 ms of wall time. Fake CUDA tensors (``launches.fake_cuda``, under CUDA bf16 autocast) run no kernels, and the models
take their GPU code paths on them, so what is measured is the Python of the model. Fake tensors'
dispatch is far slower than CUDA's launches, so compare the contenders' *own-code* column (time spent
in the model's own Python files, ``cProfile``'s tottime), not the totals; ``launches.py`` counts the
ATen calls. cProfile itself adds about a microsecond per Python call, so small, often-called functions
look costlier here than they are.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from contenders import FAMILIES, build_model  # noqa: E402
from launches import cuda_autocast, fake_cuda  # noqa: E402

SIZES = {"swin_t": (224, 224), "swinv2_t": (256, 256), "mvitv2_t": (224, 224)}


def _own(filename: str) -> bool:
    return any(f"{os.sep}{pkg}{os.sep}" in filename for pkg in ("vtdense", "timm", "torchvision")) and "torch" + os.sep + "nn" not in filename


def measure(contender: str, family: str, batch: int = 64, train: bool = False, repeats: int = 5,
            top: int = 0) -> dict[str, Any]:
    """Per forward (recording autograd's graph with ``train``), bf16 autocast on fake CUDA tensors: the wall
    time and the time in the model's own Python files (ms)."""
    case = dict(family=family, size=list(SIZES[family]), mode="train" if train else "infer", batch=batch)
    model = build_model(contender, case).train(train)
    with fake_cuda():
        model = model.to("cuda")
        x = torch.empty(batch, 3, *SIZES[family], device="cuda")

        def step() -> None:
            # Training: the forward with autograd recording (autograd's engine cannot run the
            # backward on fake tensors; the GPU profile's cProfile table covers it).
            with torch.set_grad_enabled(train), cuda_autocast(torch.bfloat16):
                model(x)

        step()  # fills the per-size caches
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        wall = (time.perf_counter() - t0) / repeats * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(repeats):
            step()
        prof.disable()
    stats = pstats.Stats(prof)
    own = sum(v[2] for k, v in stats.stats.items() if _own(k[0])) / repeats * 1e3
    text = ""
    if top:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(r"vtdense|timm|torchvision", top)
        text = s.getvalue()
    return dict(contender=contender, wall_ms=wall, own_ms=own, profile=text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="swin_t", choices=sorted(FAMILIES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train", action="store_true", help="the training forward (gradients recorded)")
    ap.add_argument("--top", type=int, default=0, help="print vtdense's hottest Python functions")
    args = ap.parse_args(argv)
    peers = ["vtdense", "timm fused" if args.family == "swin_t" else "timm"]
    print(f"| {args.family} batch {args.batch} {'train' if args.train else 'infer'} (fake CUDA, bf16) | wall ms | own Python ms |")
    print("|---|---|---|")
    for name in peers:
        r = measure(name, args.family, args.batch, args.train, top=args.top if name == "vtdense" else 0)
        print(f"| {name} | {r['wall_ms']:.1f} | {r['own_ms']:.2f} |", flush=True)
        if r["profile"]:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
