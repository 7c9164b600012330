"""Swin V1/V2 backbones: parity with timm, any input size, padding masking, contract, errors."""

from __future__ import annotations

import math
import re

import pytest
import timm
import torch
import torchvision

import vtdense
from vtdense.backbones.swin import SwinBlock, SwinTransformer
from vtdense.checkpoints.convert import CheckpointError
from vtdense.layers.windows import effective_window, window_attention_mask
from probe import probe_loss

TINY = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> torch.nn.Module:
    """Overwrite every parameter with random values (timm zero-inits some norms, which would
    make the outputs insensitive to whole branches and the parity test weak)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 + 1)
            elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@pytest.mark.parametrize(
    "timm_name,name,size",
    [("swin_tiny_patch4_window7_224", "swin_tiny", 224), ("swinv2_tiny_window8_256", "swinv2_tiny", 256)],
)
def test_parity_with_timm_features_only(timm_name: str, name: str, size: int) -> None:
    torch.manual_seed(0)
    ref = randomize_(timm.create_model(timm_name, pretrained=False, features_only=True)).eval()
    ours = vtdense.create_backbone(name, out_norm=False).eval()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    missing, unexpected = vtdense.load_pretrained(ours, ref.state_dict())
    assert missing == [] and unexpected == []
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = ref(x)
        got = ours(x)
    assert list(got) == ["stage1", "stage2", "stage3", "stage4"]
    for e, (k, g) in zip(expected, got.items()):
        e = e.permute(0, 3, 1, 2)  # timm features are NHWC
        assert g.shape == e.shape, k
        assert (g - e).abs().max().item() < 1e-4, k
        assert e.std() > 0.5  # the comparison is not between near-constant maps


def test_parameter_counts_match_published_figures() -> None:
    with torch.device("meta"):
        counts = {n: sum(p.numel() for p in vtdense.create_backbone(n, out_norm=False).parameters()) for n in ("swin_tiny", "swinv2_tiny")}
    assert round(counts["swin_tiny"] / 1e6, 3) == 27.518
    assert round(counts["swinv2_tiny"] / 1e6, 3) == 27.577


def test_loads_timm_classification_and_official_layouts() -> None:
    ref = randomize_(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10), seed=1).eval()
    sd = ref.state_dict()
    ours = vtdense.create_backbone("swin_tiny", out_norm=False).eval()
    vtdense.load_pretrained(ours, sd)  # head and final norm are dropped
    # official microsoft layout: patch merging at the *end* of a stage, wrapped in {"model": ...}
    official = {re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k): v for k, v in sd.items()}
    assert "layers.0.downsample.reduction.weight" in official
    ours2 = vtdense.create_backbone("swin_tiny", out_norm=False).eval()
    vtdense.load_pretrained(ours2, {"model": official})
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        a, b = ours(x), ours2(x)
        ref_last = ref.forward_features(x)  # NHWC after the final norm
    assert torch.equal(a["stage4"], b["stage4"])
    # timm applies its final norm after stage 4: same thing computed through our output norm
    norm = torch.nn.functional.layer_norm(a["stage4"].permute(0, 2, 3, 1), (768,), ref.norm.weight, ref.norm.bias)
    assert torch.allclose(norm, ref_last, atol=1e-4)


@pytest.mark.parametrize("version", [1, 2])
def test_loads_torchvision_swin(version: int) -> None:
    ctor, name, size = (torchvision.models.swin_t, "swin_tiny", 224) if version == 1 else (torchvision.models.swin_v2_t, "swinv2_tiny", 256)
    tv = randomize_(ctor(weights=None), seed=2).eval()
    ours = vtdense.create_backbone(name, out_norm=False).eval()
    vtdense.load_pretrained(ours, tv.state_dict())
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        got = ours(x)
        y = x
        feats = []
        for i, layer in enumerate(tv.features):
            y = layer(y)
            if i % 2 == 1:
                feats.append(y.permute(0, 3, 1, 2))
    for e, g in zip(feats, got.values()):
        assert (g - e).abs().max().item() < 1e-4


def to_mmdet(sd: dict[str, torch.Tensor], prefix: str = "backbone.") -> dict[str, torch.Tensor]:
    """vtdense Swin V1 -> mmdet/mmseg names: ``stages.*``, ``attn.w_msa``, ``ffn.layers``,
    unfold-ordered merging at the end of a stage, ``norm{i}``. ``prefix=""`` is the layout of
    mmdet's converted ImageNet backbones (``swin2mmdet``)."""
    mm = {}
    for k, v in sd.items():
        m = re.match(r"layers\.(\d+)\.downsample\.(.*)", k)
        if m:
            if m[2] in ("reduction.weight", "norm.weight", "norm.bias"):  # concat order -> unfold order
                c4 = v.shape[-1]
                v = v.reshape(*v.shape[:-1], 4, c4 // 4)[..., [0, 2, 1, 3], :].transpose(-1, -2).reshape(*v.shape[:-1], c4)
            mm[f"{prefix}stages.{int(m[1]) - 1}.downsample.{m[2]}"] = v
            continue
        k = k.replace("patch_embed.proj.", "patch_embed.projection.").replace("attn.qkv", "attn.w_msa.qkv")
        k = k.replace("attn.proj", "attn.w_msa.proj").replace("attn.relative_position_bias_table", "attn.w_msa.relative_position_bias_table")
        k = k.replace("mlp.fc1.", "ffn.layers.0.0.").replace("mlp.fc2.", "ffn.layers.1.")
        k = re.sub(r"^layers\.", "stages.", k)
        k = re.sub(r"out_norms\.stage(\d)\.", lambda m: f"norm{int(m[1]) - 1}.", k)
        mm[prefix + k] = v
    return mm


def test_loads_mmdet_layout_with_output_norms() -> None:
    """mmdet Swin: ``stages.*``, ``attn.w_msa``, ``ffn.layers``, unfold-ordered merging, ``norm{i}``."""
    src = randomize_(vtdense.create_backbone("swin_tiny", **{**TINY, "window_size": 7}), seed=3).eval()
    mm = to_mmdet(src.state_dict())
    dst = vtdense.create_backbone("swin_tiny", **{**TINY, "window_size": 7}).eval()
    vtdense.load_pretrained(dst, {"state_dict": mm})
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        for a, b in zip(src(x).values(), dst(x).values()):
            assert torch.equal(a, b)
    # the unfold order itself, independently of ``to_mmdet``: mmdet's merging from its definition
    # (``nn.Unfold(2, stride=2)``, channel-major ``c * 4 + kh * 2 + kw``, then norm and reduction)
    # on the mmdet tensors equals vtdense's merging on the converted ones
    x = torch.randn(2, 8, 6, 16)  # (B, H, W, C) into stage 2's merging
    cols = torch.nn.functional.unfold(x.permute(0, 3, 1, 2), kernel_size=2, stride=2).transpose(1, 2)
    p = "backbone.stages.0.downsample."
    expected = torch.nn.functional.linear(
        torch.nn.functional.layer_norm(cols, (64,), mm[p + "norm.weight"], mm[p + "norm.bias"]), mm[p + "reduction.weight"]
    )
    with torch.no_grad():
        got = dst.layers[1].downsample(x).reshape(2, 12, 32)
    assert torch.allclose(got, expected, atol=1e-5)


def test_checkpoint_errors_are_clear(tmp_path) -> None:
    model = vtdense.create_backbone("swin_tiny", **TINY)
    sd = model.state_dict()
    sd.pop("layers.0.blocks.0.attn.qkv.weight")
    sd["layers.0.blocks.0.attn.bogus"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): layers.0.blocks.0.attn.qkv.weight") as e:
        vtdense.load_pretrained(model, sd)
    assert "unexpected keys (1): layers.0.blocks.0.attn.bogus" in str(e.value)
    with pytest.raises(CheckpointError, match="not found"):
        vtdense.load_pretrained(model, tmp_path / "nope.pth")
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="bad.pth"):
        vtdense.load_pretrained(model, bad)
    good = tmp_path / "good.pth"
    torch.save({"model": model.state_dict()}, good)
    vtdense.load_pretrained(model, good)


