"""vtdense side by side with timm and torchvision: speed, FLOP/s and peak memory, in one run.

Usage::

    python benchmarks/run.py --device cpu            # what ``make bench`` runs (< 10 min on 2 cores)
    python benchmarks/run.py --device cpu --quick    # a few minutes: the inference rows
    python benchmarks/run.py --device cuda --full    # every GPU row of the performance issue

For every case (model family, inference or training step, batch, size, precision) all contenders
are built in this process and timed interleaved: warm-up rounds, then ``repeats`` rounds of one
call per contender. The report gives

- the median time, the spread, images per second;
- ``vs best peer``: the best peer's median over this row's (vtdense rows; higher is better), and
  in brackets the lowest and highest of the same ratio taken round by round (:func:`paired_ratios`:
  the two calls of a round ran seconds apart, so a host that drifts during the run moves both);
- achieved FLOP/s (the contender's own FLOPs counted with ``torch.utils.flop_counter``) against the
  device's dense matmul peak measured at the start of the same run;
- peak memory: on the CPU the peak resident-set growth of one step in a fresh worker process
  (:func:`common.isolated_peak_rss`), on a GPU ``max_memory_allocated`` above the model's own;
- for backbones at window-multiple sizes, vtdense's max abs difference to timm on the same weights.

The default and full tiers end with four sections: the attention kernel every attention call
runs, from the profiler (:mod:`attention_kernels`: fused or SDPA's math fallback); the detection
recipe run end to end against its isolated step (:mod:`recipe_speed`); the batch shapes per
epoch at each padding grid with the cost of a new shape (:mod:`padding`); and the detectors'
AdamW step in torch's three implementations (:mod:`optimizer_step`).

Results go to ``benchmarks/results-<device>.json`` and to the ``<device>`` section of
``benchmarks/RESULTS.md`` (other sections are kept). On a shared machine compare only ratios of the
same run: absolute times move with the load.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from common import count_flops, cpu_tensor_peak, cuda_peak, environment, error_line, interleaved_times, isolated_peak_rss, matmul_peak, median  # noqa: E402
from contenders import build_model, features, make_step  # noqa: E402

import attention_kernels  # noqa: E402
import optimizer_step  # noqa: E402
import padding  # noqa: E402
import recipe_speed  # noqa: E402

TIERS = {"quick": 0, "default": 1, "full": 2}
#: seconds kept back for the sections after the cases (recipe end to end, padding grid, attention kernels,
#: optimizer step), per device
EXTRAS_SECONDS = {"cpu": {"recipe": 60.0, "padding": 30.0, "attention": 30.0, "optimizer": 20.0},
                  "cuda": {"recipe": 150.0, "padding": 60.0, "attention": 30.0, "optimizer": 20.0}}
RECIPE_STEPS = {"cpu": 40, "cuda": 200}
SWIN_PEERS = ["timm", "timm fused", "torchvision"]


def extras_reserve(device: str, budget: float, run_extras: bool) -> float:
    """Seconds of ``budget`` kept back from the cases for the four sections that follow them: their
    estimates, but at most half the budget, so a short budget still times the cases (a 255 s GPU
    budget once left every case out for 260 s of sections)."""
    if not run_extras:
        return 0.0
    total = sum(EXTRAS_SECONDS[device].values())
    return min(total, budget / 2) if budget else total


def extra_fits(device: str, name: str, left: float | None) -> bool:
    """Whether section ``name``'s estimate fits in the ``left`` seconds of the budget (None: no budget)."""
    return left is None or left >= EXTRAS_SECONDS[device][name]


def _case(name: str, family: str, mode: str, batch: int, size: tuple[int, int], contenders: list[str], *,
          tier: str = "default", device: str = "cpu", dtype: str = "fp32", **extra: Any) -> dict[str, Any]:
    return dict(name=name, family=family, mode=mode, batch=batch, size=list(size), contenders=contenders,
                tier=tier, device=device, dtype=dtype, **extra)


