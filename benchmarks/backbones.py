"""Side-by-side speed and memory of vtdense backbones against timm on the same weights.

Run: ``python benchmarks/backbones.py [--device cuda] [--batch 2] [--repeats 5]``.

For every (model, input size) pair the script first checks that vtdense and timm give the same
features (timm's weights randomised, then copied into vtdense), then measures each implementation
in a fresh process so one cannot inherit the other's allocator state:

- forward latency (median over repeats, ``torch.no_grad``) and forward+backward latency;
- peak memory of forward+backward: ``torch.cuda.max_memory_allocated`` on CUDA, growth of the
  process's peak resident set on the CPU.

Timings on a shared machine are noisy: compare the two rows of a pair from the same run only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

import timm
import torch

import vtdense

# (vtdense name, timm name, input sizes (h, w)); the detection-size inputs are not window multiples.
PAIRS = [
    ("swin_tiny", "swin_tiny_patch4_window7_224", [(224, 224), (512, 768)]),
    ("swinv2_tiny", "swinv2_tiny_window8_256", [(256, 256), (512, 768)]),
]


def _randomize_(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 + 1)
            elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _build(impl: str, ours_name: str, timm_name: str, size: tuple[int, int]) -> torch.nn.Module:
    if impl == "timm":
        return timm.create_model(timm_name, pretrained=False, features_only=True, img_size=size)
    return vtdense.create_backbone(ours_name, out_norm=False)


def _features(impl: str, model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x)
    return [f.permute(0, 3, 1, 2) for f in out] if impl == "timm" else list(out.values())


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _measure(impl: str, ours_name: str, timm_name: str, size: tuple[int, int], batch: int, device: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = _build(impl, ours_name, timm_name, size).to(device)
    x = torch.randn(batch, 3, *size, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def fwd() -> None:
        with torch.no_grad():
            _features(impl, model, x)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        sum(f.float().mean() for f in _features(impl, model, x)).backward()

    def timed(fn) -> float:
        fn()  # warm-up: mask caches, kernel selection
        sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    model.eval()
    t_fwd = timed(fwd)
    model.train()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mib()
    t_fb = timed(fwd_bwd)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"fwd": t_fwd, "fwd_bwd": t_fb, "peak": peak}


def _max_diff(ours_name: str, timm_name: str, size: tuple[int, int], batch: int, device: str) -> float:
    ref = _build("timm", ours_name, timm_name, size)
    _randomize_(ref)
    ours = _build("vtdense", ours_name, timm_name, size)
    vtdense.load_pretrained(ours, ref.state_dict())
    ref, ours = ref.to(device).eval(), ours.to(device).eval()
    x = torch.randn(batch, 3, *size, device=device)
    with torch.no_grad():
        return max((a - b).abs().max().item() for a, b in zip(_features("timm", ref, x), _features("vtdense", ours, x)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = args.device
    print(f"device={dev} torch={torch.__version__} timm={timm.__version__} batch={args.batch} threads={torch.get_num_threads()}\n")
    print("| model | input | impl | fwd ms | fwd+bwd ms | peak MiB fwd+bwd | max abs diff vs timm |")
    print("|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for ours_name, timm_name, sizes in PAIRS:
        for size in sizes:
            windows_fit = all(s % (32 * (7 if ours_name == "swin_tiny" else 8)) == 0 for s in size)
            diff = f"{_max_diff(ours_name, timm_name, size, args.batch, dev):.1e}" if windows_fit else "n/a (timm#2438)"
            for impl in ("timm", "vtdense"):
                with ctx.Pool(1) as pool:
                    r = pool.apply(_measure, (impl, ours_name, timm_name, size, args.batch, dev, args.repeats))
                shape = f"{args.batch}x3x{size[0]}x{size[1]}"
                print(f"| {ours_name} | {shape} | {impl} | {r['fwd']:.1f} | {r['fwd_bwd']:.1f} | {r['peak']:.0f} | {diff} |", flush=True)


if __name__ == "__main__":
    main()
