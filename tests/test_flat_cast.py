"""One cast per block of the linear weights in training under autocast (vtdense.layers.flat_cast):
the same outputs and gradients bit for bit, and the casts it saves counted."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vtdense
from vtdense.layers import mlp
from vtdense.layers.cpu_linear import apply_linear
from vtdense.layers.flat_cast import _castable, cast_once, flat_cast_of, set_flat_casts

TINY = {
    "swin_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1),
}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=["hooks", "function"])
def hooks_form(request: pytest.FixtureRequest):
    """Training's recomputation through saved-tensor hooks (the GPU's form) or the autograd functions
    (the form under others' saved-tensor hooks); flat casts as by default after."""
    mlp._set_recompute_form(request.param)
    yield
    mlp._set_recompute_form("auto")
    set_flat_casts("auto")


def _train_step(model: nn.Module, x: torch.Tensor, flat: bool | str, steps: int = 1):
    set_flat_casts(flat)
    ops = _Ops()
    for _ in range(steps):
        with ops, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = sum(o.float().square().mean() for o in out.values())
        with ops:
            loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}, ops.calls


@pytest.mark.parametrize("name", list(TINY))
def test_flat_casts_give_autocasts_values_with_fewer_casts(name: str, hooks_form: None) -> None:
    torch.manual_seed(0)
    model = vtdense.create_backbone(name, **TINY[name]).train()
    x = torch.randn(2, 3, 64, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)  # the size tables cached, for both runs alike
    ref, flat = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1)
    out0, grads0, calls0 = _train_step(ref, x, False)
    torch.manual_seed(1)
    out1, grads1, calls1 = _train_step(flat, x, True)
    assert out0.keys() == out1.keys() and all(torch.equal(out0[k], out1[k]) for k in out0)
    assert all(grads0[n] is None and grads1[n] is None or torch.equal(grads0[n], grads1[n]) for n in grads0)
    # Each block's k linear parameters: k casts forward and k backward become one and one (Swin V2's
    # Log-CPB MLP, called as a module, is still cast by autocast: its views go unused). MViTv2 saves
    # more: it slices its q/k/v weight, and autocast casts each slice (a non-leaf) on its own.
    blocks = [b for m in flat.modules() for b in getattr(m, "blocks", [])]
    saved = 0
    for b in blocks:
        ids = {id(p) for p in _castable(b)}
        saved += 2 * (sum(1 for n, p in b.named_parameters() if id(p) in ids and "cpb_mlp" not in n) - 1)
    fewer = calls0["_to_copy"] - calls1["_to_copy"]
    assert saved > 0 and (fewer >= saved if name == "mvitv2_tiny" else fewer == saved), (fewer, saved)
    assert calls1["cat"] - calls0["cat"] == 2 * len(blocks)


def test_auto_leaves_the_cpu_alone(hooks_form: None) -> None:
    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", **TINY["swin_tiny"]).train()
    x = torch.randn(1, 3, 64, 64)
    _train_step(model, x, False)  # the size tables cached
    _, _, calls_auto = _train_step(copy.deepcopy(model), x, "auto")
    _, _, calls_off = _train_step(copy.deepcopy(model), x, False)
    assert calls_auto == calls_off


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused, self.frozen = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(4, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.frozen, apply_linear(self.used, x))


def test_unused_and_frozen_parameters_and_accumulation() -> None:
    """An unused layer's parameters get no gradient (None, as without the flat cast), frozen ones are
    left out, two backward passes accumulate, and an optimizer steps on the gradients' views."""
    torch.manual_seed(0)
    ref = _TwoLinears()
    flat = copy.deepcopy(ref)
    x = torch.randn(5, 6)
    set_flat_casts(True)
    try:
        assert [id(p) for p in _castable(flat)] == [id(flat.used.weight), id(flat.used.bias),
                                                    id(flat.unused.weight), id(flat.unused.bias)]
        for model, scoped in ((ref, False), (flat, True)):
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            for _ in range(2):  # accumulated
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    if scoped:
                        with cast_once(model):
                            assert flat_cast_of(model.used.weight).dtype == torch.bfloat16
                            assert flat_cast_of(model.frozen.weight) is None
                            y = model(x)
                        assert flat_cast_of(model.used.weight) is None  # only within the block
                    else:
                        y = model(x)
                y.float().square().sum().backward()
            opt.step()
        assert flat.unused.weight.grad is None and flat.unused.bias.grad is None and flat.frozen.weight.grad is None
        assert torch.equal(ref.used.weight.grad, flat.used.weight.grad)
        assert torch.equal(ref.used.bias.grad, flat.used.bias.grad)
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), flat.parameters()))
    finally:
        set_flat_casts("auto")


def test_stands_aside_without_gradients_autocast_or_float32() -> None:
    model = _TwoLinears()
    set_flat_casts(True)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), cast_once(model):
            assert flat_cast_of(model.used.weight) is None  # inference: autocast_params' kept copies instead
        with cast_once(model):
            assert flat_cast_of(model.used.weight) is None  # no autocast
        with torch.autocast("cpu", dtype=torch.bfloat16), cast_once(model), cast_once(model.used):
            assert flat_cast_of(model.used.weight) is not None  # nested: the outer scope's views serve
    finally:
        set_flat_casts("auto")
    with pytest.raises(ValueError, match="set_flat_casts"):
        set_flat_casts("yes")
