"""On a GPU: the three forms of training's recomputation, their gradients and their memory.

    python benchmarks/recompute_check.py [--device cuda]

Gradients: Swin-T and MViTv2-T at batch 2, 256x384, under bf16 autocast, with the saved-tensor
hooks form (``vtdense.layers.recompute``, the default off the CPU), the autograd functions
(``_set_recompute_form("function")``) and no recomputation, each against a second run without
recomputation, as the largest difference relative to the gradient's largest magnitude; the plain
run against itself measures the kernels' own run-to-run differences (atomic adds). The worst
parameters are named. On CUDA the Triton form is compared too, with every pre-norm through the
Triton LayerNorm (``triton-every``: this check's sizes are below its bar); that LayerNorm rounds
about 1 in 10,000 values one bf16 step away from PyTorch's, so its gradients should differ from
plain autograd's within bf16 rounding, and no more.

Memory (CUDA only): Swin-T at batch 8, 512x768, bf16, for each form: MiB held after the forward
above the model, the forward's peak and the backward's peak. ``triton`` (CUDA only) is the hooks
form with the large pre-norms through the Triton LayerNorm (:mod:`vtdense.layers.fused_norm_train`).
Prints JSON lines. ``tests/test_recompute_hooks.py`` checks the gradients and what is kept on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Iterator

import torch
from common import check_device

import vtdense
from vtdense.layers import mlp


def _grads(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
    sum(f.float().square().mean() for f in out.values()).backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def _form(name: str) -> Iterator[None]:
    """``plain``, ``function``, ``hooks``, ``triton`` (hooks, and the large pre-norms through
    :mod:`vtdense.layers.fused_norm_train`) or ``triton-every`` (every pre-norm through it)."""
    if name == "plain":
        with mlp.activation_recompute(False):
            yield
        return
    if name in ("triton", "triton-every"):
        from vtdense.layers import fused_norm
        from vtdense.layers.fused_norm_train import triton_norm_training

        bar = fused_norm.AUTO_MIN_ELEMENTS
        if name == "triton-every":  # every pre-norm, however small (the gradient check's sizes are)
            fused_norm.AUTO_MIN_ELEMENTS = 0
        try:
            with triton_norm_training(True):
                yield
        finally:
            fused_norm.AUTO_MIN_ELEMENTS = bar
        return
    mlp._set_recompute_form(name)  # "function" or "hooks"
    try:
        yield
    finally:
        mlp._set_recompute_form("auto")


def gradients(device: str, size: tuple[int, int] = (256, 384)) -> dict:
    out = {}
    for name in ("swin_tiny", "mvitv2_tiny"):
        torch.manual_seed(0)
        model = vtdense.create_backbone(name, drop_path_rate=0.0).to(device).train()
        x = torch.randn(2, 3, *size, device=device)
        with _form("plain"):
            plain = _grads(model, x)
        row: dict = {}
        for form in ("plain", "function", "hooks") + (("triton-every",) if device == "cuda" else ()):
            with _form(form):
                g = _grads(model, x)
            rel = {k: ((g[k] - plain[k]).abs().max() / plain[k].abs().max().clamp_min(1e-12)).item() for k in plain}
            worst = sorted(rel, key=rel.get, reverse=True)[:3]
            row[f"{form}_vs_plain"] = {k: f"{rel[k]:.2e}" for k in worst}
        out[name] = row
    return out


def memory(device: str) -> dict:
    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", drop_path_rate=0.0, out_norm=False).to(device).train()
    x = torch.randn(8, 3, 512, 768, device=device)
    out = {}
    for form in ("function", "hooks", "triton", "plain"):
        with _form(form):
            for _ in range(2):  # the second pass is measured
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                with torch.autocast(device, dtype=torch.bfloat16):
                    feats = model(x)
                loss = sum(f.float().square().mean() for f in feats.values())
                del feats
                torch.cuda.synchronize()
                held, fwd_peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
                torch.cuda.reset_peak_memory_stats()
                loss.backward()
                del loss
                torch.cuda.synchronize()
                bwd_peak = torch.cuda.max_memory_allocated() - base
        out[form] = [round(v / 2**20) for v in (held, fwd_peak, bwd_peak)]
    return out


def main(argv: list[str] | None = None) -> int:
    device = check_device(argv, __doc__)
    if device is None:
        return 0
    print(json.dumps(dict(gradients=gradients(device))))
    if device == "cuda":
        print(json.dumps(dict(memory_mib_held_fwdpeak_bwdpeak=memory(device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
