"""Second derivatives (``create_graph=True``): gradient penalties, Hessian-vector products.

vtdense's training paths replace some autograd graphs with functions of their own (the pre-norm
fused with the next projection, the GELU fused with ``fc2``). Their backward passes must stay
differentiable, or a gradient penalty silently gets wrong weight gradients. Checked against timm
with the same weights, in float64, on the penalty ``|d(sum(r * features)) / dx|^2``.
"""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

import vtdense
from vtdense.layers import cpu_window_attention
from vtdense.layers.mlp import _NormLinear

from test_swin import randomize_


def _penalty_grads(model: torch.nn.Module, feats, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = feats(model, x)
    g = torch.Generator().manual_seed(3)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in out)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    penalty = gx.pow(2).sum()
    model.zero_grad(set_to_none=True)
    penalty.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, gx.detach()


def _timm_swin(name: str, size: tuple[int, int], cfg: dict) -> torch.nn.Module:
    return timm.create_model(name, pretrained=False, num_classes=0, img_size=size, drop_path_rate=0.0, **cfg)


CASES = {
    "swin_tiny": ("swin_tiny_patch4_window7_224", dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4), window_size=4)),
    "swinv2_tiny": ("swinv2_tiny_window8_256", dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4), window_size=4)),
}


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny", "mvitv2_tiny", "swin_tiny-own", "swinv2_tiny-own"])
def test_gradient_penalty_weight_gradients_match_timm(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``-own``: Swin's attention through the CPU training path's own autograd functions at this size
    (``cpu_window_attention.MIN_BYTES = 0``), whose backward recomputes the attention under ``create_graph``."""
    own = name.endswith("-own")
    recomputed: list[int] = []
    if own:
        monkeypatch.setattr(cpu_window_attention, "MIN_BYTES", 0)
        math = cpu_window_attention._math
        monkeypatch.setattr(cpu_window_attention, "_math", lambda *a: recomputed.append(1) or math(*a))
        name = name[:-4]
    size = (128, 128)  # window multiples at every stage (timm pads differently, see windows.py), square for MViTv2
    if name == "mvitv2_tiny":
        cfg = dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=1)
        ref = MultiScaleVit(MultiScaleVitCfg(**cfg), img_size=size, num_classes=0)
        # the default fold runs SDPA's flash kernel, which has no double backward (nor has SDPA's
        # GPU kernels): a gradient penalty takes the bias path, whose CPU math kernel has one
        ours = vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0, rel_pos_fold=False, img_size=size[0],
                                       **cfg)
    else:
        timm_name, cfg = CASES[name]
        ref = _timm_swin(timm_name, size, cfg)
        ours = vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0, **cfg)
    ref = randomize_(ref, seed=1).double().train()
    missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
    assert missing == [] and unexpected == []
    ours = ours.double().train()
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    expected, gx_ref = _penalty_grads(ref, lambda m, t: m.forward_intermediates(t, intermediates_only=True), x)
    got, gx = _penalty_grads(ours, lambda m, t: list(m(t).values()), x)
    assert (gx - gx_ref).abs().max().item() < 1e-10
    assert len(got) > 0
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 0
    for key, g in got.items():
        e = expected[key] if key in expected else torch.zeros_like(g)
        assert (g - e).abs().max().item() < 1e-8 * scale, key
    assert len(recomputed) == (5 if own else 0)  # one recomputation per block: the own functions' backward ran


def test_norm_linear_is_twice_differentiable() -> None:
    """The fused ``linear(layer_norm(x))`` recomputes the norm in its backward; under
    ``create_graph`` that recomputation must stay on the graph (gradgradcheck, float64)."""
    g = torch.Generator().manual_seed(0)

    def mk(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    fn = lambda x, nw, nb, w, b: _NormLinear.apply(x, nw, nb, 1e-5, w, b)  # noqa: E731
    for args in [(mk(3, 6), mk(6), mk(6), mk(5, 6), mk(5)), (mk(3, 6), mk(6, grad=False), mk(6), mk(5, 6), mk(5)),
                 (mk(3, 6, grad=False), mk(6), mk(6), mk(5, 6), mk(5))]:
        assert torch.autograd.gradgradcheck(fn, args)
