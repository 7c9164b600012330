"""Every parameter's gradient has its parameter's strides after a training step.

DDP copies each gradient into a bucket laid out as the parameter, and warns ("Grad strides do not
match bucket view strides ... may impair performance") where the two differ. A one-head Swin stage
(the CPU demo's first) gave its bias table a transposed ``(rows, 1)`` gradient."""

from __future__ import annotations

import pytest
import torch

from vtdense import create_backbone
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


def test_the_compiled_pooling_op_gives_the_weight_gradient_the_weights_strides() -> None:
    """In compiled graphs (``compile_backbone``) a one-head MViTv2 stage pools with the opaque
    depthwise-conv op (its pool weights straight, no ``param_layout``), whose backward gives the
    ``(C, 1, kh, kw)`` weight gradient the weight's strides itself, in eager calls and under AOT
    autograd (the graph Inductor also gets); before, DDP warned about ``pool_q/k/v.weight`` in compiled
    training. The backward's values are checked in ``tests/test_compile_batch.py``."""
    from vtdense.layers.depthwise_conv import depthwise_conv_nhwc

    torch.manual_seed(0)
    weight = torch.randn(16, 1, 3, 3, requires_grad=True)
    y = torch.randn(2, 12, 10, 16)

    def pool(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return depthwise_conv_nhwc(y, w, (2, 2), (1, 1))

    torch._dynamo.reset()
    for fn in (pool, torch.compile(pool, backend="aot_eager", fullgraph=True)):
        weight.grad = None
        fn(y, weight).square().sum().backward()
        assert weight.grad.stride() == weight.stride() == (9, 9, 3, 1), fn
