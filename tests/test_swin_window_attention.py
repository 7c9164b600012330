"""Swin's window attention at its limits: masked keys at the largest cosine logits, the logit
scale's initial value and clamp (against timm), no-decay parameters (against timm), and the
position-bias cache (per dtype; edits through ``.data``)."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.models.swin_transformer_v2 import SwinTransformerV2

import vtdense
from vtdense.backbones.swin import WindowAttention
from vtdense.layers.windows import MASK_VALUE, mask_value

from test_swin import randomize_

SLIM = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)


def _adversarial_cosine_attention(logit_scale: float) -> WindowAttention:
    """Swin V2 attention (1 head, 4 channels) with ``q = x``, ``k = -x``, ``v = x`` and an identity
    output projection: a token's logit against itself is the *lowest* possible cosine logit, and
    against an opposite token the highest."""
    attn = WindowAttention(4, 1, (2, 2), cosine=True)
    eye = torch.eye(4)
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.cat((eye, -eye, eye)))
        attn.logit_scale.fill_(logit_scale)
        attn.cpb_mlp[2].weight.zero_()  # bias 16 * sigmoid(0) = 8 everywhere
        attn.proj.weight.copy_(eye)
        attn.proj.bias.zero_()
    return attn


@pytest.mark.parametrize("training", [False, True])
def test_masked_keys_get_no_weight_at_the_largest_cosine_logits(training: bool) -> None:
    """Swin V2's logits reach +-100 (clamped logit scale) plus a bias of up to 16. A masked key
    must get no weight even when its logit is the largest and every allowed key's the smallest
    (an additive mask of -100, the references', would hand it almost all the weight)."""
    attn = _adversarial_cosine_attention(math.log(100.0) + 1).train(training)  # beyond the clamp
    e1 = torch.tensor([1.0, 0.2, -0.1, 0.05])
    x = torch.stack((e1, 1.1 * e1, -e1, -0.9 * e1))[None, None].requires_grad_(training)  # (B, nW, N, C)
    # tokens {0, 1} and {2, 3} are different shift regions
    region = torch.tensor([0, 0, 1, 1])
    mask = (region[:, None] != region[None, :])[None]
    with torch.set_grad_enabled(training):
        out = attn(x, (2, 2), mask)
    # each query sees only its own region, whose tokens all point the same way: the output is a
    # weighted mean of those tokens, so along e1 it lies between them and has their sign
    along = out[0, 0] @ e1 / e1.square().sum()
    assert (along[:2] > 0.99).all() and (along[:2] < 1.11).all(), along
    assert (along[2:] < -0.89).all() and (along[2:] > -1.01).all(), along
    assert mask_value() == MASK_VALUE  # the public constant is the value the graphs use
    if training:
        out.sum().backward()
        assert torch.isfinite(x.grad).all()


def test_logit_scale_starts_at_log_10_as_in_timm() -> None:
    ref = SwinTransformerV2(img_size=64, num_classes=0, **SLIM)
    ours = vtdense.create_backbone("swinv2_tiny", **SLIM)
    expected = {k: v for k, v in ref.state_dict().items() if k.endswith("logit_scale")}
    got = {k: v for k, v in ours.state_dict().items() if k.endswith("logit_scale")}
    assert set(got) == set(expected) and len(got) == sum(SLIM["depths"])
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
        assert torch.allclose(value, torch.full_like(value, math.log(10.0)))
    alone = WindowAttention(8, 2, (4, 4), cosine=True).logit_scale  # built on its own, not by a backbone
    assert torch.allclose(alone, torch.full_like(alone, math.log(10.0)))


def test_logit_scale_is_clamped_at_log_100_as_in_timm() -> None:
    """Half the heads' scales above the clamp (``log 100``), half below: the same outputs as timm."""
    size = (64, 128)  # window multiples: timm lets padded tokens into attention, vtdense masks them
    ref = randomize_(SwinTransformerV2(img_size=size, num_classes=0, **SLIM).eval(), seed=5)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("logit_scale"):
                p.view(-1)[0::2] = 6.0  # exp(6) = 403, clamped to 100
                p.view(-1)[1::2] = 2.5
    ours = vtdense.create_backbone("swinv2_tiny", **SLIM, out_norm=False).eval()
    assert vtdense.load_pretrained(ours, ref.state_dict()) == ([], [])
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref.forward_intermediates(x, intermediates_only=True)
        got = list(ours(x).values())
    for e, g in zip(expected, got):
        assert e.std() > 0.1 and (g - e).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "timm_name,name", [("swin_tiny_patch4_window7_224", "swin_tiny"), ("swinv2_tiny_window8_256", "swinv2_tiny")]
)
def test_no_weight_decay_selects_timms_parameters(timm_name: str, name: str) -> None:
    with torch.device("meta"):
        ref = timm.create_model(timm_name, pretrained=False)
        ours = vtdense.create_backbone(name)
    fragments = ours.no_weight_decay()
    selected = {n for n, _ in ours.named_parameters() if any(f in n for f in fragments)}
    assert selected == ref.no_weight_decay() and selected


def test_cached_position_bias_is_per_dtype() -> None:
    attn = WindowAttention(8, 2, (4, 4), cosine=True).eval()
    with torch.no_grad():
        b32 = attn.cached_position_bias((4, 4), torch.float32)
        b16 = attn.cached_position_bias((4, 4), torch.bfloat16)
        again = attn.cached_position_bias((4, 4), torch.float32)
    assert b32.dtype == torch.float32 and b16.dtype == torch.bfloat16 and again.dtype == torch.float32
    assert torch.allclose(b16.float(), b32, rtol=1e-2) and again is b32


@pytest.mark.parametrize("cosine", [False, True])
def test_cached_position_bias_follows_edits_through_data(cosine: bool) -> None:
    """``p.data`` edits bump no version counter; the cache still sees the new values (CPU)."""
    attn = WindowAttention(8, 2, (4, 4), cosine=cosine).eval()
    with torch.no_grad():
        before = attn.cached_position_bias((4, 4), torch.float32).clone()
        if cosine:
            attn.cpb_mlp[2].weight.data.zero_()  # every entry becomes 16 * sigmoid(0)
            expected = torch.full_like(before, 8.0)
        else:
            attn.relative_position_bias_table.data.add_(1.0)
            expected = before + 1.0
        after = attn.cached_position_bias((4, 4), torch.float32)
    assert not torch.allclose(before, expected)
    assert torch.allclose(after, expected, atol=1e-6)