def test_official_release_with_persisted_buffers_and_data_parallel_prefix() -> None:
    """The official microsoft/Swin-Transformer ``.pth`` files persist ``attn.relative_position_index``
    and, in shifted blocks, ``attn_mask`` (timm keeps the same buffers, under the same names, as
    non-persistent ones: ``named_buffers`` gives exactly what the official code saves). They are
    recomputed, never loaded, and a ``module.`` (DataParallel / DDP) prefix is stripped: the
    features equal timm's."""
    from timm.models.swin_transformer import SwinTransformer as TimmSwin

    ref = randomize_(TimmSwin(img_size=128, num_classes=5, **TINY), seed=9).eval()
    sd = {**ref.state_dict(), **dict(ref.named_buffers())}
    assert any(k.endswith("attn_mask") for k in sd) and any(k.endswith("relative_position_index") for k in sd)
    official = {re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k): v for k, v in sd.items()}
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        expected = ref.forward_intermediates(x, intermediates_only=True)
    for ckpt in ({"model": official}, {"model": {f"module.{k}": v for k, v in official.items()}}):
        ours = vtdense.create_backbone("swin_tiny", **TINY, out_norm=False).eval()
        report = vtdense.load_pretrained(ours, ckpt)
        assert report == ([], []) and report.format == "official"
        derived = {k for k, why in report.dropped if why == "derived buffer, recomputed by vtdense"}
        assert derived == {k for k in official if k.endswith(("attn_mask", "relative_position_index"))}  # named unwrapped
        with torch.no_grad():
            for e, g in zip(expected, ours(x).values()):
                assert g.shape == e.shape and (g - e).abs().max().item() < 1e-4


