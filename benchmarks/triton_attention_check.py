"""On a GPU: Swin's training attention in Triton kernels (:mod:`vtdense.layers.triton_window_attention`)
against the default SDPA path, per block of Swin-T (and SwinV2-T's form) at batch 8 and 512x768.

    python benchmarks/triton_attention_check.py [--device cuda]

Prints JSON lines. ``check``: for one shifted block of each stage, V1 and V2, the largest difference
of the block's output and of its input's, qkv weight's and position bias's (V1's table, V2's Log-CPB
MLP's first weight) gradients, and V2's logit scale's, with the kernels against without, relative to
the largest magnitude, in float32 (TF32 off) and under bf16 autocast (the GPU's bf16 products,
which Triton's CPU interpreter cannot run). ``us``: microseconds per forward and
backward of the block's attention (qkv projection, attention, output projection) with and without
the kernels, CUDA events around back-to-back calls, for the shifted and unshifted block of each stage;
then the backward kernel's programs and warps swept (``_BACKWARD_PROGRAMS``, ``_BACKWARD_WARPS``) on
stage 1's shifted block. ``tests/test_triton_window_attention.py`` runs it in the interpreter at a tiny
size.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch
from common import check_device, us_per_call

from vtdense.backbones.swin import SwinBlock
from vtdense.layers import triton_window_attention as twa

#: Swin-T's stages at 512x768: (map h, w, channels, heads)
STAGES = ((128, 192, 96, 3), (64, 96, 192, 6), (32, 48, 384, 12), (16, 24, 768, 24))


def _position_param(block: SwinBlock) -> torch.Tensor:
    return block.attn.cpb_mlp[0].weight if block.post_norm else block.attn.relative_position_bias_table


def _block_step(block: SwinBlock, x: torch.Tensor, dtype: torch.dtype | None) -> Callable[[], Any]:
    """One forward and backward of ``block``'s windowed attention on ``x`` ``(B, H, W, C)``, the
    same upstream gradient every time."""
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device)

    def step() -> Any:
        x.grad = None
        with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = block._window_attention(x, norm=None if block.post_norm else block.norm1)
        out.float().backward(up)
        return out

    return step


def _make(stage: tuple[int, int, int, int], shifted: bool, batch: int, device: str,
          v2: bool = False) -> tuple[SwinBlock, torch.Tensor]:
    H, W, C, heads = stage
    torch.manual_seed(0)
    block = SwinBlock(C, heads, (8, 8) if v2 else (7, 7), shifted=shifted, post_norm=v2).to(device).train()
    with torch.no_grad():
        if v2:
            block.attn.logit_scale.copy_(torch.linspace(1.0, 3.0, heads).view_as(block.attn.logit_scale))
        else:
            block.attn.relative_position_bias_table.normal_(0, 0.5)
    x = torch.randn(batch, H, W, C, device=device, requires_grad=True)
    return block, x


def check(device: str, batch: int = 2, stages: tuple = STAGES) -> list[dict]:
    """Kernels against the default path (see the module docstring)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    try:
        for i, stage in enumerate(stages):
            for v2 in (False, True):
                for dtype in (None, torch.bfloat16):
                    block, x = _make(stage, True, batch, device, v2)
                    params = (block.attn.qkv.weight, _position_param(block)) + ((block.attn.logit_scale,) if v2 else ())
                    got = {}
                    for on in (False, True):
                        for p in params:
                            p.grad = None
                        with twa.triton_window_attention(on):
                            out = _block_step(block, x, dtype)()
                        got[on] = [out.detach().float(), x.grad.clone(), *(p.grad.clone() for p in params)]
                    rel = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got[True], got[False])]
                    rows.append(dict(stage=i + 1, family="v2" if v2 else "v1", dtype="bf16" if dtype else "fp32",
                                     **dict(zip(("out", "x_grad", "qkv_weight_grad", "position_grad", "logit_scale_grad"),
                                                rel))))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return rows


def timings(device: str, batch: int = 8, repeats: int = 50, stages: tuple = STAGES,
            sweep: tuple = ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 4))) -> list[dict]:
    """Microseconds per forward + backward (see the module docstring)."""
    rows = []
    for i, stage in enumerate(stages):
        for shifted in (False, True):
            block, x = _make(stage, shifted, batch, device)
            step = _block_step(block, x, torch.bfloat16)
            row: dict = dict(stage=i + 1, shifted=shifted)
            for on in (False, True):
                with twa.triton_window_attention(on):
                    row["triton" if on else "sdpa"] = us_per_call(step, repeats, warmup=3)
            rows.append(row)
    block, x = _make(stages[0], True, batch, device, v2=True)  # SwinV2-T's first stage, window 8
    step = _block_step(block, x, torch.bfloat16)
    row = dict(stage=1, shifted=True, family="v2")
    for on in (False, True):
        with twa.triton_window_attention(on):
            row["triton" if on else "sdpa"] = us_per_call(step, repeats, warmup=3)
    rows.append(row)
    block, x = _make(stages[0], True, batch, device)
    step = _block_step(block, x, torch.bfloat16)
    before = twa._BACKWARD_PROGRAMS, twa._BACKWARD_WARPS
    try:
        with twa.triton_window_attention(True):
            for programs, warps in sweep:
                twa._BACKWARD_PROGRAMS, twa._BACKWARD_WARPS = programs, warps
                rows.append(dict(stage=1, shifted=True, programs=programs, warps=warps, triton=us_per_call(step, repeats, warmup=3)))
    finally:
        twa._BACKWARD_PROGRAMS, twa._BACKWARD_WARPS = before
    return rows


def main(argv: list[str] | None = None) -> int:
    device = check_device(argv, __doc__)
    if device is None:
        return 0
    print(json.dumps(dict(check=check(device))), flush=True)
    if device == "cuda":
        print(json.dumps(dict(us=timings(device))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
