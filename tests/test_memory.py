"""Training memory: the fused MLP/norm paths keep fewer activations and change no result.

``Mlp`` recomputes its GELU and, in pre-norm blocks, the LayerNorm before ``fc1``/``qkv`` in the
backward pass instead of storing their outputs. The gradients must be exactly those of plain
autograd, and a whole backbone must match timm's gradients on the same weights. The memory is
counted deterministically: the bytes of the distinct tensors autograd saves for the backward
pass (no timing, no process RSS).
"""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

import vtdense
from tests.test_swin import randomize_
from vtdense.layers.mlp import Mlp


def _grads(mlp: Mlp, norm: torch.nn.LayerNorm, x: torch.Tensor, fused: bool, dtype: torch.dtype | None) -> list[torch.Tensor]:
    params = [*mlp.parameters(), *norm.parameters()]
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_(True)
    amp = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with amp:
        y = mlp(x, norm=norm) if fused else mlp.fc2(F.gelu(mlp.fc1(norm(x))))
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_fused_mlp_gradients_equal_plain_autograd(dtype: torch.dtype | None) -> None:
    torch.manual_seed(0)
    mlp, norm = Mlp(24, 96), torch.nn.LayerNorm(24)
    randomize_(norm, std=0.5)
    x = torch.randn(2, 7, 24)
    fused, plain = _grads(mlp, norm, x, True, dtype), _grads(mlp, norm, x, False, dtype)
    for a, b in zip(fused, plain):
        # bitwise on torch 2.14; to float rounding on 2.11, where the fused path's linear layers run through
        # oneDNN (vtdense.layers.cpu_linear) and plain autograd's through MKL, which round differently there
        # (with VTDENSE_CPU_MATMUL=blas they are bitwise equal on 2.11 too)
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused[0].dtype == (dtype or torch.float32) and fused[1].dtype == torch.float32


def test_fused_mlp_casts_each_weight_once_under_autocast() -> None:
    """Under bf16 autocast the fused paths keep the forward's cast of ``fc1`` / ``fc2`` for the
    backward, as plain autograd keeps autocast's: the backward casts no weight again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightCasts(TorchDispatchMode):
        def __init__(self, weights: set[int]) -> None:
            super().__init__()
            self.weights, self.n = weights, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.weights:
                self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    mlp, norm = Mlp(24, 96), torch.nn.LayerNorm(24)
    weights = {mlp.fc1.weight.untyped_storage().data_ptr(), mlp.fc2.weight.untyped_storage().data_ptr()}
    counts = []
    for fused in (True, False):
        x = torch.randn(2, 7, 24, requires_grad=True)
        forward, backward = WeightCasts(weights), WeightCasts(weights)
        with forward, torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x, norm=norm) if fused else mlp.fc2(F.gelu(mlp.fc1(norm(x))))
        with backward:
            y.float().sum().backward()
        counts.append((forward.n, backward.n))
    assert counts == [(2, 0), (2, 0)], counts  # fused, plain


def _saved_mib(model: torch.nn.Module, x: torch.Tensor) -> float:
    """MiB of the distinct activation storages autograd keeps for the backward pass of
    ``model(x)`` (the parameters it also references are not counted: they exist anyway)."""
    sizes: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(sizes.values()) / 2**20


def test_swin_training_keeps_less_than_timm_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    ref = randomize_(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, features_only=True,
                                       drop_path_rate=0.0)).train()
    ours = vtdense.create_backbone("swin_tiny", out_norm=False, drop_path_rate=0.0).train()
    vtdense.load_pretrained(ours, ref.state_dict())
    x = torch.randn(1, 3, 224, 224)
    ours_mib, ref_mib = _saved_mib(ours, x), _saved_mib(ref, x)
    assert ours_mib < 0.8 * ref_mib, (ours_mib, ref_mib)

    def grads(model: torch.nn.Module, channels_last: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        feats = model(x)
        feats = list(feats.values()) if isinstance(feats, dict) else [f.permute(0, 3, 1, 2) for f in feats]
        sum((f * torch.linspace(-1, 1, f.numel()).view_as(f)).sum() for f in feats).backward()
        return {n.replace("layers_", "layers."): p.grad for n, p in model.named_parameters()}

    g_ours, g_ref = grads(ours, False), grads(ref, True)
    assert set(g_ours) == set(g_ref)
    for name, g in g_ref.items():
        scale = g.abs().max().item() + 1e-12
        assert (g_ours[name] - g).abs().max().item() <= 1e-4 * scale + 1e-6, name


def test_patch_merging_keeps_only_its_gathered_input_for_the_backward() -> None:
    """Swin V1's patch merging (norm, then reduction) runs as ``norm_linear``: training keeps the
    gathered 4C input alone, not the normalised copy too, with plain autograd's gradients."""
    from vtdense.backbones.swin import PatchMerging

    torch.manual_seed(0)
    merge = PatchMerging(8, 16)
    randomize_(merge.norm, std=0.5)
    x = torch.randn(2, 6, 10, 8)
    saved_mib = _saved_mib(merge, x.requires_grad_(True))
    gathered_mib = x.numel() * 4 / 2**20  # the 2x2 neighbours concatenated: as many elements as x
    assert abs(saved_mib - gathered_mib) < 1e-9, (saved_mib, gathered_mib)

    def grads(fused: bool) -> list[torch.Tensor]:
        merge.zero_grad()
        xi = x.detach().requires_grad_(True)
        if fused:
            y = merge(xi)
        else:
            g = xi.reshape(2, 3, 2, 5, 2, 8).permute(0, 1, 3, 4, 2, 5).flatten(3)
            y = merge.reduction(merge.norm(g))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return [y.detach(), xi.grad, merge.norm.weight.grad, merge.norm.bias.grad, merge.reduction.weight.grad]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