def test_window_change_resizes_v1_bias_table() -> None:
    """Window 4 -> 6: every block's table is resampled bicubically as the official Swin code does
    for fine-tuning (timm's ``resize_rel_pos_bias_table_simple`` is that method), on random tables
    of order 1 (a default-initialised one is within 0.04 of zero everywhere)."""
    from timm.layers.pos_embed_rel import resize_rel_pos_bias_table_simple

    src = randomize_(vtdense.create_backbone("swin_tiny", **{**TINY, "window_size": 4}), std=1.0)
    dst = vtdense.create_backbone("swin_tiny", **{**TINY, "window_size": 6})
    vtdense.load_pretrained(dst, src.state_dict())
    tables = [(n, p) for n, p in dst.named_parameters() if n.endswith("relative_position_bias_table")]
    assert len(tables) == sum(TINY["depths"])
    for name, t in tables:
        old = src.get_parameter(name).detach()
        assert t.shape == (11 * 11, old.shape[1]), name
        expected = resize_rel_pos_bias_table_simple(old, new_window_size=(6, 6), new_bias_shape=tuple(t.shape))
        assert (t.detach() - expected).abs().max() < 1e-5, name


def test_bias_table_of_a_non_square_window_is_one_clear_error() -> None:
    """A flat V1 table of a non-square window (4x6: 7*11 rows) cannot be resized from its row count
    alone: one error naming the key, not a deep ``ValueError`` from the resize."""
    src = vtdense.create_backbone("swin_tiny", **{**TINY, "window_size": (4, 6)})
    dst = vtdense.create_backbone("swin_tiny", **{**TINY, "window_size": (6, 8)})
    with pytest.raises(CheckpointError, match=r"layers\.0\.blocks\.0\.attn\.relative_position_bias_table: a bias table of 77 rows is not one of a square window.*does not say which non-square window.*6x8"):
        vtdense.load_pretrained(dst, src.state_dict())
    # a square row count of even side (64 = 8^2; (2w-1)^2 is odd for every w): not a Swin table at
    # all, the same error (not a ValueError from inside the resize)
    sd = src.state_dict()
    sd["layers.0.blocks.0.attn.relative_position_bias_table"] = torch.zeros(64, 1)
    with pytest.raises(CheckpointError, match=r"relative_position_bias_table: a bias table of 64 rows is not one of a square window"):
        vtdense.load_pretrained(dst, sd)


def test_checkpoint_of_another_shape_is_one_error_naming_keys_and_shapes() -> None:
    """A checkpoint of another ``mlp_ratio`` has every key, each MLP weight of another shape: under
    ``strict`` one error listing them with both shapes (nothing is loaded); a missing block norm is
    an error too (only the output norms, absent from classification checkpoints, are tolerated)."""
    src = vtdense.create_backbone("swin_tiny", **TINY, mlp_ratio=2.0)
    dst = vtdense.create_backbone("swin_tiny", **TINY)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    mismatch = r"shape mismatches \(24\): layers\.0\.blocks\.0\.mlp\.fc1\.weight: checkpoint \(32, 16\) vs model \(64, 16\)"
    with pytest.raises(CheckpointError, match=mismatch) as e:
        vtdense.load_pretrained(dst, src.state_dict())
    assert "missing keys" not in str(e.value) and "unexpected keys" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())
    # strict=False loads the rest; the report says why the MLP tensors were not loaded
    report = vtdense.load_pretrained(dst, src.state_dict(), strict=False)
    assert report == ([], []) and len(report.loaded) == len(before) - 24
    assert {why for _, why in report.dropped} == {"shape does not fit the model's tensor"} and len(report.dropped) == 24
    assert torch.equal(dst.layers[0].blocks[0].mlp.fc1.weight, before["layers.0.blocks.0.mlp.fc1.weight"])
    sd = vtdense.create_backbone("swin_tiny", **TINY).state_dict()
    sd.pop("layers.2.blocks.1.norm1.weight")
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): layers\.2\.blocks\.1\.norm1\.weight"):
        vtdense.load_pretrained(dst, sd)


