"""Fused training paths must not bypass a wrapped projection.

vtdense's fused paths (norm + linear, GELU + linear, the chunked MLP, Swin's chunked window
attention, MViTv2's sliced q/k/v projection) read a Linear's ``weight`` and ``bias`` instead of
calling it. A LoRA adapter (peft's ``lora.Linear`` exposes its base layer's ``weight`` the same
way), a quantised layer or a hooked layer computes something else: vtdense must call it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vtdense
from tests.test_swin import randomize_
from vtdense.layers import chunked, chunked_mlp as cm
from vtdense.layers.mlp import plain_linear
from probe import probe_loss


class LoraLike(nn.Module):
    """``base(x) + up(down(x))``, exposing ``base``'s ``weight`` and ``bias`` as peft does."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.5)
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))

    def merged(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.base.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(self.base.weight + self.up.weight @ self.down.weight)
            if self.base.bias is not None:
                lin.bias.copy_(self.base.bias)
        return lin


def _backbone(name: str) -> nn.Module:
    if name == "mvitv2":
        return vtdense.create_backbone("mvitv2_tiny", embed_dim=16, depths=(1, 2, 1, 1), drop_path_rate=0.0)
    return vtdense.create_backbone(f"{name}_tiny", embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                                   window_size=4, drop_path_rate=0.0)


def _wrap(model: nn.Module) -> int:
    """Wrap every qkv / fc1 / fc2 Linear of ``model`` in :class:`LoraLike`; returns how many."""
    n = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in ("qkv", "fc1", "fc2") and type(child) is nn.Linear:
                setattr(parent, child_name, LoraLike(child))
                n += 1
    return n


def _grad_fn_names(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_plain_linear() -> None:
    lin = nn.Linear(4, 4)
    assert plain_linear(lin)
    handle = lin.register_forward_pre_hook(lambda m, i: None)
    assert not plain_linear(lin)
    handle.remove()
    assert plain_linear(lin) and not plain_linear(LoraLike(lin)) and not plain_linear(nn.Identity())


@pytest.mark.parametrize("name", ["swin", "swinv2", "mvitv2"])
def test_training_step_calls_wrapped_projections(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a training step with every fused and chunked path on, a backbone whose qkv / fc1 / fc2
    are LoRA-like wrappers gives the outputs of the same backbone with the adapters merged into
    plain Linears, and the adapters get gradients."""
    monkeypatch.setattr(chunked, "TRAIN_CHUNK_MIN_BYTES", 0)
    monkeypatch.setattr(cm, "TRAIN_CHUNK_BYTES", 64 * 4 * 4 * 16)
    torch.manual_seed(0)
    wrapped = randomize_(_backbone(name)).train()
    assert _wrap(wrapped) >= 8
    merged = copy.deepcopy(wrapped)
    for m in list(merged.modules()):
        for child in ("qkv", "fc1", "fc2"):
            if isinstance(getattr(m, child, None), LoraLike):
                setattr(m, child, getattr(m, child).merged())
    x = torch.randn(2, 3, 64, 96)
    want = list(merged(x).values())
    # the merged model runs the fused paths that could have bypassed the wrappers
    assert "_ChunkedMlpBackward" in set().union(*(_grad_fn_names(f) for f in want))
    got = list(wrapped(x).values())
    for a, b in zip(got, want):
        err, tol = (a - b).abs().max().item(), 1e-4 * max(1.0, b.abs().max().item())
        assert err < tol, f"wrapped projections bypassed: max difference {err:.3g} to the merged model"
    probe_loss(got).backward()
    ups = [m.up.weight.grad for m in wrapped.modules() if isinstance(m, LoraLike)]
    assert all(g is not None and g.abs().sum() > 0 for g in ups)
