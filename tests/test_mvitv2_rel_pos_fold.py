"""MViTv2 with its decomposed relative positions folded into q and k (``rel_pos_fold=True``):
the same logits as the additive bias, the same outputs as timm, the same gradients as the bias
path, and no (Nq, Nk)-sized tensor kept for the backward pass."""

from __future__ import annotations

import pytest
import timm
import torch

import vtdense
from tests.test_mvitv2 import randomize_, timm_features
from vtdense.layers.position import decomposed_rel_pos_bias, decomposed_rel_pos_fold
from vtdense.layers.windows import MASK_VALUE

SMALL = dict(embed_dim=16, depths=(1, 2, 2, 1), num_heads=1, img_size=64, drop_path_rate=0.0)


def test_folded_logits_equal_scaled_logits_plus_bias() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [((8, 8), (2, 2), None), ((4, 6), (4, 6), None), ((5, 8), (3, 4), ((8, 8), (4, 4)))]
    for (qh, qw), (kh, kw), grid in cases:
        span = 2 * max(grid[0][0] if grid else qh, grid[1][0] if grid else kh) - 1
        rh, rw = torch.randn(span, 12, generator=g), torch.randn(span, 12, generator=g)
        q = torch.randn(2, 3, qh * qw, 12, generator=g)
        k = torch.randn(2, 3, kh * kw, 12, generator=g)
        qa, ka = decomposed_rel_pos_fold(q, k, rh, rw, (qh, qw), (kh, kw), 12**-0.5, grid)
        assert qa.shape[-1] == ka.shape[-1] and qa.shape[-1] % 8 == 0 and qa.shape[-1] >= 12 + kh + kw
        expected = q @ k.transpose(-1, -2) * 12**-0.5 + decomposed_rel_pos_bias(q, rh, rw, (qh, qw), (kh, kw), grid)
        assert torch.allclose(qa @ ka.transpose(-1, -2), expected, atol=1e-5)
        # blocked keys (a window's padding): the same attention as the bias path's where()
        blocked = torch.rand(2, 1, kh * kw, generator=g) < 0.3  # per image, over k's (2, heads, Nk)
        blocked[..., 0] = False
        qm, km = decomposed_rel_pos_fold(q, k, rh, rw, (qh, qw), (kh, kw), 12**-0.5, grid, key_mask=blocked)
        assert qm.shape[-1] % 8 == 0 and qm.shape[-1] >= 12 + kh + kw + 1
        v = torch.randn(2, 3, kh * kw, 5, generator=g)
        want = torch.where(blocked[:, :, None], MASK_VALUE, expected).softmax(-1) @ v
        assert torch.allclose((qm @ km.transpose(-1, -2)).softmax(-1) @ v, want, atol=1e-5)


def test_parity_with_timm_tiny_224() -> None:
    torch.manual_seed(0)
    ref = randomize_(timm.create_model("mvitv2_tiny", pretrained=False)).eval()
    ours = vtdense.create_backbone("mvitv2_tiny", out_norm=False, rel_pos_fold=True).eval()
    vtdense.load_pretrained(ours, ref.state_dict())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = timm_features(ref, x)
        got = ours(x)
    for e, (k, g) in zip(expected, got.items()):
        assert (g - e).abs().max().item() < 1e-4, k
        assert e.std() > 0.5


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, tuple]]:
    """Outputs, parameter gradients, and the shapes of the tensors autograd saves (by storage)."""
    saved: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = list(model(x).values())
    sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out).backward()
    return [o.detach() for o in out], [p.grad for p in model.parameters()], saved


def test_training_step_matches_the_bias_path_and_saves_no_logit_sized_tensor() -> None:
    torch.manual_seed(0)
    for window in (0, 16):  # windows of 16 at 72x88: padded ones (a key-mask column), and global blocks
        bias = randomize_(vtdense.create_backbone("mvitv2_tiny", window_size=window, rel_pos_fold=False, **SMALL)).train()
        fold = vtdense.create_backbone("mvitv2_tiny", window_size=window, rel_pos_fold=True, **SMALL).train()
        fold.load_state_dict(bias.state_dict())
        x = torch.randn(2, 3, 72, 88)
        out_b, grads_b, _ = _step(bias, x)
        out_f, grads_f, _ = _step(fold, x)
        for a, b in zip(out_f, out_b):
            assert torch.allclose(a, b, atol=1e-5)
        for (name, _), a, b in zip(bias.named_parameters(), grads_f, grads_b):
            # float rounding of a sum in another order, relative to the gradient's own scale
            assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-5, name
    # global attention at 128x128: stage 1 has 32x32 = 1024 queries and 8x8 = 64 keys per image
    bias = randomize_(vtdense.create_backbone("mvitv2_tiny", rel_pos_fold=False, **SMALL)).train()
    default = vtdense.create_backbone("mvitv2_tiny", **SMALL).train()  # rel_pos_fold=None: folds when training
    default.load_state_dict(bias.state_dict())
    x = torch.randn(2, 3, 128, 128)
    assert any(shape[-2:] == (1024, 64) for shape in _step(bias, x)[2].values())  # the bias path keeps logits
    assert not any(shape[-2:] == (1024, 64) for shape in _step(default, x)[2].values())


def test_default_folds_only_when_gradients_are_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rel_pos_fold=None`` adds the bias where autograd records nothing (inference: faster on
    the CPU) and folds where it records (training)."""
    import vtdense.backbones.mvitv2 as mvitv2

    calls = []
    monkeypatch.setattr(mvitv2, "decomposed_rel_pos_fold", lambda *a, **k: calls.append(1) or decomposed_rel_pos_fold(*a, **k))
    model = vtdense.create_backbone("mvitv2_tiny", **SMALL)
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        model.eval()(x)
    with torch.no_grad():
        model.train()(x)
    assert calls == []
    model.train()(x)
    assert len(calls) == sum(SMALL["depths"])
    for p in model.parameters():  # frozen weights, input without gradient: nothing recorded
        p.requires_grad_(False)
    model(x)
    assert len(calls) == sum(SMALL["depths"])


# A compiled training step (compile_backbone, dynamic sizes) keeps the bias path and gives eager's
# gradients: tests/test_compile_batch.py::test_one_training_graph_serves_batches_of_2_1_and_16[mvitv2].
