"""Swin V2 equals timm where a stage's map is not larger than the window.

timm (like the official code) shrinks the window to such a map, drops the shift and computes the
Log-CPB coordinates for the shrunk window, normalised by the pretrained window if given, else by
the shrunk window, per axis. timm fixes its input size at build, so each case builds timm at the
size it is run at.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vtdense
from vtdense.layers.position import log_cpb_coords, log_spaced_coords
from vtdense.layers.windows import effective_window

from test_swin import randomize_


def _compare(ref: torch.nn.Module, ours: torch.nn.Module, size: tuple[int, int]) -> list[float]:
    missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
    assert missing == [] and unexpected == []
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(x)
        got = ours(x)
    errors = []
    for e, (k, g) in zip(expected, got.items()):
        e = e.permute(0, 3, 1, 2)  # timm features are NHWC
        assert g.shape == e.shape, k
        assert e.std() > 0.1, k  # not a comparison of near-constant maps
        errors.append((g - e).abs().max().item())
    return errors


# A slimmer swinv2_tiny_window16_256 (2 blocks per stage: W-MSA then SW-MSA) keeps the suite fast;
# the first case is the published model unchanged.
FULL: dict = {}
SLIM = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))

# (input size, timm's pretrained window per stage, vtdense's pretrained_window_size, config)
CASES = [
    ((256, 256), (0, 0, 0, 0), 0, FULL),  # swinv2_tiny_window16_256 as published: stage 4 is 8x8
    ((256, 512), (0, 0, 0, 0), 0, SLIM),  # non-square: stage 4 is 8x16, stage 3 16x32 (no shift along h)
    ((128, 512), (0, 0, 0, 0), 0, SLIM),  # two stages smaller than the window along h
    ((256, 512), (8, 8, 8, 8), 8, SLIM),  # fine-tuned from window 8
    ((256, 256), (12, 12, 12, 6), (12, 12, 12, 6), SLIM),  # per stage, like swinv2_*_window12to16_192to256
]


@pytest.mark.parametrize("size,timm_pws,ours_pws,cfg", CASES)
def test_swinv2_window16_matches_timm_where_stages_are_smaller_than_the_window(size, timm_pws, ours_pws, cfg) -> None:
    torch.manual_seed(0)
    ref = timm.create_model(
        "swinv2_tiny_window16_256", pretrained=False, features_only=True, img_size=size, pretrained_window_sizes=timm_pws, **cfg
    )
    ref = randomize_(ref.eval(), seed=3)  # timm zero-inits V2 post-norm weights: randomise everything
    ours = vtdense.create_backbone("swinv2_tiny", window_size=16, pretrained_window_size=ours_pws, out_norm=False, **cfg).eval()
    errors = _compare(ref, ours, size)
    assert max(errors) < 1e-4, errors


def test_small_tiny_config_odd_window_matches_timm() -> None:
    """Non-square windows on non-square images: per-axis shrinking, and shifts that differ per axis.

    (6, 7) shrinks along h at stage 3 (shift (0, 3)) and along both at stage 4. (6, 10) shifts
    stage 3 by (3, 5), so a shift applied along the wrong axis shows; its sizes are window
    multiples because timm, unlike vtdense, lets the padded tokens take part in attention."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    for size, window in [((96, 224), (6, 7)), ((192, 320), (6, 10))]:  # stage maps (24, 56) ... (3, 7); (48, 80) ... (6, 10)
        _assert_odd_window_matches_timm(SwinTransformerV2, size, window)


def _assert_odd_window_matches_timm(SwinTransformerV2: type, size: tuple[int, int], window: tuple[int, int]) -> None:
    cfg = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=window)
    for pws in (0, 4):
        ref = SwinTransformerV2(img_size=size, num_classes=0, pretrained_window_sizes=(pws,) * 4, **cfg)
        ref = randomize_(ref.eval(), seed=4)
        ours = vtdense.create_backbone("swinv2_tiny", **cfg, pretrained_window_size=pws, out_norm=False).eval()
        missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
        assert missing == [] and unexpected == []
        x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            expected = ref.forward_intermediates(x, intermediates_only=True)  # NCHW, no final norm
            got = list(ours(x).values())
        assert len(expected) == len(got) == 4
        for e, g in zip(expected, got):
            assert g.shape == e.shape and e.std() > 0.1
            assert (g - e).abs().max().item() < 1e-4, (window, pws)


