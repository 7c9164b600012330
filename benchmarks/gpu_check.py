"""The GPU checks of the performance issue that are not timings: attention paths and dynamic compile.

On the device the tests never see (CI has no GPU), this answers:

- **attention paths**: every path (``sdpa``, ``flex``) gives the ``math`` path's outputs, and
  ``sdpa`` its parameter gradients, in fp32 (TF32 off; target 1e-5) for Swin V1, Swin V2 and
  MViTv2 (global and hybrid windows); each path's and math's fp32 error against the float64 model
  (math path), and the outputs' magnitude, say whether a difference is one path's inaccuracy or
  float32's rounding at that magnitude; in bf16 autocast each path's output against fp32 ``math``
  (the relative error bf16 itself brings, about 1e-2); for MViTv2 also the gradients of its
  training default (relative positions folded into q/k) against the additive bias;
- **dynamic compile**: ``torch.compile(backbone, dynamic=True, fullgraph=True)`` at two sizes, then five more
  detection sizes: seconds per call (the first holds the compile; target under 2 minutes on a
  GPU), Dynamo's graph and frame counts after the first two sizes and at the end (equal: no
  recompilation) and the compiled output's max abs difference to eager;
- **CUDA graphs**: ``mode="reduce-overhead"`` at three sizes (tiny configs), replayed after vtdense's
  size caches were emptied and their memory reused: the replays still equal eager.

Usage::

    python benchmarks/gpu_check.py --device cuda --compile-only swin_tiny --out check.json
    python benchmarks/gpu_check.py --device cpu --tiny --compile-backend eager   # what the test runs

``--tiny`` uses small configs and sizes (seconds on a CPU); without it the published ``*_tiny``
models at detection sizes. Each check reports its own failure and the others still run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from common import compiled_first_calls, environment, error_line, randomize_, trace_attempts  # noqa: E402

#: name -> (vtdense backbone, overrides); the tiny overrides keep a shifted, padded stage
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "swin_tiny": ("swin_tiny", {}, dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)),
    "swinv2_tiny": ("swinv2_tiny", {}, dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)),
    "mvitv2_tiny": ("mvitv2_tiny", {}, dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1)),
    "mvitv2_tiny windows": ("mvitv2_tiny", dict(window_size=56), dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1,
                                                                     window_size=8)),
}
PATH_SIZE = {False: (2, (256, 384)), True: (2, (160, 192))}
COMPILE_SIZES = {
    False: ([(512, 768), (640, 800)], [(480, 736), (800, 1088), (576, 960), (704, 704), (768, 1024)]),
    True: ([(160, 192), (192, 256)], [(224, 160), (256, 320), (288, 224), (160, 288), (320, 192)]),
}


def _model(name: str, tiny: bool, device: str) -> torch.nn.Module:
    import vtdense

    backbone, full, small = FAMILIES[name]
    model = vtdense.create_backbone(backbone, drop_path_rate=0.0, **(small if tiny else full))
    return randomize_(model).to(device)


def _outputs(model: torch.nn.Module, x: torch.Tensor, path: str, bf16: bool = False) -> list[torch.Tensor]:
    from vtdense.layers.attention import attention_backend

    amp = torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16)
    with attention_backend(path), amp:
        return [f.float() for f in model(x).values()]


def _grads(model: torch.nn.Module, x: torch.Tensor, path: str) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    sum(f.square().mean() for f in _outputs(model, x, path)).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item() for p, q in zip(a, b))


def check_paths(name: str, tiny: bool, device: str) -> dict[str, Any]:
    """Max abs difference of each attention path to ``math`` (fp32), of ``sdpa``'s gradients to
    ``math``'s, and each path's bf16 output's relative error against fp32 ``math``."""
    from vtdense.layers.attention import flex_available

    torch.manual_seed(0)
    model = _model(name, tiny, device)
    batch, size = PATH_SIZE[tiny]
    x = torch.randn(batch, 3, *size, device=device)
    paths = ["sdpa"] + (["flex"] if flex_available() else [])
    out: dict[str, Any] = {"size": list(size), "batch": batch}
    model.eval()
    with torch.no_grad():
        ref = _outputs(model, x, "math")
        # How far float32 itself is from the exact result: the float64 model on the math path. A
        # path whose fp32 output is as near to that as math's is, is as accurate, whatever the
        # difference between the two (it scales with the outputs' magnitude).
        exact = [f.double() for f in copy.deepcopy(model).double()(x.double()).values()]
        out["output max abs"] = max(f.abs().max().item() for f in exact)
        out["math fp32 max abs err vs fp64"] = _max_diff([r.double() for r in ref], exact)
        for path in paths:
            fp32 = _outputs(model, x, path)
            out[f"{path} fp32 max abs diff"] = _max_diff(fp32, ref)
            out[f"{path} fp32 max abs err vs fp64"] = _max_diff([f.double() for f in fp32], exact)
            out[f"{path} bf16 max rel err"] = _max_rel(_outputs(model, x, path, bf16=True), ref)
    model.train()
    sdpa_grads = _grads(model, x, "sdpa")
    out["sdpa fp32 grad max abs diff"] = _max_diff(sdpa_grads, _grads(model, x, "math"))
    if name.startswith("mvitv2"):  # training folds the relative positions into q/k; the bias path must agree
        attns = [m for m in model.modules() if hasattr(m, "rel_pos_fold")]
        for m in attns:
            m.rel_pos_fold = False
        out["sdpa fp32 grad max abs diff, rel-pos bias vs fold"] = _max_diff(_grads(model, x, "sdpa"), sdpa_grads)
        for m in attns:
            m.rel_pos_fold = None
    return out


