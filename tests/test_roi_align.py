"""The detectors' RoIAlign: torchvision's forward, and a CPU backward written as one sparse product
that gives torchvision's input gradient (to float rounding) for regions inside, across and outside
the map, tiny and large, in both alignment modes; and the multi-level pool gives torchvision's
pooled features and gradients."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torchvision
from torchvision.ops import MultiScaleRoIAlign

from vtdense.models.roi_align import MultiScaleRoIAlignFastCPU, fast_backward_applies, roi_align


def _rois(g: torch.Generator, n: int, batch: int, height: int, width: int, scale: float) -> torch.Tensor:
    """Regions in image coordinates: mostly inside, some across or past the border, some tiny."""
    size = torch.tensor([width, height]) / scale
    xy = (torch.rand(n, 2, generator=g) * 1.4 - 0.2) * size
    wh = torch.rand(n, 2, generator=g) * size * 0.6
    wh[: n // 4] *= 0.02  # tiny regions (smaller than one pixel of the map)
    return torch.cat((torch.randint(0, batch, (n, 1), generator=g).float(), xy, xy + wh), 1)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("pooled, ratio", [((7, 7), 2), ((14, 14), 2), ((3, 5), 3)])
def test_gradient_equals_torchvision(aligned: bool, pooled: tuple[int, int], ratio: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 13, 19, generator=g, dtype=torch.float64, requires_grad=True)
    rois = _rois(g, 40, 3, 13, 19, 0.25).double()
    grad = torch.randn(40, 8, *pooled, generator=g, dtype=torch.float64)
    assert fast_backward_applies(x, ratio)
    out = roi_align(x, rois, pooled, 0.25, ratio, aligned)
    (got,) = torch.autograd.grad(out, x, grad)
    want_out = torchvision.ops.roi_align(x, rois, pooled, 0.25, ratio, aligned)
    (want,) = torch.autograd.grad(want_out, x, grad)
    assert torch.equal(out, want_out)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_float32_and_edge_cases() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6, 9, generator=g, requires_grad=True)
    rois = _rois(g, 30, 2, 6, 9, 0.5)
    grad = torch.randn(30, 4, 7, 7, generator=g)
    (got,) = torch.autograd.grad(roi_align(x, rois, (7, 7), 0.5, 2), x, grad)
    (want,) = torch.autograd.grad(torchvision.ops.roi_align(x, rois, (7, 7), 0.5, 2), x, grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # no regions: a zero gradient; an adaptive ratio and no-grad calls go to torchvision
    empty = roi_align(x, rois[:0], (7, 7), 0.5, 2)
    (zero,) = torch.autograd.grad(empty.sum(), x)
    assert empty.shape == (0, 4, 7, 7) and not zero.any()
    assert not fast_backward_applies(x, -1) and not fast_backward_applies(x.detach(), 2)


def test_multiscale_pool_matches_torchvision() -> None:
    """The box pool of a detector: four FPN levels, regions of several images mapped to levels."""
    g = torch.Generator().manual_seed(2)
    names = ["0", "1", "2", "3"]
    feats = OrderedDict((n, torch.randn(2, 6, 64 >> i, 96 >> i, generator=g, requires_grad=True)) for i, n in enumerate(names))
    shapes = [(256, 384), (240, 380)]
    boxes = []
    for _ in shapes:
        xy = torch.rand(25, 2, generator=g) * 300
        boxes.append(torch.cat((xy, xy + 4 + torch.rand(25, 2, generator=g) * 200), 1))
    ours = MultiScaleRoIAlignFastCPU(names, 7, 2)
    ref = MultiScaleRoIAlign(names, 7, 2)
    out, want = ours(feats, boxes, shapes), ref(feats, boxes, shapes)
    assert torch.equal(out, want)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, list(feats.values()), grad)
    exp = torch.autograd.grad(want, list(feats.values()), grad)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    with torch.no_grad():  # inference: torchvision's module itself
        assert torch.equal(ours(feats, boxes, shapes), ref(feats, boxes, shapes))
