"""Every parameter's gradient has its parameter's strides after a training step.

DDP copies each gradient into a bucket laid out as the parameter, and warns ("Grad strides do not
match bucket view strides ... may impair performance") where the two differ. A one-head Swin stage
(the CPU demo's first) gave its bias table a transposed ``(rows, 1)`` gradient."""

from __future__ import annotations

import pytest
import torch

from vtdense import create_backbone
from vtdense.models.compile import compile_backbone
from vtdense.models.detection import build_detector

ONE_HEAD_FIRST = {
    "swin_tiny": dict(embed_dim=16, depths=(2, 2, 1, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(2, 2, 1, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=1),
}


def _mismatched(model: torch.nn.Module) -> list[tuple[str, tuple, tuple]]:
    grads = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    assert grads
    return [(n, p.stride(), p.grad.stride()) for n, p in grads if p.grad.stride() != p.stride()]


@pytest.mark.parametrize("name", sorted(ONE_HEAD_FIRST))
def test_backbone_gradients_have_their_parameters_strides(name: str) -> None:
    torch.manual_seed(0)
    model = create_backbone(name, **ONE_HEAD_FIRST[name]).train()
    out = model(torch.randn(2, 3, 64, 96))
    sum(f.square().mean() for f in out.values()).backward()
    assert _mismatched(model) == []


def test_detector_gradients_have_their_parameters_strides() -> None:
    torch.manual_seed(0)
    model = build_detector("swin_tiny", "mask_rcnn", 3, fpn_channels=32, slim_heads=True,
                           backbone_kwargs=ONE_HEAD_FIRST["swin_tiny"]).train()
    images = [torch.rand(3, 72, 100), torch.rand(3, 90, 61)]
    masks = torch.zeros(1, 72, 100, dtype=torch.uint8)
    masks[0, 10:60, 8:50] = 1
    targets = [{"boxes": torch.tensor([[8.0, 10.0, 50.0, 60.0]]), "labels": torch.tensor([1]), "masks": masks},
               {"boxes": torch.tensor([[4.0, 20.0, 40.0, 85.0]]), "labels": torch.tensor([2]),
                "masks": torch.ones(1, 90, 61, dtype=torch.uint8)}]
    sum(model(images, targets).values()).backward()
    assert _mismatched(model) == []


def test_compiled_mvitv2_pooling_gradients_have_their_weights_strides() -> None:
    """In a compiled graph (``compile_backbone``, AOT autograd's trace, which Inductor also gets) a one-head
    MViTv2 stage pools with the opaque depthwise-conv op, whose backward gives the weight gradient the
    weight's strides itself; before, DDP warned about ``pool_q/k/v.weight`` in compiled training."""
    torch.manual_seed(0)
    model = create_backbone("mvitv2_tiny", **ONE_HEAD_FIRST["mvitv2_tiny"], drop_path_rate=0.0).train()
    compile_backbone(model, "aot_eager")
    out = model(torch.randn(2, 3, 64, 96))
    sum(f.square().mean() for f in out.values()).backward()
    assert any(n.endswith("pool_q.weight") for n, p in model.named_parameters() if p.grad is not None)
    assert _mismatched(model) == []