def _libraries_text(libs: dict[str, Any]) -> str:
    if not libs:
        return ""
    return (f" (BLAS `torch.mm` {libs['blas']:.0f}, oneDNN {libs['onednn']:.0f} GFLOP/s; vtdense's linear layers use "
            f"{libs['vtdense uses']}, timm's and torchvision's the BLAS)")


def cases() -> list[dict[str, Any]]:
    """Every case; ``tier`` is the smallest tier that runs it, ``device`` where it runs."""
    c = _case
    cpu = [
        c("Swin-T inference, batch 8 at 224", "swin_t", "infer", 8, (224, 224),
          ["vtdense", "vtdense blas", "vtdense unchunked", "vtdense compiled", *SWIN_PEERS, "timm compiled"], tier="quick",
          parity=True,
          compile_tier="full"),
        c("SwinV2-T inference, batch 8 at 256", "swinv2_t", "infer", 8, (256, 256),
          ["vtdense", "vtdense blas", "vtdense unchunked", "timm", "torchvision"], tier="quick", parity=True),
        c("MViTv2-T inference, batch 8 at 224", "mvitv2_t", "infer", 8, (224, 224), ["vtdense", "vtdense blas", "timm"],
          tier="quick", parity=True),
        c("Swin-T train step, batch 2 at 512x768", "swin_t", "train", 2, (512, 768),
          ["vtdense", "vtdense blas", "vtdense ckpt", "timm", "timm fused"]),
        c("SwinV2-T train step, batch 2 at 512x768", "swinv2_t", "train", 2, (512, 768), ["vtdense", "vtdense ckpt", "timm"]),
        c("MViTv2-T (windows 56) train step, batch 2 at 512x768", "mvitv2_t", "train", 2, (512, 768),
          ["vtdense", "vtdense bias", "vtdense ckpt"], tier="full", mvit_window=56),
        # Detection-size single images; the 256x384 -> 512x768 -> 1024x1536 rows give the x4 growth.
        c("Swin-T inference, 1 image at 256x384", "swin_t", "infer", 1, (256, 384), ["vtdense", "timm"], scale="swin_t"),
        c("Swin-T inference, 1 image at 512x768", "swin_t", "infer", 1, (512, 768), ["vtdense", "timm"], scale="swin_t"),
        c("Swin-T inference, 1 image at 1024x1024", "swin_t", "infer", 1, (1024, 1024), ["vtdense", "timm"], tier="full"),
        c("Swin-T inference, 1 image at 1024x1536", "swin_t", "infer", 1, (1024, 1536), ["vtdense"], tier="full", scale="swin_t"),
        c("SwinV2-T inference, 1 image at 512x768", "swinv2_t", "infer", 1, (512, 768), ["vtdense", "timm"], tier="full"),
        c("SwinV2-T inference, 1 image at 1024x1024", "swinv2_t", "infer", 1, (1024, 1024), ["vtdense", "timm"], tier="full"),
        c("MViTv2-T inference, 1 image at 256x384", "mvitv2_t", "infer", 1, (256, 384), ["vtdense", "vtdense global"],
          mvit_window=56, scale="mvitv2_t"),
        c("MViTv2-T inference, 1 image at 512x768", "mvitv2_t", "infer", 1, (512, 768), ["vtdense", "vtdense global"],
          mvit_window=56, scale="mvitv2_t"),
        c("MViTv2-T inference, 1 image at 1024x1024", "mvitv2_t", "infer", 1, (1024, 1024), ["vtdense"], tier="full", mvit_window=56),
        # Detectors.
        c("Mask R-CNN CPU demo train step (AdamW), batch 4 at 128x192", "maskrcnn_demo", "train", 4, (128, 192),
          ["vtdense"], tier="quick"),
        c("Mask R-CNN published heads train step (AdamW), batch 1 at 512x768", "maskrcnn", "train", 1, (512, 768),
          ["vtdense", "torchvision"]),
        c("Mask R-CNN published heads train step (AdamW), batch 2 at 800x1333", "maskrcnn", "train", 2, (800, 1333),
          ["vtdense", "torchvision"], tier="full"),
        c("Mask R-CNN published heads train step (AdamW), batch 2 at 800x1333, bf16", "maskrcnn", "train", 2, (800, 1333),
          ["vtdense", "torchvision"], tier="full", dtype="bf16"),
    ]
    g = dict(device="cuda", dtype="bf16")
    gpu = [
        c("Swin-T inference, batch 64 at 224, bf16", "swin_t", "infer", 64, (224, 224),
          ["vtdense", "vtdense triton-norm", "vtdense aten-norm", "vtdense compiled", *SWIN_PEERS, "timm fused compiled"], tier="quick",
          parity=True, **g),
        c("SwinV2-T inference, batch 64 at 256, bf16", "swinv2_t", "infer", 64, (256, 256),
          ["vtdense", "vtdense compiled", "timm", "torchvision", "timm compiled"], tier="quick", parity=True, **g),
        c("MViTv2-T inference, batch 64 at 224, bf16", "mvitv2_t", "infer", 64, (224, 224),
          ["vtdense", "vtdense triton-norm", "vtdense aten-norm", "vtdense compiled", "timm", "timm compiled"], tier="quick", parity=True, **g),
        c("Swin-T train step, batch 8 at 512x768, bf16", "swin_t", "train", 8, (512, 768),
          ["vtdense", "vtdense sdpa-attn", "vtdense triton-train", "vtdense fn-recompute", "vtdense ckpt", "vtdense unfused", "timm",
           "timm fused"], **g),
        c("SwinV2-T train step, batch 8 at 512x768, bf16", "swinv2_t", "train", 8, (512, 768),
          ["vtdense", "vtdense sdpa-attn", "vtdense fn-recompute", "vtdense ckpt", "timm"], **g),
        c("MViTv2-T (windows 56) train step, batch 8 at 512x768, bf16", "mvitv2_t", "train", 8, (512, 768),
          ["vtdense", "vtdense bias", "vtdense ckpt"], mvit_window=56, **g),
        c("MViTv2-T (windows 56) train step, batch 8 at 1024x1024, bf16", "mvitv2_t", "train", 8, (1024, 1024),
          ["vtdense", "vtdense bias", "vtdense ckpt"], mvit_window=56, **g),
        c("Swin-T inference, batch 8 at 512x768, bf16", "swin_t", "infer", 8, (512, 768), ["vtdense", "vtdense triton-norm", "vtdense aten-norm", "timm fused"],
          scale="swin_t", **g),
        c("Swin-T inference, batch 8 at 1024x1536, bf16", "swin_t", "infer", 8, (1024, 1536), ["vtdense", "timm fused"], scale="swin_t", **g),
        c("SwinV2-T inference, batch 8 at 1024x1024, bf16", "swinv2_t", "infer", 8, (1024, 1024), ["vtdense", "timm"], **g),
        c("MViTv2-T inference, batch 8 at 512x768, bf16", "mvitv2_t", "infer", 8, (512, 768), ["vtdense", "vtdense global"],
          mvit_window=56, scale="mvitv2_t", **g),
        c("MViTv2-T inference, batch 8 at 1024x1536, bf16", "mvitv2_t", "infer", 8, (1024, 1536), ["vtdense", "vtdense global"],
          mvit_window=56, scale="mvitv2_t", **g),
        c("Mask R-CNN CPU demo train step (AdamW), batch 4 at 128x192", "maskrcnn_demo", "train", 4, (128, 192), ["vtdense"],
          device="cuda"),
        c("Mask R-CNN published heads train step (AdamW), batch 2 at 800x1333, bf16", "maskrcnn", "train", 2, (800, 1333),
          ["vtdense", "vtdense torchvision-heads", "vtdense sdpa-attn", "vtdense triton-train", "vtdense unfused", "torchvision"],
          **g),
        c("Mask R-CNN published heads train step (AdamW), batch 2 at 800x1333, TF32", "maskrcnn", "train", 2, (800, 1333),
          ["vtdense", "vtdense torchvision-heads", "torchvision"], device="cuda"),
        # Last, so that their compiles (a minute or more each) cannot crowd out the rows above.
        c("Swin-T train step, batch 8 at 512x768, bf16, compiled", "swin_t", "train", 8, (512, 768),
          ["vtdense compiled", "timm fused compiled"], compile_tier="full", **g),
        c("Mask R-CNN published heads train step (AdamW), batch 2 at 800x1333, bf16, compile_backbone", "maskrcnn", "train",
          2, (800, 1333), ["vtdense", "vtdense compiled"], **g),
    ]
    return cpu + gpu


