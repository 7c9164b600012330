"""MViTv2 backbone: timm parity, checkpoint layouts, any input size, hybrid windows and their
padded-key masking, FLOP scaling, contract and errors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import timm
import torch
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg, cal_rel_pos_type, checkpoint_filter_fn
from torch.utils.flop_counter import FlopCounterMode

import vtdense
from vtdense.backbones import mvitv2 as mvitv2_module
from vtdense.backbones.mvitv2 import MultiScaleAttention, MViTv2
from vtdense.checkpoints.convert import CheckpointError
from vtdense.layers.depthwise_conv import depthwise_conv_nhwc
from vtdense.layers.position import decomposed_rel_pos_bias
from probe import probe_loss

NAMES = ["mvitv2_tiny", "mvitv2_small", "mvitv2_base", "mvitv2_large"]
#: A small large-style model (width change in the MLP of a stage's last block).
SMALL_L = dict(embed_dim=16, depths=(1, 2, 2, 1), num_heads=1, expand_attn=False, img_size=64)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with random values (timm's init would leave outputs insensitive
    to some parameters, e.g. small position tables), norm weights in [0.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def to_flat(sd: dict[str, torch.Tensor], depths: tuple[int, ...], expand_attn: bool) -> dict[str, torch.Tensor]:
    """timm/vtdense ``stages.{s}.blocks.{j}`` -> the original/detectron2 flat ``blocks.{i}`` layout."""
    first = [sum(depths[:s]) for s in range(len(depths))]
    shortcut = "shortcut_proj_attn" if expand_attn else "shortcut_proj_mlp"
    out = {}
    for k, v in sd.items():
        k = k.replace(f".{shortcut}.", ".proj.")
        k = re.sub(r"^stages\.(\d+)\.blocks\.(\d+)\.", lambda m: f"blocks.{first[int(m[1])] + int(m[2])}.", k)
        out[k] = v
    return out


def timm_features(ref: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return ref.forward_intermediates(x, intermediates_only=True)


def test_parity_with_timm_tiny_224() -> None:
    torch.manual_seed(0)
    ref = randomize_(timm.create_model("mvitv2_tiny", pretrained=False)).eval()
    features_only = timm.create_model("mvitv2_tiny", pretrained=False, features_only=True)
    ours = vtdense.create_backbone("mvitv2_tiny", out_norm=False).eval()
    assert n_params(ours) == n_params(features_only)  # 23,402,784 with timm 1.0
    # the classification state dict: head and final norm are dropped, everything else fits
    missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
    assert missing == [] and unexpected == []
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = timm_features(ref, x)
        got = ours(x)
    assert list(got) == ["stage1", "stage2", "stage3", "stage4"]
    assert ours.out_channels == features_only.feature_info.channels()
    assert ours.out_strides == features_only.feature_info.reduction()
    for e, (k, g) in zip(expected, got.items()):
        assert g.shape == e.shape, k
        assert (g - e).abs().max().item() < 1e-4, k
        assert e.std() > 0.5  # the comparison is not between near-constant maps


def _interp_rows(table: np.ndarray, rows: int) -> np.ndarray:
    """The official MViTv2 resample of a ``(L, C)`` position table to ``rows`` rows
    (``F.interpolate(mode="linear")``, half-pixel centres), written out with numpy: output row ``i``
    reads the input at ``(i + 0.5) * L / rows - 0.5``, clipped to the ends."""
    at = np.clip((np.arange(rows) + 0.5) * table.shape[0] / rows - 0.5, 0, table.shape[0] - 1)
    return np.stack([np.interp(at, np.arange(table.shape[0]), column) for column in table.T], axis=1)


def test_parity_with_timm_at_another_input_size() -> None:
    """224-px weights run at 256 px: vtdense resamples the position tables as it runs; timm's model
    built for 256 px, given the same weights with its tables resampled by :func:`_interp_rows`,
    computes the same features (timm indexes its tables as they are, so it is the reference only
    once they are resampled outside it)."""
    torch.manual_seed(0)
    ref224 = randomize_(timm.create_model("mvitv2_tiny", pretrained=False)).eval()
    ours = vtdense.create_backbone("mvitv2_tiny", out_norm=False).eval()
    vtdense.load_pretrained(ours, ref224.state_dict())
    ref256 = timm.create_model("mvitv2_tiny", pretrained=False, img_size=256).eval()
    target = ref256.state_dict()
    sd = {}
    for k, v in ref224.state_dict().items():
        if v.shape != target[k].shape:
            assert ".rel_pos_" in k, k
            v = torch.from_numpy(_interp_rows(v.double().numpy(), target[k].shape[0])).float()
        sd[k] = v
    assert sum(".rel_pos_" in k and sd[k].shape != ref224.state_dict()[k].shape for k in sd) >= 10
    ref256.load_state_dict(sd)
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        for e, g in zip(timm_features(ref256, x), ours(x).values()):
            assert g.shape == e.shape and e.std() > 0.5
            assert (g - e).abs().max().item() < 1e-4


def test_parity_with_timm_large_layout_and_features_only_keys() -> None:
    """``expand_attn=False`` (mvitv2_large's layout) on a small config; also loads the
    ``model.``-prefixed state dict of a timm ``features_only`` model."""
    cfg = MultiScaleVitCfg(depths=SMALL_L["depths"], embed_dim=16, num_heads=1, expand_attn=False)
    ref = randomize_(MultiScaleVit(cfg, img_size=64, num_classes=0), seed=3).eval()
    ours = MViTv2(**SMALL_L, out_norm=False).eval()
    assert n_params(ours) == n_params(ref) - sum(p.numel() for p in ref.norm.parameters())
    vtdense.load_pretrained(ours, {f"model.{k}": v for k, v in ref.state_dict().items()})
    assert ours.out_channels == [32, 64, 128, 128]
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for e, g in zip(timm_features(ref, x), ours(x).values()):
            assert g.shape == e.shape
            assert (g - e).abs().max().item() < 1e-4


@pytest.mark.parametrize("expand_attn", [True, False])
def test_flat_key_names_agree_with_timms_converter(expand_attn: bool) -> None:
    """timm's own filter maps the original flat layout onto its staged one: our flat names are
    exactly what it expects (an independent check of the original key names)."""
    cfg = MultiScaleVitCfg(depths=(1, 2, 3, 1), embed_dim=16, num_heads=1, expand_attn=expand_attn)
    ref = MultiScaleVit(cfg, img_size=64, num_classes=5)
    sd = ref.state_dict()
    flat = to_flat(sd, cfg.depths, expand_attn)
    flat = {k.replace("head.fc.", "head.projection."): v for k, v in flat.items()}
    assert any(re.match(r"blocks\.\d+\.proj\.weight", k) for k in flat)
    back = checkpoint_filter_fn({"model_state": flat}, ref)
    assert set(back) == set(sd)
    assert all(back[k] is sd[k] for k in sd)


def test_flat_layouts_round_trip() -> None:
    """Original facebookresearch/mvit (``model_state``, flat blocks, head) and detectron2
    (``backbone.bottom_up.`` prefix, ``scale{k}_norm``) checkpoints give the same model."""
    src = randomize_(vtdense.create_backbone("mvitv2_tiny", window_size=56), seed=1).eval()
    sd = src.state_dict()
    backbone = {k: v for k, v in sd.items() if not k.startswith("out_norms.")}
    original = to_flat(backbone, src.depths, True)
    original.update({"norm.weight": torch.ones(768), "norm.bias": torch.zeros(768), "head.projection.weight": torch.zeros(10, 768), "head.projection.bias": torch.zeros(10)})
    detectron2 = {f"backbone.bottom_up.{k}": v for k, v in to_flat(backbone, src.depths, True).items()}
    detectron2.update({f"backbone.bottom_up.scale{i + 2}_norm.{p}": sd[f"out_norms.stage{i + 1}.{p}"] for i in range(4) for p in ("weight", "bias")})
    detectron2["backbone.fpn_lateral2.weight"] = torch.zeros(1)  # neck weights are not the backbone's
    x = torch.randn(1, 3, 160, 224)
    with torch.no_grad():
        expected = src(x)
    from_original = vtdense.create_backbone("mvitv2_tiny", window_size=56).eval()
    missing, unexpected = vtdense.load_pretrained(from_original, {"model_state": original})
    assert unexpected == [] and sorted(missing) == sorted(k for k in sd if k.startswith("out_norms."))
    from_d2 = vtdense.create_backbone("mvitv2_tiny", window_size=56).eval()
    assert vtdense.load_pretrained(from_d2, {"model": detectron2}) == ([], [])
    with torch.no_grad():
        got_d2 = from_d2(x)
        got_orig = vtdense.create_backbone("mvitv2_tiny", window_size=56, out_norm=False).eval()
        vtdense.load_pretrained(got_orig, {"model_state": original})
        got_orig = got_orig(x)
    for k in expected:
        assert torch.equal(got_d2[k], expected[k]), k
    # without output norms the original-layout model emits the un-normed maps of the same blocks
    ln = {k: src.out_norms[k] for k in expected}
    with torch.no_grad():
        for k in expected:
            renormed = ln[k](got_orig[k].permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            assert torch.allclose(renormed, expected[k], atol=1e-5), k


def test_original_layout_of_a_large_style_model_and_class_token_checkpoints() -> None:
    """The flat layout where the width changes in the MLP (``expand_attn=False``, mvitv2_large's
    layout): ``blocks.{i}.proj`` is ``shortcut_proj_mlp`` there, and the features equal timm's.
    timm's ``mvitv2_*_cls`` checkpoints carry a class token vtdense has no use for (detectron2's
    MViT, which vtdense follows, drops it too): dropped as a classification weight, all else loads."""
    cfg = MultiScaleVitCfg(depths=SMALL_L["depths"], embed_dim=16, num_heads=1, expand_attn=False)
    ref = randomize_(MultiScaleVit(cfg, img_size=64, num_classes=0), seed=4).eval()
    flat = to_flat(ref.state_dict(), cfg.depths, False)
    assert any(re.match(r"blocks\.\d+\.proj\.weight", k) for k in flat)
    ours = MViTv2(**SMALL_L, out_norm=False).eval()
    report = vtdense.load_pretrained(ours, {"model_state": flat})
    assert report == ([], []) and report.format == "mvit (original)"
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for e, g in zip(timm_features(ref, x), ours(x).values()):
            assert g.shape == e.shape and e.std() > 0.1  # not near-constant maps
            assert (g - e).abs().max().item() < 1e-4
    cls_cfg = MultiScaleVitCfg(depths=SMALL_L["depths"], embed_dim=16, num_heads=1, expand_attn=False, use_cls_token=True)
    with_cls = MultiScaleVit(cls_cfg, img_size=64, num_classes=3).state_dict()
    assert "cls_token" in with_cls
    report = vtdense.load_pretrained(MViTv2(**SMALL_L, out_norm=False), with_cls)
    assert report == ([], []) and ("cls_token", "classification head / final norm") in report.dropped


def test_checkpoint_errors_and_table_resize() -> None:
    src = vtdense.create_backbone("mvitv2_tiny")
    sd = src.state_dict()
    bigger = vtdense.create_backbone("mvitv2_tiny", img_size=448)
    vtdense.load_pretrained(bigger, sd)  # position tables resampled for the larger nominal size
    key = "stages.0.blocks.0.attn.rel_pos_h"
    assert bigger.state_dict()[key].shape[0] == 2 * 112 - 1
    old = sd[key].numpy()
    expected = _interp_rows(old, 2 * 112 - 1)
    assert old.std() > 0.01 and np.abs(bigger.state_dict()[key].numpy() - expected).max() < 1e-5 * np.abs(old).max()
    with pytest.raises(CheckpointError, match="missing keys"):
        vtdense.load_pretrained(vtdense.create_backbone("mvitv2_small"), sd)
    with pytest.raises(CheckpointError, match="does not exist"):
        vtdense.load_pretrained(src, to_flat(vtdense.create_backbone("mvitv2_small").state_dict(), (1, 2, 11, 2), True))
    # fewer outputs: stages that are not built ignore their weights
    short = vtdense.create_backbone("mvitv2_tiny", out_indices=(0, 1), out_norm=False)
    assert vtdense.load_pretrained(short, sd) == ([], [])
    assert torch.equal(short.stages[1].blocks[1].attn.rel_pos_w, sd["stages.1.blocks.1.attn.rel_pos_w"])


def test_decomposed_rel_pos_matches_timm() -> None:
    g = torch.Generator().manual_seed(0)
    # the last two: pooling ratios that are not whole numbers (25/7, 33/9), where the reference
    # truncates the stretched offsets; and keys longer than queries
    for (qh, qw), (kh, kw) in [((8, 8), (2, 2)), ((4, 6), (4, 6)), ((6, 6), (3, 3)), ((25, 33), (7, 9)), ((5, 7), (9, 11))]:
        rh = torch.randn(2 * max(qh, kh) - 1, 8, generator=g)
        rw = torch.randn(2 * max(qw, kw) - 1, 8, generator=g)
        q = torch.randn(2, 3, qh * qw, 8, generator=g)
        expected = cal_rel_pos_type(torch.zeros(2, 3, qh * qw, kh * kw), q, False, [qh, qw], [kh, kw], rh, rw)
        assert expected.abs().max() > 1
        assert torch.allclose(decomposed_rel_pos_bias(q, rh, rw, (qh, qw), (kh, kw)), expected, atol=1e-5)
    # a window clipped to a smaller map keeps the full window's offsets: a top-left block
    q = torch.randn(1, 8 * 8, 4, generator=g)
    rh, rw = torch.randn(15, 4, generator=g), torch.randn(15, 4, generator=g)
    full = decomposed_rel_pos_bias(q, rh, rw, (8, 8), (4, 4)).view(8, 8, 4, 4)
    part = decomposed_rel_pos_bias(q.view(8, 8, 4)[:5, :].reshape(1, 40, 4), rh, rw, (5, 8), (3, 4), ((8, 8), (4, 4)))
    assert torch.allclose(part.view(5, 8, 3, 4), full[:5, :, :3, :], atol=1e-6)


def _reference_window_attention(attn: MultiScaleAttention, x: torch.Tensor) -> torch.Tensor:
    """Brute force without padding: loop over windows, slice the real tokens, index the tables
    with explicit offsets, softmax over real keys only."""
    B, H, W, _ = x.shape
    h, d = attn.num_heads, attn.head_dim
    qkv = attn.qkv(x).reshape(B, H, W, 3, h, d).permute(3, 0, 4, 1, 2, 5).reshape(3, B * h, H, W, d)
    # each head pooled on its own, as the paper and timm do (heads in the batch)
    q, k, v = (n(p(t.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)) for t, p, n in zip(qkv, (attn.pool_q, attn.pool_k, attn.pool_v), (attn.norm_q, attn.norm_k, attn.norm_v)))
    qw, kw = attn.window // attn.stride_q, attn.window // attn.stride_kv
    assert attn.rel_pos_h.shape[0] == 2 * max(qw, kw) - 1  # no resampling in this reference
    qr, kr = max(kw / qw, 1.0), max(qw / kw, 1.0)
    off = torch.tensor([[int(i * qr - m * kr + (kw - 1) * kr) for m in range(kw)] for i in range(qw)])
    Hq, Wq = q.shape[1:3]
    Hk, Wk = k.shape[1:3]
    out = torch.zeros_like(q)
    for a in range(math.ceil(Hq / qw)):
        for b in range(math.ceil(Wq / qw)):
            qs = q[:, a * qw : (a + 1) * qw, b * qw : (b + 1) * qw]
            ks = k[:, a * kw : (a + 1) * kw, b * kw : (b + 1) * kw]
            vs = v[:, a * kw : (a + 1) * kw, b * kw : (b + 1) * kw]
            (nqh, nqw), (nkh, nkw) = qs.shape[1:3], ks.shape[1:3]
            Rh = attn.rel_pos_h[off[:nqh, :nkh]]  # nqh, nkh, d
            Rw = attn.rel_pos_w[off[:nqw, :nkw]]
            logits = torch.einsum("bijc,bmnc->bijmn", qs, ks) * d**-0.5
            logits = logits + torch.einsum("bijc,imc->bijm", qs, Rh)[..., None] + torch.einsum("bijc,jnc->bijn", qs, Rw)[..., None, :]
            p = logits.reshape(B * h, nqh, nqw, -1).softmax(-1)
            out[:, a * qw : a * qw + nqh, b * qw : b * qw + nqw] = torch.einsum("bijk,bkc->bijc", p, vs.reshape(B * h, -1, d))
    out = out + q
    out = out.view(B, h, Hq, Wq, d).permute(0, 2, 3, 1, 4).reshape(B, Hq, Wq, h * d)
    return attn.proj(out)


@pytest.mark.parametrize("size", [(19, 29), (5, 29), (8, 16)])
def test_window_attention_matches_unpadded_reference(size: tuple[int, int]) -> None:
    """Windows of 4 pooled queries / 2 pooled keys on maps that need padding (19x29), that are
    smaller than a window along one axis (5x29) and that tile exactly (8x16)."""
    torch.manual_seed(0)
    attn = MultiScaleAttention(16, 16, 2, stride_q=2, stride_kv=4, feat_size=8, window=8).eval()
    randomize_(attn, seed=2)
    x = torch.randn(2, *size, 16)
    with torch.no_grad():
        got = attn(x)
        expected = _reference_window_attention(attn, x)
    assert got.shape == expected.shape == (2, math.ceil(size[0] / 2), math.ceil(size[1] / 2), 16)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("stride", [1, 2, 4])
def test_pooling_op_equals_the_depthwise_conv(stride: int, bf16: bool) -> None:
    """Compiled training pools by the op ``vtdense::depthwise_conv_nhwc`` (``depthwise_conv_nhwc``):
    on maps that the stride divides or not, the output, its dtype and the gradients of the input and
    the filters are those of ``F.conv2d`` on the channels-last view, as eager code runs it."""
    torch.manual_seed(0)
    C = 12
    for H, W in [(8, 8), (13, 5), (7, 9)]:
        y = torch.randn(2, H, W, C, requires_grad=True)
        w = torch.randn(C, 1, 3, 3, requires_grad=True)
        results = []
        for op in (False, True):
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                if op:  # (B, H', W', heads, d) -> (B, H', W', C)
                    out = depthwise_conv_nhwc(y, w, (stride, stride), (1, 1), heads=3).flatten(3)
                else:
                    out = torch.nn.functional.conv2d(y.permute(0, 3, 1, 2), w, None, stride, 1, groups=C).permute(0, 2, 3, 1)
            grads = torch.autograd.grad(out.float().square().sum(), (y, w))
            results.append((out, *grads))
        (ref, *ref_grads), (got, *got_grads) = results
        assert got.shape == ref.shape == (2, math.ceil(H / stride), math.ceil(W / stride), C)
        assert got.dtype == ref.dtype == (torch.bfloat16 if bf16 else torch.float32)
        for a, b in zip((got, *got_grads), (ref, *ref_grads)):
            assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5), (H, W)


def test_pooling_op_passes_torch_opcheck() -> None:
    """The op's fake (meta) form, schema and autograd registration agree with its real one
    (``torch.library.opcheck``: what Dynamo and AOT autograd rely on when they trace it)."""
    torch.manual_seed(0)
    for stride, (H, W) in [(1, (8, 8)), (2, (7, 9)), (4, (13, 5))]:
        rows = torch.randn(2 * H * W, 6, requires_grad=True)  # a (2, H, W, 6) map as rows; 2 heads of 3
        w = torch.randn(6, 1, 3, 3, requires_grad=True)
        torch.library.opcheck(torch.ops.vtdense.depthwise_conv_nhwc.default, (rows, w, 2, H, W, 2, [stride, stride], [1, 1]))


@pytest.mark.parametrize("window", [0, 8])
def test_replaced_or_hooked_qkv_is_called(window: int) -> None:
    """The attention projects q/k/v with row slices of a plain ``qkv`` Linear; a hooked or
    replaced ``qkv`` (LoRA, quantisation) must still be called, with the same outputs when it
    computes the same thing, and its change must reach the output."""
    attn = MultiScaleAttention(16, 32, 2, stride_q=2, stride_kv=2, feat_size=8, window=window).eval()
    randomize_(attn, seed=3)
    x = torch.randn(2, 9, 11, 16)
    with torch.no_grad():
        plain = attn(x)
        calls = []
        handle = attn.qkv.register_forward_hook(lambda m, i, o: calls.append(1))
        hooked = attn(x)
        handle.remove()
        assert calls == [1]
        assert (hooked - plain).abs().max().item() < 1e-5

        class Doubled(torch.nn.Linear):  # a replaced projection: 2 * qkv(x)
            def forward(self, t: torch.Tensor) -> torch.Tensor:
                return 2 * super().forward(t)

        doubled = Doubled(16, 96)
        doubled.load_state_dict(attn.qkv.state_dict())
        attn.qkv = doubled
        replaced = attn(x)
        attn.qkv = torch.nn.Linear(16, 96)
        attn.qkv.load_state_dict({k: 2 * v for k, v in doubled.state_dict().items()})
        expected = attn(x)
    assert (replaced - expected).abs().max().item() < 1e-5
    assert (replaced - plain).abs().max().item() > 1e-3


def test_padding_content_does_not_reach_real_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    model = randomize_(vtdense.create_backbone("mvitv2_tiny", window_size=16), seed=4).eval()
    x = torch.randn(1, 3, 97, 131)  # stage grids 25x33, 13x17, 7x9, 4x5: every window level pads
    with torch.no_grad():
        clean = model(x)

    def pad_with_garbage(t: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
        H, W = t.shape[1:3]
        out = torch.randn(t.shape[0], H + (-H % window[0]), W + (-W % window[1]), t.shape[3]) * 3
        out[:, :H, :W] = t
        return out

    calls = []
    monkeypatch.setattr(mvitv2_module, "pad_to_window", lambda t, w: calls.append(1) or pad_with_garbage(t, w))
    with torch.no_grad():
        dirty = model(x)
    assert calls  # the padding path ran
    for k in clean:
        assert torch.allclose(dirty[k], clean[k], atol=1e-5), k


@pytest.mark.parametrize("window_size", [0, 16, 56])
@pytest.mark.parametrize("size", [(97, 131), (32, 32), (61, 40)])
def test_any_input_size(window_size: int, size: tuple[int, int]) -> None:
    model = vtdense.create_backbone("mvitv2_tiny", window_size=window_size).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, *size))
    assert list(out) == model.out_names
    for (name, y), c, s in zip(out.items(), model.out_channels, model.out_strides):
        assert y.shape == (1, c, math.ceil(size[0] / s), math.ceil(size[1] / s)), name
        assert torch.isfinite(y).all()


def test_hybrid_layout() -> None:
    model = vtdense.create_backbone("mvitv2_base", window_size=56)
    windows = [[b.attn.window for b in st.blocks] for st in model.stages]
    assert windows == [[56, 56], [56, 28, 0], [28] + [14] * 14 + [0], [14, 7, 0]]
    kv = [[b.attn.stride_kv for b in st.blocks] for st in model.stages]
    assert kv == [[4, 4], [2, 2, 4], [1] * 15 + [2], [1, 1, 1]]
    plain = vtdense.create_backbone("mvitv2_base")
    assert all(b.attn.window == 0 for st in plain.stages for b in st.blocks)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


def test_all_names_on_meta_device() -> None:
    for name in NAMES:
        with torch.device("meta"):
            model = vtdense.create_backbone(name, out_norm=False)
            ref = timm.create_model(name, pretrained=False, features_only=True)
            out = model(torch.empty(1, 3, 224, 320))
        assert n_params(model) == n_params(ref), name
        assert model.out_channels == ref.feature_info.channels(), name
        assert model.out_strides == [4, 8, 16, 32] and model.size_divisibility == 32
        assert [tuple(y.shape) for y in out.values()] == [(1, c, 56 // 2**i, 80 // 2**i) for i, c in enumerate(model.out_channels)]
    counts = {}
    with torch.device("meta"):
        for name in NAMES:
            counts[name] = round(n_params(vtdense.create_backbone(name, out_norm=False)) / 1e6, 3)
    assert counts == {"mvitv2_tiny": 23.403, "mvitv2_small": 34.100, "mvitv2_base": 50.702, "mvitv2_large": 216.838}


def _flops(size: tuple[int, int], **kw: object) -> int:
    with torch.device("meta"):
        model = vtdense.create_backbone("mvitv2_tiny", **kw)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.empty(1, 3, *size))
    return counter.get_total_flops()


def test_hybrid_flops_grow_about_linearly() -> None:
    sizes = [(512, 768), (724, 1086), (1024, 1536)]  # ~1x, 2x, 4x the pixels
    hybrid = [_flops(s, window_size=56) for s in sizes]
    dense = [_flops(s) for s in sizes]
    for a, b in zip(hybrid, hybrid[1:]):
        assert 1.9 < b / a < 2.2
    for a, b in zip(dense, dense[1:]):
        assert b / a > 3.0
    assert 4.6e9 < _flops((224, 224)) / 2 < 4.8e9  # the paper's 4.7 GFLOPs (multiply-adds)


def test_grad_checkpointing_gives_same_gradients() -> None:
    torch.manual_seed(0)
    model = vtdense.create_backbone("mvitv2_tiny", window_size=8, drop_path_rate=0.0)
    x = torch.randn(1, 3, 64, 72)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        probe_loss(model(x)).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    plain = grads()
    model.set_grad_checkpointing(True)
    assert all(s.grad_checkpointing for s in model.stages)
    ckpt = grads()
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], atol=1e-6, rtol=1e-4), k
    assert vtdense.create_backbone("mvitv2_tiny", grad_checkpointing=True).stages[0].grad_checkpointing


def test_contract_options_and_errors() -> None:
    model = vtdense.create_backbone("mvitv2_tiny", out_indices=(1, 3), drop_path_rate=0.2)
    assert model.out_names == ["stage2", "stage4"] and model.out_channels == [192, 768] and model.out_strides == [8, 32]
    assert sorted(model.out_norms) == ["stage2", "stage4"]
    assert model.output_shape() == {"stage2": {"channels": 192, "stride": 8}, "stage4": {"channels": 768, "stride": 32}}
    rates = [b.drop_path1.p for st in model.stages for b in st.blocks]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)
    assert model.no_weight_decay() == {"rel_pos_h", "rel_pos_w"}
    assert all(any(f in n for f in model.no_weight_decay()) for n, _ in model.named_parameters() if "rel_pos" in n)
    assert len(vtdense.create_backbone("mvitv2_tiny", out_indices=(0,)).stages) == 1
    with pytest.raises(ValueError, match="NCHW"):
        model(torch.randn(3, 64, 64))
    with pytest.raises(ValueError, match="in_chans=3"):
        model(torch.randn(1, 4, 64, 64))
    assert vtdense.create_backbone("mvitv2_tiny", in_chans=4)(torch.randn(1, 4, 32, 32))["stage4"].shape == (1, 768, 1, 1)
    no_res = vtdense.create_backbone("mvitv2_tiny", window_size=16, residual_pooling=False).eval()
    assert no_res(torch.randn(1, 3, 97, 131))["stage2"].shape == (1, 192, 13, 17)  # padded windows
    with pytest.raises(ValueError, match="multiple of 8"):
        vtdense.create_backbone("mvitv2_tiny", window_size=14)
    with pytest.raises(ValueError, match="unknown option"):
        vtdense.create_backbone("mvitv2_tiny", window=7)
    with pytest.raises(ValueError, match="out_indices"):
        vtdense.create_backbone("mvitv2_tiny", out_indices=(2, 1))
    assert set(NAMES) <= set(vtdense.list_backbones())