def check_compile(name: str, tiny: bool, device: str, backend: str) -> dict[str, Any]:
    """``torch.compile(model, dynamic=True, fullgraph=True)`` over two sizes, then five more: seconds
    per call, Dynamo's counts after two sizes and at the end (one graph: a break is an error), max abs
    difference to eager, and Dynamo's trace attempts of the frame (2: the trace restarted once the floats
    it had made graph inputs were specialised; ``compile_backbone`` traces once, see
    ``benchmarks/compile_first.py``)."""
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    torch.manual_seed(0)
    model = _model(name, tiny, device).eval()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=backend)
    first, more = COMPILE_SIZES[tiny]
    with torch.no_grad():
        xs = [torch.randn(1, 3, *size, device=device) for size in first + more]
        calls = compiled_first_calls(compiled, model, xs, device, mark=len(first))
    return {"backend": backend, "sizes": [list(s) for s in first + more], "seconds per call": calls["seconds"],
            "graphs/frames after two sizes": list(calls["before mark"]), "graphs/frames at the end": list(calls["end"]),
            "recompiled": calls["recompiled"], "max abs diff to eager": calls["diff"],
            "trace attempts": trace_attempts()}


def check_cuda_graphs(name: str, tiny: bool, device: str) -> dict[str, Any]:
    """``torch.compile(mode="reduce-overhead", dynamic=True)`` (CUDA graphs, one recorded per size)
    at three sizes, each run until its graph is recorded; then vtdense's window mask / index caches
    are emptied and new tensors are allocated over the memory they held, and each size's graph is
    replayed: max abs difference to eager (a replay that read a freed cache entry would differ).
    The same for ``torch.cuda.graph`` recording the eager model at the last size, with every
    table cache (position indices and biases too) emptied before the replay.
    Always the tiny config and sizes: what is checked is the caches' lifetime, and a full model
    would spend minutes of the device call compiling. ``tiny`` is accepted for a uniform call."""
    import torch._dynamo

    if not device.startswith("cuda"):
        return {"skipped": "CUDA graphs need a GPU"}
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _model(name, True, device).eval()
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=True)
    first, more = COMPILE_SIZES[True]
    sizes = first + more[:1]
    xs = [torch.randn(1, 3, *size, device=device) for size in sizes]
    diff = 0.0
    with torch.no_grad():
        for x in xs:
            for _ in range(3):  # warm-up, record, replay
                compiled(x)
        junk = _empty_table_caches(model, device)
        for x in xs:
            got = {k: v.float().clone() for k, v in compiled(x).items()}  # a replay's outputs live until the next one
            expected = model(x)
            diff = max(diff, _max_diff(list(got.values()), [expected[k].float() for k in got]))
        del junk
        try:
            eager_diff: float | str = _eager_cuda_graph_diff(model, xs[-1], device)
        except Exception as err:  # reported next to the compiled check's result
            traceback.print_exc()
            eager_diff = error_line(err, 300)
    return {"sizes": [list(s) for s in sizes], "max abs diff to eager after the caches were emptied": diff,
            "torch.cuda.graph of the eager model, replayed after the caches were emptied: max abs diff": eager_diff}