def _is_peer(contender: str) -> bool:
    return not contender.startswith("vtdense")


def paired_ratios(peer_ms: list[float], own_ms: list[float]) -> list[float]:
    """``peer / own`` for each round of :func:`common.interleaved_times` (its lists are in round
    order), sorted: the spread of ``vs best peer`` within one run. A ratio of medians can mix a fast
    round of one contender with a slow round of the other; a round's two calls ran moments apart."""
    if len(peer_ms) != len(own_ms):
        raise ValueError(f"paired_ratios: {len(peer_ms)} peer rounds against {len(own_ms)}")
    return sorted(p / o for p, o in zip(peer_ms, own_ms))


def parity(case: dict[str, Any], device: str) -> float | None:
    """Max abs difference of vtdense to timm on timm's (random) weights, batch 1, fp32."""
    import vtdense

    ours = build_model("vtdense", case).to(device).eval()
    ref = build_model("timm", case).to(device).eval()
    vtdense.load_pretrained(ours, ref.state_dict())
    x = torch.randn(1, 3, *case["size"], device=device)
    # main() allows TF32 on a GPU; parity is measured in true fp32 (else TF32's 10-bit mantissa
    # rounding would show as a gap between two correct implementations).
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            a, b = features(ours(x)), features(ref(x))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if case["family"].startswith("swin"):
        b = [f.permute(0, 3, 1, 2) for f in b]  # timm's Swin features are NHWC
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a, b))


