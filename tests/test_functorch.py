"""``torch.func`` transforms (``grad``, ``vmap``, per-sample gradients, ``jvp``) and forward-mode AD work on
every backbone, as on timm's.

The fused training paths are custom autograd functions without functorch support, the chunked
CPU paths write into chunks in place, and the patch embedding asks for a channels-last layout:
under a transform each of them must step aside for the plain computation. Every check runs with
the chunked paths forced on and compares with timm on the same weights, or with plain autograd.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

from test_plain_modules import SIZE, _every_chunked_path, _features, _pair  # noqa: F401 (fixture)

NAMES = ["swin_tiny", "swinv2_tiny", "mvitv2_tiny"]


def _ref_features(ref: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return list(ref.forward_intermediates(x, intermediates_only=True))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding, relative to the tensor's largest entry."""
    return (a - b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-8  # + rounding of zero gradients


def _loss(feats: list[torch.Tensor]) -> torch.Tensor:
    return sum((f * f).mean() for f in feats)


@pytest.mark.parametrize("name", NAMES)
def test_func_grad_matches_timm_and_autograd(name: str) -> None:
    ref, ours, _, _ = _pair(name)
    ref.train()
    ours.train()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(3))
    # gradient with respect to the input (saliency), against timm's under the same transform
    g_ours = grad(lambda t: _loss(list(ours(t).values())))(x)
    g_ref = grad(lambda t: _loss(_ref_features(ref, t)))(x)
    assert (g_ours - g_ref).abs().max().item() < 1e-5 * g_ref.abs().max().item()
    # gradient with respect to the weights, against plain autograd (the fused paths)
    params = {k: v.detach() for k, v in ours.named_parameters()}
    g_params = grad(lambda p: _loss(list(functional_call(ours, p, (x,)).values())))(params)
    ours.zero_grad()
    _loss(list(ours(x).values())).backward()
    for k, p in ours.named_parameters():
        assert _close(g_params[k], p.grad), k


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_images_matches_the_batch_and_timm(name: str) -> None:
    ref, ours, _, _ = _pair(name)
    ref.eval()
    ours.eval()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(4))
    batched = _features(ours, False, x, train=False)
    expected = _features(ref, True, x, train=False)
    mapped = vmap(lambda t: [f[0] for f in ours(t[None]).values()])(x)
    for m, b, e in zip(mapped, batched, expected):
        assert (m - b).abs().max().item() < 1e-5
        assert (m - e).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_per_sample_gradients(name: str) -> None:
    """``vmap(grad(...))``, the per-sample gradient recipe of the torch.func docs, equals one backward
    pass per image."""
    _, ours, _, _ = _pair(name)
    ours.train()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(5))
    params = {k: v.detach() for k, v in ours.named_parameters()}

    def one(p: dict, t: torch.Tensor) -> torch.Tensor:
        return _loss(list(functional_call(ours, p, (t[None],)).values()))

    per_sample = vmap(grad(one), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        ours.zero_grad()
        _loss(list(ours(x[i : i + 1]).values())).backward()
        for k, p in ours.named_parameters():
            assert _close(per_sample[k][i], p.grad), (i, k)


@pytest.mark.parametrize("name", NAMES)
def test_forward_mode_ad_matches_finite_differences(name: str) -> None:
    """``torch.func.jvp`` and ``torch.autograd.forward_ad`` give the directional derivative that central
    differences give, in float64, in training mode (the fused paths' mode)."""
    import torch.autograd.forward_ad as fwAD

    _, ours, _, _ = _pair(name)
    ours = ours.double().train()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 3, *SIZE, generator=g, dtype=torch.float64)
    t = torch.randn(x.shape, generator=g, dtype=torch.float64)

    def f(a: torch.Tensor) -> list[torch.Tensor]:
        return list(ours(a).values())

    _, tangents = torch.func.jvp(f, (x,), (t,))
    eps = 1e-6
    with torch.no_grad():
        fd = [(p - m) / (2 * eps) for p, m in zip(f(x + eps * t), f(x - eps * t))]
    with fwAD.dual_level():
        dual = [fwAD.unpack_dual(o).tangent for o in f(fwAD.make_dual(x, t))]
    for tan, ref, other in zip(tangents, fd, dual):
        assert (tan - ref).abs().max().item() < 1e-6 * ref.abs().max().item()
        assert (other - tan).abs().max().item() < 1e-10 * tan.abs().max().item()
