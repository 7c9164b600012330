"""On a GPU: does ``vtdense::layer_norm_bf16`` (the Triton LayerNorm of CUDA bf16 inference) give
``layer_norm(x.float()).to(bfloat16)``, and what does switching it on change in the backbones' outputs?

    python benchmarks/triton_norm_check.py [--device cuda]

Prints one JSON object: per shape the fraction of bit-identical values and the largest difference in
bf16 steps; per backbone (bf16 autocast inference, batch 2) the largest difference of the outputs
with the kernel against without, relative to the outputs' largest magnitude. Its speed is timed by
``benchmarks/run.py`` (the ``vtdense triton-norm`` contender). ``tests/test_fused_norm.py`` runs the
kernel in Triton's CPU interpreter.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from common import check_device, us_per_call

import vtdense
from vtdense.layers.fused_norm import layer_norm_bf16, triton_norm


def kernel_vs_reference(device: str) -> list[dict]:
    torch.manual_seed(0)
    out = []
    for rows, C, dtype in [(64 * 3136, 96, torch.float32), (64 * 784, 192, torch.float32), (8 * 6144, 384, torch.bfloat16),
                           (4096, 768, torch.float32), (1000, 1536, torch.float32), (7, 100, torch.float32)]:
        x = (torch.randn(rows, C, device=device) * 3 + 5).to(dtype)
        w, b = torch.randn(C, device=device), torch.randn(C, device=device)
        y = layer_norm_bf16(x, w, b, 1e-5)
        ref = F.layer_norm(x.float(), (C,), w, b, 1e-5).to(torch.bfloat16)
        rel = ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)).max().item()
        out.append(dict(rows=rows, channels=C, input=str(dtype).replace("torch.", ""),
                        identical=round((y == ref).float().mean().item(), 6), max_rel=rel))
    return out


def backbones(device: str) -> dict[str, float]:
    out = {}
    for name in ("swin_tiny", "mvitv2_tiny"):
        torch.manual_seed(0)
        model = vtdense.create_backbone(name, out_norm=True).to(device).eval()
        x = torch.randn(2, 3, 224, 224, device=device)
        with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16):
            off = model(x)
            with triton_norm(True):
                on = model(x)
        out[name] = max(((on[k].float() - off[k].float()).abs().max() / off[k].float().abs().max()).item() for k in off)
    return out


def timings(device: str, repeats: int = 200,
            shapes: tuple[tuple[int, int], ...] = ((64 * 3136, 96), (64 * 196, 384), (4096, 96))) -> list[dict]:
    """Microseconds per call, CUDA events around ``repeats`` back-to-back calls. Inference: the
    Triton kernel launched directly (``_launch``), through the custom op, and ATen's ``layer_norm`` +
    cast. Training (:mod:`vtdense.layers.fused_norm_train`): the forward that also stores the rows'
    statistics, the recomputation from them, and the backward kernel against ATen's
    ``native_layer_norm_backward`` on the float32 gradient. At the large shape the kernels set the
    pace, at the small one the host."""
    from vtdense.layers.fused_norm import _launch, _run
    from vtdense.layers.fused_norm_train import _norm_backward

    out = []
    for rows, C in shapes:
        x = torch.randn(rows, C, device=device)
        w, b = torch.randn(C, device=device), torch.randn(C, device=device)
        g = torch.randn(rows, C, device=device).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)  # a conv's bf16 output, as Swin's patch-embedding norm reads it
        _, mean, rstd = _run(x, w, b, 1e-5, 1)
        shape = (rows, 1)
        forms = {
            "triton direct": lambda: _launch(x, w, b, 1e-5),
            "triton op": lambda: layer_norm_bf16(x, w, b, 1e-5),
            "aten + cast": lambda: F.layer_norm(x, (C,), w, b, 1e-5).to(torch.bfloat16),
            "f32 out triton (bf16 in)": lambda: _run(xb, w, b, 1e-5, 0, out_dtype=torch.float32),
            "f32 out aten (bf16 in)": lambda: F.layer_norm(xb.float(), (C,), w, b, 1e-5),
            "train fwd triton (stats)": lambda: _run(x, w, b, 1e-5, 1),
            "train recompute triton": lambda: _run(x, w, b, 1e-5, 2, mean, rstd),
            "train bwd triton": lambda: _norm_backward(g, x, w, mean, rstd, (True, True, True)),
            "train bwd aten (+ grad cast)": lambda: torch.ops.aten.native_layer_norm_backward(
                g.float(), x, [C], mean.view(shape), rstd.view(shape), w, b, [True, True, True]),
        }
        row: dict = dict(rows=rows, channels=C)
        for name, fn in forms.items():
            row[name] = us_per_call(fn, repeats)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    device = check_device(argv, __doc__)
    if device is None:
        return 0
    print(json.dumps(dict(kernel=kernel_vs_reference(device), backbones_max_rel_diff=backbones(device))))
    if device == "cuda":
        print(json.dumps(dict(us_per_call=timings(device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