def _empty_table_caches(model: torch.nn.Module, device: str) -> list[torch.Tensor]:
    """Empty every cache of size-dependent tables (window masks and indices, position indices and
    coordinates, the modules' cached position biases), then allocate over the memory they held; the
    returned tensors keep that memory taken until they are dropped."""
    from vtdense.layers import position, windows

    for cache in (windows._window_mask_cached, windows._token_index_cached, windows._no_mask, position._rel_index_cached,
                  position._log_cpb_coords, position._decomposed_index, position._key_one_hot):
        cache.cache_clear()
    for module in model.modules():
        if isinstance(getattr(module, "_bias_cache", None), dict):
            module._bias_cache.clear()
    return [torch.full((1 << 18,), 7, dtype=torch.int64, device=device) for _ in range(64)]


def _eager_cuda_graph_diff(model: torch.nn.Module, x: torch.Tensor, device: str) -> float:
    """Record the eager model's forward with ``torch.cuda.graph`` (after a warm-up on a side
    stream, as CUDA graphs require), empty the table caches, replay: max abs difference to eager."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)
    junk = _empty_table_caches(model, device)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    expected = model(x)
    del junk
    return _max_diff([static_out[k].float() for k in expected], [v.float() for v in expected.values()])


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as err:  # one failing check is reported; the others still run
        traceback.print_exc()
        return {"error": error_line(err, 300)}


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables."""
    env = report["environment"]
    lines = [f"### GPU checks: `python benchmarks/gpu_check.py --device {report['device']}`", "",
             f"{env.get('device_name', report['device'])}; torch {env.get('torch')}; tiny configs: {report['tiny']}.", "",
             "| backbone | check | result |", "|---|---|---|"]
    for section in ("paths", "compile", "cuda graphs"):
        for name, res in report[section].items():
            for key, value in res.items():
                if isinstance(value, float):
                    value = f"{value:.2e}"
                lines.append(f"| {name} | {section}: {key} | {value} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="small configs and sizes (seconds on a CPU)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend ('eager': Dynamo only)")
    p.add_argument("--only", nargs="*", default=list(FAMILIES), choices=list(FAMILIES), help="backbones to check")
    p.add_argument("--compile-only", nargs="*", default=None, choices=list(FAMILIES),
                   help="backbones for the compile check (default: those of --only)")
    p.add_argument("--no-compile", action="store_true", help="skip the compile check")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device on this machine")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons at 1e-5 need true fp32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    report: dict[str, Any] = {"device": args.device, "tiny": args.tiny, "environment": environment(args.device),
                              "paths": {}, "compile": {}, "cuda graphs": {}}
    def save() -> None:  # after every check, so a run cut off by its time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    for name in args.only:
        report["paths"][name] = _guarded(lambda: check_paths(name, args.tiny, args.device))
        print(name, "paths:", json.dumps(report["paths"][name]), flush=True)
        save()
    if not args.no_compile:
        for name in args.only if args.compile_only is None else args.compile_only:
            report["compile"][name] = _guarded(lambda: check_compile(name, args.tiny, args.device, args.compile_backend))
            print(name, "compile:", json.dumps(report["compile"][name]), flush=True)
            save()
            report["cuda graphs"][name] = _guarded(lambda: check_cuda_graphs(name, args.tiny, args.device))
            print(name, "cuda graphs:", json.dumps(report["cuda graphs"][name]), flush=True)
            save()
    print(markdown(report))
    save()
    return report


if __name__ == "__main__":
    main()