def test_log_cpb_coordinates_follow_the_window_in_use() -> None:
    # shrunk window (8, 16) of a nominal 16: h normalised by 7, w by 15
    c = log_cpb_coords((8, 16)).view(15, 31, 2)
    corner = -math.log2(9) / 3  # offset -(w-1) -> -8 -> sign * log2(1 + 8) / log2(8)
    assert c[0, 0, 0].item() == pytest.approx(corner) and c[0, 0, 1].item() == pytest.approx(corner)
    # with a pretrained window the normalisation is fixed: offset 7 of 8 -> the same value at any window
    a, b = log_cpb_coords((8, 8), (8, 8)).view(15, 15, 2), log_cpb_coords((16, 16), (8, 8)).view(31, 31, 2)
    assert torch.equal(a[0, 0], b[8, 8])
    assert torch.equal(log_cpb_coords((1, 5)), log_spaced_coords((1, 5), (1, 5)))  # window 1: coordinate 0, no 0/0
    assert torch.isfinite(log_cpb_coords((1, 1))).all()
    expected = math.log2(1 + 8 * 3 / 4) / 3  # offset +3 in a window of 5: 3/4 of the way to 8
    assert log_cpb_coords((5, 5)).view(9, 9, 2)[7, 4, 0].item() == pytest.approx(expected)


def test_nominal_normalisation_is_the_explicit_pretrained_window() -> None:
    """``pretrained_window_size=window_size`` keeps an offset's bias independent of the map size
    (vtdense's behaviour before 0.1): the bias of a shrunk window is the nominal table's sub-block."""
    model = vtdense.create_backbone("swinv2_tiny", embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=8, pretrained_window_size=8)
    attn = model.layers[0].blocks[0].attn
    randomize_(attn)
    with torch.no_grad():
        full, small = attn.position_bias((8, 8)), attn.position_bias((3, 8))
    # token (i, j) of the 3x8 window has index i*8+j in both
    idx = torch.arange(24)
    assert torch.allclose(small, full[:, idx][:, :, idx])
    plain = vtdense.create_backbone("swinv2_tiny", embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=8)
    pattn = plain.layers[0].blocks[0].attn
    pattn.load_state_dict(attn.state_dict())
    with torch.no_grad():
        assert not torch.allclose(pattn.position_bias((3, 8)), small)  # the reference renormalises
        assert torch.equal(pattn.position_bias((8, 8)), full)


def test_pretrained_window_size_per_stage_and_errors() -> None:
    m = vtdense.create_backbone("swinv2_tiny", embed_dim=16, num_heads=(1, 1, 1, 1), pretrained_window_size=(12, 12, 12, 6))
    assert [s.blocks[0].attn.pretrained_window_size for s in m.layers] == [(12, 12)] * 3 + [(6, 6)]
    m = vtdense.create_backbone("swinv2_tiny", embed_dim=16, num_heads=(1, 1, 1, 1), pretrained_window_size=(6, 8))
    assert {s.blocks[0].attn.pretrained_window_size for s in m.layers} == {(6, 8)}
    with pytest.raises(ValueError, match="pretrained_window_size"):
        vtdense.create_backbone("swinv2_tiny", pretrained_window_size=(8, 8, 8))
    with pytest.raises(ValueError, match="only applies to Swin V2"):
        vtdense.create_backbone("swin_tiny", pretrained_window_size=(0, 0, 0, 7))
    assert effective_window((8, 40), (16, 16), (8, 8)) == ((8, 16), (0, 8))


def test_whole_model_cast_to_another_dtype_matches_timm_where_stages_are_smaller_than_the_window() -> None:
    """``.double()`` / ``.bfloat16()`` of the whole model: a shrunk window's Log-CPB coordinates
    follow the model's dtype (they came from a float32 cache, and the CPB MLP raised a dtype
    mismatch). In float64, timm cast the same way agrees to 1e-10."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    size = (64, 128)  # stage maps (16, 32) (8, 16) (4, 8) (2, 4): stages 3 and 4 shrink window 8, no padding
    cfg = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=8)
    ref = randomize_(SwinTransformerV2(img_size=size, num_classes=0, **cfg).eval(), seed=5)
    ours = vtdense.create_backbone("swinv2_tiny", **cfg, out_norm=False).eval()
    missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
    assert missing == [] and unexpected == []
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        expected = ref.double().forward_intermediates(x, intermediates_only=True)[-1]  # NCHW, no final norm
        got = ours.double()(x)["stage4"]
        assert got.dtype == torch.float64
        assert (got - expected).abs().max().item() < 1e-10
        for dtype in (torch.bfloat16, torch.float16):
            low = ours.to(dtype)(x.to(dtype))["stage4"]
            assert low.dtype == dtype and torch.isfinite(low).all()
            assert (low.double() - expected).abs().max().item() < 0.1 * expected.abs().max().item()