def run_case(case: dict[str, Any], args: argparse.Namespace, peak_flops: float) -> dict[str, Any]:
    device = args.device
    tier = TIERS[args.tier]
    contenders = [
        k for k in case["contenders"]
        if not (k.endswith("compiled") and (args.no_compile or (tier < TIERS[case.get("compile_tier", "quick")] and not args.compile)))
        and not (k.startswith("timm") and k.endswith("compiled") and tier < TIERS["full"])
    ]
    print(f"\n== {case['name']}: {', '.join(contenders)}", flush=True)
    t0 = time.perf_counter()
    if args.deadline is not None and t0 >= args.deadline:
        print("   left out: the budget is spent", flush=True)
        return dict(case, contenders=contenders, rows=[], errors={}, left_out=True, round_s=None)
    steps, errors = {}, {}
    for k in contenders:
        try:
            steps[k] = make_step(k, case, device)
        except Exception as err:  # a peer that cannot run this case is reported, not fatal
            errors[k] = error_line(err)
            print(f"   {k}: cannot build ({errors[k]})", flush=True)
    flops: dict[str, float] = {}
    for k, fn in steps.items():
        if k.endswith("compiled"):
            continue
        try:
            flops[k] = count_flops(fn)  # doubles as the first warm-up call
        except Exception as err:
            errors[k] = error_line(err)
            print(f"   {k}: fails ({errors[k]})", flush=True)
    for k in list(steps):
        if k in errors:
            del steps[k]
        elif k.endswith("compiled"):
            flops[k] = flops.get(k.replace(" compiled", ""), float("nan"))
            t = time.perf_counter()
            try:
                steps[k]()  # compile here, outside the timed rounds
            except Exception as err:  # a contender that does not compile is reported, not fatal
                errors[k] = error_line(err)
                print(f"   {k}: fails to compile ({errors[k]})", flush=True)
                del steps[k]
                continue
            print(f"   {k}: compiled and ran once in {time.perf_counter() - t:.1f} s", flush=True)
    heavy = case["batch"] * case["size"][0] * case["size"][1] * (3 if case["mode"] == "train" else 1) > 2e6 and device == "cpu"
    repeats = args.repeats or (3 if heavy else 5)
    warmup = args.warmup
    if args.deadline is not None and steps:
        # The FLOP-counting call timed one step of each contender: fit the rounds into the budget
        # (fewer repeats, no warm-up, then no memory pass), or leave the case out if one round won't fit.
        one_round = time.perf_counter() - t0
        left = args.deadline - time.perf_counter()
        passes = lambda r, w, mem: (r + w + (mem and device == "cpu")) * one_round  # noqa: E731
        memory_pass = not args.no_memory
        while passes(repeats, warmup, memory_pass) > left and (warmup or repeats > 1 or memory_pass):
            if warmup:
                warmup = 0
            elif repeats > 2:
                repeats = 3 if repeats > 3 else 2
            elif memory_pass:
                memory_pass = False
            else:
                repeats -= 1
        if passes(repeats, warmup, memory_pass) > left:
            print(f"   left out: one round takes ~{one_round:.0f} s and {max(left, 0):.0f} s of the budget are left", flush=True)
            return dict(case, contenders=contenders, rows=[], errors=errors, left_out=True, round_s=one_round)
        if not memory_pass:
            args = argparse.Namespace(**{**vars(args), "no_memory": True})
    times = interleaved_times(steps, device, warmup=warmup, repeats=repeats)

    memory: dict[str, float] = {}
    if not args.no_memory:
        for k in steps:
            if device == "cpu":
                if k.endswith("compiled"):
                    continue  # would recompile in the worker
                memory[k] = isolated_peak_rss(make_step, (k, case, device), torch.get_num_threads())
            else:
                memory[k] = cuda_peak(steps[k])
    tensor_memory: dict[str, float] = {}
    if getattr(args, "tensor_memory", False) and device == "cpu" and case["mode"] == "train":
        for k in steps:
            if not k.endswith("compiled"):
                tensor_memory[k] = cpu_tensor_peak(steps[k])
                print(f"   {k}: tensor peak {tensor_memory[k]:.0f} MiB", flush=True)
    diff = None
    if case.get("parity") and "timm" in steps and "vtdense" in steps:
        try:
            diff = parity(case, device)
        except Exception as err:  # the timings of the case are kept
            errors["parity"] = error_line(err)
            print(f"   parity: fails ({errors['parity']})", flush=True)

    rows = []
    med = {k: median(v) for k, v in times.items()}
    peers = [k for k in med if _is_peer(k)]
    best = min(peers, key=med.get) if peers else None
    for k in steps:
        m = med[k]
        row = dict(contender=k, median_ms=m, min_ms=min(times[k]), max_ms=max(times[k]), times_ms=times[k],
                   images_per_s=case["batch"] / (m / 1e3), flops=flops.get(k), memory_mib=memory.get(k),
                   tensor_memory_mib=tensor_memory.get(k))
        f = flops.get(k)
        row["gflops_per_s"] = f / (m / 1e3) / 1e9 if f is not None and not math.isnan(f) else None
        row["pct_of_peak"] = 100 * row["gflops_per_s"] * 1e9 / peak_flops if row["gflops_per_s"] else None
        if best is not None and not _is_peer(k):
            row["vs_best_peer"] = med[best] / m
            row["vs_best_peer_rounds"] = paired_ratios(times[best], times[k])
            if memory.get(k) and memory.get(best):
                row["memory_vs_best_peer"] = memory[k] / memory[best]
            if tensor_memory.get(k) and tensor_memory.get(best):
                row["tensor_memory_vs_best_peer"] = tensor_memory[k] / tensor_memory[best]
        rows.append(row)
        print(f"   {k:22s} {m:9.1f} ms  (min {min(times[k]):.1f}, max {max(times[k]):.1f})"
              + (f"  x{row['vs_best_peer']:.2f} vs {best}" if "vs_best_peer" in row else "")
              + (f"  peak {memory[k]:.0f} MiB" if k in memory else ""), flush=True)
    print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    return dict(case, contenders=contenders, best_peer=best, parity_max_abs_diff=diff, rows=rows, errors=errors,
                repeats=repeats, warmup=warmup, memory_measured=not args.no_memory)


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _ratio_cell(row: dict[str, Any]) -> str:
    """``vs best peer`` with its per-round range, ``1.21 (1.17-1.24)`` (results of older runs: the ratio alone)."""
    cell = _fmt(row.get("vs_best_peer"), ".2f")
    rounds = row.get("vs_best_peer_rounds")
    if cell and rounds and len(rounds) > 1:
        cell += f" ({rounds[0]:.2f}-{rounds[-1]:.2f})"
    return cell


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    dev = report["device"]
    lines = [
        f"## {dev.upper()}: `python benchmarks/run.py --device {dev}{'' if report['tier'] == 'default' else ' --' + report['tier']}`",
        "",
        f"Measured {env['date']} on {env.get('gpu', env['cpu'])} ({env['threads']} threads); torch {env['torch']}, "
        f"torchvision {env['torchvision']}, timm {env['timm']}, vtdense {env['vtdense']}. "
        f"Load average at start {env['load_average_at_start']} on {env['cpu_count']} cores. "
        + (f"Allocator: {env['allocator']} (timed rows; `--keep-freed-memory`). " if env.get("allocator", "default") != "default" else "")
        + f"Dense {report['peak_dtype']} matmul peak measured in this run: **{report['peak_gflops']:.0f} GFLOP/s**"
        + _libraries_text(report.get("peak_by_library") or {})
        + f". Total {report['seconds']:.0f} s.",
        "",
        "Every contender of a case ran in this process, interleaved (warm-up, then repeats, median). "
        "`vs best peer` = the fastest non-vtdense contender's median / this row's (higher is better); in brackets "
        "the lowest and highest of that ratio round by round (the two calls of a round ran moments apart). "
        "Memory: " + ("peak RSS growth of one step in a fresh worker process (compiled rows: not measured)."
                      if dev == "cpu" else "`max_memory_allocated` above the model's own.")
        + " `mem/peer`: this row's memory over the fastest peer's.",
        "",
        "| case | contender | median ms | min-max ms | img/s | vs best peer | GFLOP/s | % of peak | peak MiB | mem/peer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        for r in case["rows"]:
            lines.append(
                f"| {case['name']} | {r['contender']} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
                f"{r['images_per_s']:.1f} | {_ratio_cell(r)} | {_fmt(r['gflops_per_s'], '.1f')} | "
                f"{_fmt(r['pct_of_peak'], '.0f')} | {_fmt(r['memory_mib'], '.0f')} | {_fmt(r.get('memory_vs_best_peer'), '.2f')} |"
            )
        for k, e in case["errors"].items():
            lines.append(f"| {case['name']} | {k} | failed: {e} | | | | | | | |")
    tensor = [f"{c['name']}: " + ", ".join(
        f"{r['contender']} {r['tensor_memory_mib']:.0f} MiB"
        + (f" ({r['tensor_memory_vs_best_peer']:.2f}x the best peer)" if r.get("tensor_memory_vs_best_peer") else "")
        for r in c["rows"] if r.get("tensor_memory_mib")) for c in report["cases"]
        if any(r.get("tensor_memory_mib") for r in c["rows"])]
    if tensor:
        lines += ["", "Tensor-level peak of one step (`--tensor-memory`: the profiler's memory timeline, the CPU "
                  "counterpart of `max_memory_allocated`; peak RSS also counts what glibc keeps mapped after frees): "
                  + "; ".join(tensor) + "."]
    diffs = [(c["name"], c["parity_max_abs_diff"]) for c in report["cases"] if c.get("parity_max_abs_diff") is not None]
    if diffs:
        lines += ["", "Parity on the same weights (timm's, random), batch 1, fp32: "
                  + "; ".join(f"{n}: max abs diff {d:.1e}" for n, d in diffs) + "."]
    scale = _scaling(report)
    if scale:
        lines += ["", "Growth of the time when the pixel count is multiplied by 4 (same run):", "",
                  "| family | contender | sizes | time x |", "|---|---|---|---|"] + scale
    trimmed = [f"{c['name']} ({c['repeats']} repeats{'' if c.get('memory_measured', True) else ', no memory pass'})"
               for c in report["cases"] if report.get("budget_s") and (c["repeats"] < 3 or not c.get("memory_measured", True))]
    if trimmed:
        lines += ["", f"Trimmed to fit the {report['budget_s']:.0f} s budget: " + "; ".join(trimmed) + "."]
    if report.get("left_out"):
        lines += ["", f"Left out, over the {report['budget_s']:.0f} s budget on this machine: {report['left_out']}."]
    for name, section in (("attention", attention_kernels), ("recipe", recipe_speed), ("padding", padding),
                          ("optimizer", optimizer_step)):
        extra = report.get("extras", {}).get(name)
        if isinstance(extra, dict):
            lines += [""] + section.markdown(extra)
        elif extra and extra.startswith("left out"):
            lines += ["", f"{name} section {extra}."]
        elif extra:
            lines += ["", f"{name} section failed: {extra}"]
    lines += ["", f"Skipped (other tiers or --only): {report['skipped']}" if report["skipped"] else ""]
    return "\n".join(lines).rstrip() + "\n"


def _scaling(report: dict[str, Any]) -> list[str]:
    out = []
    by_family: dict[str, list[dict[str, Any]]] = {}
    for c in report["cases"]:
        if c.get("scale"):
            by_family.setdefault(c["scale"], []).append(c)
    for fam, cs in by_family.items():
        cs.sort(key=lambda c: c["size"][0] * c["size"][1])
        for a, b in zip(cs, cs[1:]):
            if b["size"][0] * b["size"][1] != 4 * a["size"][0] * a["size"][1]:
                continue
            ta = {r["contender"]: r["median_ms"] / a["batch"] for r in a["rows"]}
            tb = {r["contender"]: r["median_ms"] / b["batch"] for r in b["rows"]}
            for k in ta:
                if k in tb:
                    name = {"vtdense": "vtdense (windows 56)"}.get(k, k) if fam == "mvitv2_t" else k
                    out.append(f"| {fam} | {name} | {a['size'][0]}x{a['size'][1]} -> {b['size'][0]}x{b['size'][1]} | {tb[k] / ta[k]:.2f} |")
    return out


def write_results(report: dict[str, Any], path: str) -> None:
    """Replace (or append) this device's section of RESULTS.md, keeping everything else."""
    dev = report["device"]
    start, end = f"<!-- bench:{dev}:start -->", f"<!-- bench:{dev}:end -->"
    block = f"{start}\n{markdown(report)}{end}"
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    if start in text and end in text:
        text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    tiers = ap.add_mutually_exclusive_group()
    tiers.add_argument("--quick", dest="tier", action="store_const", const="quick", help="inference rows and the demo step only")
    tiers.add_argument("--full", dest="tier", action="store_const", const="full", help="every row, including the slow ones")
    ap.set_defaults(tier="default")
    ap.add_argument("--repeats", type=int, default=0, help="timed rounds (0: 5, or 3 for heavy CPU cases)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after the FLOP-counting call")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    ap.add_argument("--only", default="", help="regular expression: run only the cases whose name matches")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    ap.add_argument("--compile", action="store_true",
                    help="run vtdense compiled on the CPU too (off by default there: compiling Swin-T takes minutes on 2 cores)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak memory measurement")
    ap.add_argument("--tensor-memory", action="store_true",
                    help="CPU training cases: also the tensor-level peak from the profiler's memory timeline (slow)")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip the recipe end-to-end, padding-grid, attention-kernel and optimizer-step sections "
                    "(run in the default and full tiers)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds for the whole run (0: no limit): cases get fewer repeats, then no memory pass, "
                    "then are left out (and listed) when the time left cannot hold them")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="CPU: call vtdense.allocator.keep_freed_memory() first, as the recipes do: the steady state, where "
                    "no contender page-faults its freed blocks in again at every step (default: a default process). "
                    "The memory workers stay default processes")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="Markdown file to update")
    ap.add_argument("--json", default="", help="JSON output (default: benchmarks/results-<device>.json)")
    args = ap.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device on this machine; the GPU rows are skipped.")
        return 0
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    env = environment(args.device)
    env["allocator"] = "default"
    if args.keep_freed_memory and args.device == "cpu":
        from vtdense.allocator import keep_freed_memory

        env["allocator"] = "keep_freed_memory()" if keep_freed_memory() else "default (keep_freed_memory() not taken)"
    print(json.dumps(env), flush=True)
    peak_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    libraries = {}
    if args.device == "cpu" and torch.backends.mkldnn.is_available():
        from vtdense.layers.cpu_linear import cpu_matmul

        libraries = {lib: matmul_peak("cpu", peak_dtype, seconds=0.5, library=lib) / 1e9 for lib in ("blas", "onednn")}
        libraries["vtdense uses"] = cpu_matmul()
        peak = max(libraries["blas"], libraries["onednn"]) * 1e9
    else:
        peak = matmul_peak(args.device, peak_dtype)
    print(f"matmul peak ({peak_dtype}): {peak / 1e9:.0f} GFLOP/s {libraries}", flush=True)

    selected, skipped = [], []
    for case in cases():
        if case["device"] != args.device:
            continue
        if TIERS[case["tier"]] > TIERS[args.tier] or (args.only and not re.search(args.only, case["name"])):
            skipped.append(case["name"])
            continue
        selected.append(case)
    # The four sections run after the cases; their time is kept back from the cases' budget.
    run_extras = args.tier != "quick" and not args.only and not args.no_extras
    extras_s = extras_reserve(args.device, args.budget, run_extras)
    args.deadline = t0 + args.budget - extras_s if args.budget else None
    results = []
    for case in selected:
        try:
            results.append(run_case(case, args, peak))
        except Exception as err:  # e.g. out of GPU memory: reported, the other cases still run
            print(f"   case failed: {error_line(err)}", flush=True)
            results.append(dict(case, best_peer=None, parity_max_abs_diff=None, rows=[], errors={"case": error_line(err)},
                                repeats=0, warmup=0, memory_measured=False))
        else:
            continue
        gc.collect()  # outside the except clause: the failed case's frames (models, tensors) are free now
        if args.device == "cuda":
            torch.cuda.empty_cache()
    left_out = [r["name"] for r in results if r.get("left_out")]
    extras: dict[str, Any] = {}
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the recipe section trains in a subprocess on the same GPU
    if run_extras:
        for name, fn in (("recipe", lambda: recipe_speed.run(args.device, steps=RECIPE_STEPS[args.device])),
                         ("padding", lambda: padding.run(args.device)),
                         # bf16 where users train (GPU); fp32 on the CPU, where bf16 is not the use
                         ("attention", lambda: attention_kernels.run(args.device, "bf16" if args.device == "cuda" else "fp32")),
                         ("optimizer", lambda: optimizer_step.run(args.device))):
            print(f"\n== {name} section", flush=True)
            left = t0 + args.budget - time.perf_counter() if args.budget else None
            if not extra_fits(args.device, name, left):
                extras[name] = f"left out: about {EXTRAS_SECONDS[args.device][name]:.0f} s needed, {max(left, 0):.0f} s of the budget left"
                print(extras[name], flush=True)
                continue
            try:
                extras[name] = fn()
            except Exception as err:  # noqa: BLE001 - reported in the table, the other results are kept
                extras[name] = f"{type(err).__name__}: {err}"[:500]
            print(extras[name], flush=True)
    results = [r for r in results if not r.get("left_out")]
    report = dict(device=args.device, tier=args.tier, environment=env, peak_gflops=peak / 1e9, peak_by_library=libraries,
                  peak_dtype=str(peak_dtype).replace("torch.", ""), cases=results,
                  skipped=", ".join(skipped), left_out=", ".join(left_out), budget_s=args.budget or None, extras=extras,
                  seconds=time.perf_counter() - t0)
    json_path = args.json or os.path.join(HERE, f"results-{args.device}.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    write_results(report, args.out)
    print(f"\nwrote {json_path} and the {args.device} section of {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
