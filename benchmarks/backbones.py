"""Side-by-side speed/memory of vtdense backbones against timm on the same weights.

Run: ``python benchmarks/backbones.py [--device cuda] [--batch 2] [--repeats 10]``.
Prints a Markdown table (forward latency median over repeats, forward+backward latency,
peak memory on CUDA) and checks the outputs agree before timing anything.
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

import vtdense

PAIRS = [
    ("swin_tiny", "swin_tiny_patch4_window7_224", 224),
    ("swinv2_tiny", "swinv2_tiny_window8_256", 256),
]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> tuple[float, float | None]:
    fn()  # warm-up (mask caches, cudnn autotune)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return statistics.median(times) * 1e3, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="input side = scale x the model's pretraining size")
    args = ap.parse_args()
    dev = args.device
    print(f"device={dev} torch={torch.__version__} timm={timm.__version__} batch={args.batch}\n")
    print("| model | input | impl | fwd ms | fwd+bwd ms | peak MiB (fwd+bwd) | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for ours_name, timm_name, size in PAIRS:
        side = size * args.scale
        ref = timm.create_model(timm_name, pretrained=False, features_only=True, img_size=side).to(dev).eval()
        ours = vtdense.create_backbone(ours_name, out_norm=False).to(dev).eval()
        vtdense.load_pretrained(ours, ref.state_dict())
        x = torch.randn(args.batch, 3, side, side, device=dev)
        with torch.no_grad():
            diff = max((a.permute(0, 3, 1, 2) - b).abs().max().item() for a, b in zip(ref(x), ours(x).values()))
        for impl, model, run in (("timm", ref, lambda m, x: m(x)), ("vtdense", ours, lambda m, x: list(m(x).values()))):
            def fwd() -> None:
                with torch.no_grad():
                    run(model, x)

            def fwd_bwd() -> None:
                model.zero_grad(set_to_none=True)
                sum(f.float().mean() for f in run(model, x)).backward()

            t_f, _ = _time(fwd, dev, args.repeats)
            model.train()
            t_fb, peak = _time(fwd_bwd, dev, args.repeats)
            model.eval()
            peak_s = f"{peak:.0f}" if peak is not None else "n/a (CPU)"
            print(f"| {ours_name} | {args.batch}x3x{side}x{side} | {impl} | {t_f:.1f} | {t_fb:.1f} | {peak_s} | {diff:.1e} |")


if __name__ == "__main__":
    main()
