"""Forward hooks and replaced layers are honoured by every fast path, as timm honours them.

The fused training paths (LayerNorm + projection, GELU + ``fc2``), the chunked CPU paths
(inference, and training with large activations) and MViTv2's all-heads pooling conv read layer
parameters or call a block's layers once per chunk. A hook on a block's layer (feature
extraction, activation statistics) must still fire once per block call with the whole tensor,
and a replaced layer (a tanh GELU, a LayerNorm subclass) must still be the one computing. Each
case is checked against timm with the same weights and the same hook or replacement, with every
chunked path forced on.
"""

from __future__ import annotations

import collections

import pytest
import timm
import torch
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg
from torch import nn

import vtdense
from vtdense.layers import chunked
from vtdense.layers import chunked_mlp as cm
from vtdense.layers.plain import hooks_below, plain_gelu, plain_layer_norm, plain_linear

from test_swin import randomize_

SIZE = (128, 128)  # window multiples at every stage (timm pads differently); square for timm's MViTv2
SWIN = dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4), window_size=4)
MVIT = dict(embed_dim=16, depths=(1, 2, 1, 1), num_heads=1)


@pytest.fixture(autouse=True)
def _every_chunked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(chunked, "MIN_ROWS", 8)
    monkeypatch.setattr(chunked, "TRAIN_CHUNK_MIN_BYTES", 0)
    monkeypatch.setattr(cm, "TRAIN_CHUNK_BYTES", 4096)


def _pair(name: str) -> tuple[nn.Module, nn.Module, list[nn.Module], list[nn.Module]]:
    """timm and vtdense with the same random weights, and their blocks in the same order."""
    if name == "mvitv2_tiny":
        ref = MultiScaleVit(MultiScaleVitCfg(**MVIT), img_size=SIZE, num_classes=0)
        ours = vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0, img_size=SIZE[0], **MVIT)
    else:
        timm_name = "swin_tiny_patch4_window7_224" if name == "swin_tiny" else "swinv2_tiny_window8_256"
        ref = timm.create_model(timm_name, pretrained=False, num_classes=0, img_size=SIZE, drop_path_rate=0.0, **SWIN)
        ours = vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0, **SWIN)
    ref = randomize_(ref, seed=1)
    missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
    assert missing == [] and unexpected == []
    ref_stages = ref.stages if name == "mvitv2_tiny" else ref.layers
    ref_blocks = [b for s in ref_stages for b in s.blocks]
    our_blocks = [b for s in ours.layers for b in s.blocks] if hasattr(ours, "layers") else [b for s in ours.stages for b in s.blocks]
    assert len(ref_blocks) == len(our_blocks) == 5
    return ref, ours, ref_blocks, our_blocks


def _features(model: nn.Module, is_ref: bool, x: torch.Tensor, train: bool) -> list[torch.Tensor]:
    model.train(train)
    with torch.set_grad_enabled(train):
        if is_ref:
            return [f.detach() for f in model.forward_intermediates(x, intermediates_only=True)]
        return [f.detach() for f in model(x).values()]


# V2's qkv is left out: timm's V2 applies F.linear with qkv's weight and never calls the module.
SUBMODULES = {
    "swin_tiny": ["norm1", "norm2", "attn", "attn.qkv", "attn.proj", "mlp", "mlp.act", "mlp.fc1", "mlp.fc2"],
    "swinv2_tiny": ["norm1", "norm2", "attn", "attn.proj", "mlp", "mlp.act", "mlp.fc1", "mlp.fc2"],
    "mvitv2_tiny": ["norm1", "norm2", "attn", "attn.pool_q", "attn.pool_k", "attn.norm_q", "attn.proj", "mlp",
                    "mlp.act", "mlp.fc1", "mlp.fc2"],
}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny", "mvitv2_tiny"])
def test_hooks_fire_once_per_block_call_and_take_effect_as_in_timm(name: str, train: bool) -> None:
    ref, ours, ref_blocks, our_blocks = _pair(name)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(2))
    plain = _features(ours, False, x, train)
    for sub in SUBMODULES[name]:
        results = []
        for model, blocks, is_ref in ((ref, ref_blocks, True), (ours, our_blocks, False)):
            calls: collections.Counter = collections.Counter()

            def hook(module: nn.Module, inputs: tuple, out: object) -> object:
                calls[module] += 1
                # the hook's change must reach the output: elementwise and not affine (a norm after it
                # would undo a scale); timm's MViTv2 attention returns (x, size)
                change = lambda t: t + 0.5 * t.square()  # noqa: E731
                return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)

            handles = [b.get_submodule(sub).register_forward_hook(hook) for b in blocks]
            try:
                feats = _features(model, is_ref, x, train)
            finally:
                for h in handles:
                    h.remove()
            results.append((feats, sorted(calls.values())))
        (expected, ref_calls), (got, our_calls) = results
        assert our_calls == ref_calls == [1] * 5, sub
        assert max((g - e).abs().max().item() for g, e in zip(got, expected)) < 1e-4, sub
        assert max((g - p).abs().max().item() for g, p in zip(got, plain)) > 1e-3, sub  # the hook did change it


class _ShiftedLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass that computes something else (as a float32 LayerNorm under autocast
    computes in another dtype): a fused path must call it, not read its parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5 + 0.25


def _replace(blocks: list[nn.Module], what: str) -> None:
    for b in blocks:
        if what == "tanh gelu":
            b.mlp.act = nn.GELU(approximate="tanh")
        else:
            for key in ("norm1", "norm2"):
                old = getattr(b, key)
                new = _ShiftedLayerNorm(old.normalized_shape, eps=old.eps)
                new.load_state_dict(old.state_dict())
                setattr(b, key, new)


@pytest.mark.parametrize("what", ["tanh gelu", "layer norm subclass"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["swin_tiny", "mvitv2_tiny"])
def test_replaced_layers_compute_as_in_timm(name: str, train: bool, what: str) -> None:
    ref, ours, ref_blocks, our_blocks = _pair(name)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(2))
    plain = _features(ours, False, x, train)
    _replace(ref_blocks, what)
    _replace(our_blocks, what)
    expected = _features(ref, True, x, train)
    got = _features(ours, False, x, train)
    assert max((g - e).abs().max().item() for g, e in zip(got, expected)) < 2e-5
    assert max((g - p).abs().max().item() for g, p in zip(got, plain)) > 2e-4  # tanh's GELU differs by ~1e-3


def test_plain_predicates() -> None:
    lin, ln, gelu = nn.Linear(4, 4), nn.LayerNorm(4), nn.GELU()
    assert plain_linear(lin) and plain_layer_norm(ln) and plain_gelu(gelu)
    assert not plain_layer_norm(nn.LayerNorm((2, 4)))  # over two dimensions
    assert not plain_layer_norm(_ShiftedLayerNorm(4))
    assert not plain_gelu(nn.GELU(approximate="tanh"))
    block = nn.Sequential(lin, nn.Sequential(ln))
    assert not hooks_below(block)
    handle = block.register_forward_hook(lambda *a: None)
    assert not hooks_below(block)  # the block's own hook sees one call either way
    handle.remove()
    handle = ln.register_forward_pre_hook(lambda *a: None)
    assert hooks_below(block) and not plain_layer_norm(ln)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert hooks_below(block)
    finally:
        handle.remove()
    assert not hooks_below(block)