def _brute_force_window_attention(block: SwinBlock, x: torch.Tensor) -> torch.Tensor:
    """Reference for one (S)W-MSA on a channels-last map of ANY size, written from the definition:
    pad to window multiples, roll, group by window and shift region; padded tokens are never keys.
    No padding tensor, no mask tensor: each real query attends to an explicit list of real keys."""
    attn = block.attn
    _, H, W, C = x.shape
    (wh, ww), (sh, sw) = effective_window((H, W), block.window_size, block.shift_size)
    Hp, Wp = math.ceil(H / wh) * wh, math.ceil(W / ww) * ww

    def region(r: int, n: int, w: int, s: int) -> int:
        return 0 if not s or r < n - w else (1 if r < n - s else 2)

    pos = {}
    for i in range(H):
        for j in range(W):
            r0, r1 = (i - sh) % Hp, (j - sw) % Wp
            pos[(i, j)] = (r0, r1, (r0 // wh, r1 // ww, region(r0, Hp, wh, sh), region(r1, Wp, ww, sw)))
    heads, d = attn.num_heads, C // attn.num_heads
    tokens = x[0]
    if attn.cosine:
        qkv_b = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
        qkv = torch.nn.functional.linear(tokens, attn.qkv.weight, qkv_b)
        # Log-CPB of the window in use, normalised by it (no pretrained window), as timm / official
        axes = [torch.arange(-(n - 1), n, dtype=torch.float32) / max(n - 1, 1) * 8 for n in (wh, ww)]
        coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 2)
        coords = torch.sign(coords) * torch.log2(coords.abs() + 1) / 3
        table = 16 * torch.sigmoid(attn.cpb_mlp(coords))
        Wh, Ww = wh, ww
    else:
        qkv = attn.qkv(tokens)
        table = attn.relative_position_bias_table
        Wh, Ww = attn.window_size
    q, k, v = qkv.view(H, W, 3, heads, d).unbind(2)
    out = torch.zeros(H, W, C)
    for p, (p0, p1, group) in pos.items():
        keys = [kk for kk, (_, _, g) in pos.items() if g == group]
        kt = torch.stack([k[kk] for kk in keys])  # n, heads, d
        vt = torch.stack([v[kk] for kk in keys])
        qp = q[p]
        if attn.cosine:
            scale = torch.clamp(attn.logit_scale.view(-1), max=math.log(100)).exp()
            logits = torch.einsum("hd,nhd->hn", torch.nn.functional.normalize(qp, dim=-1), torch.nn.functional.normalize(kt, dim=-1)) * scale[:, None]
        else:
            logits = torch.einsum("hd,nhd->hn", qp, kt) * d**-0.5
        idx = [(p0 - pos[kk][0] + Wh - 1) * (2 * Ww - 1) + (p1 - pos[kk][1] + Ww - 1) for kk in keys]
        logits = logits + table[idx].t()
        out[p] = torch.einsum("hn,nhd->hd", logits.softmax(-1), vt).reshape(C)
    return attn.proj(out)[None]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("hw", [(10, 13), (5, 11), (3, 9), (8, 8)])
def test_padded_tokens_never_change_real_tokens(version: int, shifted: bool, hw: tuple[int, int]) -> None:
    torch.manual_seed(0)
    block = SwinBlock(8, 2, (4, 4), shifted=shifted, post_norm=version == 2).eval()
    randomize_(block)
    x = torch.randn(1, *hw, 8)
    with torch.no_grad():
        got = block._window_attention(x)
        ref = _brute_force_window_attention(block, x)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
@pytest.mark.parametrize("shape", [(1, 3, 97, 131), (2, 3, 224, 320), (1, 3, 32, 32), (1, 3, 5, 3)])
def test_any_input_size(name: str, shape: tuple[int, ...]) -> None:
    model = vtdense.create_backbone(name, **{**TINY, "window_size": 7}).eval()
    with torch.no_grad():
        out = model(torch.randn(shape))
    assert list(out) == model.out_names
    for (k, f), c, s in zip(out.items(), model.out_channels, model.out_strides):
        assert f.shape == (shape[0], c, math.ceil(shape[2] / s), math.ceil(shape[3] / s)), k
        assert torch.isfinite(f).all()


def test_shapes_channels_strides_for_every_registered_name() -> None:
    names = [n for n in vtdense.list_backbones() if n.startswith("swin")]
    assert len(names) == 8
    widths = {"tiny": 96, "small": 96, "base": 128, "large": 192}
    for name in names:
        with torch.device("meta"):
            model = vtdense.create_backbone(name)
            out = model(torch.empty(1, 3, 64, 96))
        w = widths[name.split("_")[1]]
        assert model.out_channels == [w, 2 * w, 4 * w, 8 * w]
        assert model.out_strides == [4, 8, 16, 32]
        assert model.size_divisibility == 32
        assert model.window_size == ((7, 7) if name.startswith("swin_") else (8, 8))
        assert [tuple(f.shape) for f in out.values()] == [(1, c, 64 // s, 96 // s) for c, s in zip(model.out_channels, model.out_strides)]
    depths = {n: [len(s.blocks) for s in vtdense.create_backbone(n, **({"embed_dim": 8, "num_heads": (1, 1, 1, 1)})).layers] for n in ("swin_tiny", "swin_small")}
    assert depths == {"swin_tiny": [2, 2, 6, 2], "swin_small": [2, 2, 18, 2]}


def test_overrides_out_indices_out_norm_window_tuple() -> None:
    model = vtdense.create_backbone("swinv2_tiny", **{**TINY, "window_size": (4, 6)}, out_indices=(1, 3), pretrained_window_size=3)
    assert model.out_names == ["stage2", "stage4"] and model.out_channels == [32, 128] and model.out_strides == [8, 32]
    out = model(torch.randn(1, 3, 64, 64))
    assert list(out) == ["stage2", "stage4"]
    n_norm = sum(p.numel() for p in model.parameters())
    n_plain = sum(p.numel() for p in vtdense.create_backbone("swinv2_tiny", **{**TINY, "window_size": (4, 6)}, out_indices=(1, 3), out_norm=False).parameters())
    assert n_norm - n_plain == 2 * (32 + 128)
    # pretrained_window_size changes the Log-CPB coordinate normalisation
    a = vtdense.create_backbone("swinv2_tiny", **TINY).layers[0].blocks[0].attn.relative_coords_table
    b = vtdense.create_backbone("swinv2_tiny", **TINY, pretrained_window_size=2).layers[0].blocks[0].attn.relative_coords_table
    assert a.abs().max() == pytest.approx(math.log2(9) / 3) and b.abs().max() > a.abs().max()


def test_small_maps_shrink_the_window_and_drop_the_shift() -> None:
    assert effective_window((3, 20), (7, 7), (3, 3)) == ((3, 7), (0, 3))
    assert effective_window((7, 7), (7, 7), (3, 3)) == ((7, 7), (0, 0))
    # a map smaller than the window: one window covering it, i.e. plain global attention
    torch.manual_seed(0)
    block = SwinBlock(8, 2, (7, 7), shifted=True).eval()
    x = torch.randn(1, 5, 6, 8)
    with torch.no_grad():
        got = block._window_attention(x)
        ref = _brute_force_window_attention(block, x)
    assert torch.allclose(got, ref, atol=1e-5)


def test_masks_are_cached_per_size() -> None:
    a = window_attention_mask(25, 30, (7, 7), (3, 3), "cpu")
    b = window_attention_mask(25, 30, (7, 7), (3, 3), "cpu")
    assert a is b and a.shape == (4 * 5, 49, 49) and a.dtype == torch.bool
    assert window_attention_mask(28, 28, (7, 7), (0, 0), "cpu") is None  # nothing to mask


def test_gradient_checkpointing_gives_same_gradients() -> None:
    torch.manual_seed(0)
    model = vtdense.create_backbone("swinv2_tiny", **TINY, drop_path_rate=0.0)
    ckpt = vtdense.create_backbone("swinv2_tiny", **TINY, drop_path_rate=0.0, grad_checkpointing=True)
    ckpt.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 70, 90)
    grads = []
    for m in (model, ckpt):
        m.zero_grad()
        probe_loss(m(x)).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
def test_trains_under_bf16_autocast(name: str) -> None:
    """bf16 autocast at an odd size (padding, shifted windows): the gradients point where float32's
    do (a fused backward returning zeros or the wrong branch's gradient gives a cosine far below)."""
    torch.manual_seed(0)
    model = randomize_(vtdense.create_backbone(name, **TINY, drop_path_rate=0.0), std=0.1)
    x = torch.randn(1, 3, 60, 44)
    grads = []
    for bf16 in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        assert {f.dtype for f in out.values()} == {torch.bfloat16 if bf16 else torch.float32}
        probe_loss(out).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.isfinite(grads[1]).all()
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99


def test_bad_input_gives_clear_errors() -> None:
    model = vtdense.create_backbone("swin_tiny", **TINY)
    with pytest.raises(ValueError, match="in_chans=3 but the input has 1 channels"):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match="NCHW batch"):
        model(torch.randn(3, 64, 64))
    with pytest.raises(TypeError, match="floating point"):
        model(torch.zeros(1, 3, 64, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"unknown backbone 'swin_huge'; known backbones: .*swin_base.*swinv2_tiny"):
        vtdense.create_backbone("swin_huge")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windowsize'\]"):
        vtdense.create_backbone("swin_tiny", windowsize=12)
    with pytest.raises(ValueError, match="out_indices"):
        vtdense.create_backbone("swin_tiny", out_indices=(4,))
    with pytest.raises(ValueError, match="window_size"):
        vtdense.create_backbone("swin_tiny", window_size=(7, 7, 7))
    # in_chans override
    assert vtdense.create_backbone("swin_tiny", **TINY, in_chans=1)(torch.randn(1, 1, 32, 32))["stage1"].shape[1] == 16


def test_public_api() -> None:
    assert isinstance(vtdense.__version__, str)
    assert isinstance(vtdense.create_backbone("swin_tiny", **TINY), (SwinTransformer, vtdense.Backbone))
    # as timm: V1's table, V2's Log-CPB MLP (weights included) and logit scale get no weight decay
    assert vtdense.create_backbone("swin_tiny", **TINY).no_weight_decay() == {"relative_position_bias_table", "cpb_mlp", "logit_scale"}


def test_save_and_load_backbone_round_trip(tmp_path) -> None:
    model = vtdense.create_backbone("swinv2_tiny", **TINY).eval()
    path = vtdense.save_backbone(model, tmp_path / "bb.pth")
    again = vtdense.load_backbone(path).eval()
    x = torch.randn(1, 3, 40, 56)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x).values(), again(x).values()))
    # fine-tune at a larger window from the same file (V2: Log-CPB needs no resizing)
    wider = vtdense.load_backbone(path, window_size=8, pretrained_window_size=4)
    assert wider.window_size == (8, 8)
    with pytest.raises(CheckpointError, match="save_backbone"):
        torch.save(model.state_dict(), tmp_path / "plain.pth")
        vtdense.load_backbone(tmp_path / "plain.pth")


def test_v2_extra_main_branch_norm_every_n_blocks() -> None:
    plain = vtdense.create_backbone("swinv2_tiny", **{**TINY, "depths": (2, 2, 6, 2)})
    model = vtdense.create_backbone("swinv2_tiny", **{**TINY, "depths": (2, 2, 6, 2)}, extra_norm_every=3)
    with_norm = [(i, j) for i, s in enumerate(model.layers) for j, b in enumerate(s.blocks) if b.norm3 is not None]
    assert with_norm == [(2, 2), (2, 5)]
    assert all(b.norm3 is None for s in plain.layers for b in s.blocks)
    # the extra norm really sits on the main branch: its output is normalised per token
    block = model.layers[2].blocks[2].eval()
    with torch.no_grad():
        y = block(torch.randn(1, 6, 6, 64) * 5)
    assert torch.allclose(y.mean(-1), torch.zeros(1, 6, 6), atol=1e-5)
    assert torch.allclose(y.std(-1, unbiased=False), torch.ones(1, 6, 6), atol=1e-3)
