"""vtdense backbones as SMP encoders: registration, the encoder contract, UPerNet / FPN, options and weights."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict

import pytest
import segmentation_models_pytorch as smp
import torch
from segmentation_models_pytorch.encoders import encoders as smp_encoders
from segmentation_models_pytorch.encoders import get_encoder
from torch import nn

import vtdense
from vtdense.backbones import registry
from vtdense.backbones.base import Backbone
from vtdense.models.segmentation import (
    ARCHITECTURES,
    VtdenseEncoder,
    build_segmentor,
    encoder_options,
    register_smp_encoders,
)

# Small configs per family so the tests stay cheap; a family without an entry runs its default.
TINY: dict[str, dict] = {
    "swin": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2": dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), window_size=4),
    "mvitv2": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1),
}


def _family(name: str) -> str:
    return name.rsplit("_", 1)[0]


FAMILIES = sorted({_family(n): n for n in vtdense.list_backbones()}.items())


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.manual_seed(0)


def test_every_backbone_is_an_smp_encoder() -> None:
    names = register_smp_encoders()
    assert sorted(names) == sorted(f"vtdense-{n}" for n in vtdense.list_backbones())
    assert len(names) >= 8
    for name in names:
        assert name in smp.encoders.get_encoder_names()
        assert smp_encoders[name]["encoder"] is VtdenseEncoder


def test_import_vtdense_registers_the_encoders() -> None:
    # a fresh interpreter: ``import vtdense`` alone must make every vtdense-* encoder known to SMP
    code = (
        "import vtdense, segmentation_models_pytorch as smp\n"
        "missing = [n for n in vtdense.list_backbones() if 'vtdense-' + n not in smp.encoders.get_encoder_names()]\n"
        "assert not missing, missing\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


class _ConvPyramid(Backbone):
    """A stand-in backbone registered after import, to check late registration."""

    def __init__(self, in_chans: int = 3) -> None:
        super().__init__()
        self.in_chans = in_chans
        self.out_names = ["a", "b", "c", "d"]
        self.out_channels = [4, 8, 8, 16]
        self.out_strides = [4, 8, 16, 32]
        self.convs = nn.ModuleList(
            [nn.Conv2d(in_chans, 4, 4, 4), nn.Conv2d(4, 8, 2, 2), nn.Conv2d(8, 8, 2, 2), nn.Conv2d(8, 16, 2, 2)]
        )

    def forward(self, x: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        out = OrderedDict()
        for n, conv in zip(self.out_names, self.convs):
            x = conv(x)
            out[n] = x
        return out


def test_backbones_registered_later_are_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._BACKBONES, "zz_late_test", lambda **kw: _ConvPyramid(**kw))
    monkeypatch.delitem(smp_encoders, "vtdense-zz_late_test", raising=False)
    try:
        # build_segmentor registers what is missing on its own
        model = build_segmentor("upernet", "zz_late_test", 3, decoder_channels=8).eval()
        assert "vtdense-zz_late_test" in smp_encoders
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3, 64, 64)
    finally:
        smp_encoders.pop("vtdense-zz_late_test", None)


@pytest.mark.parametrize("family,name", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_encoder_contract(family: str, name: str) -> None:
    register_smp_encoders()
    with encoder_options(**TINY.get(family, {})):
        enc = get_encoder(f"vtdense-{name}", in_channels=3, depth=5, weights=None)
    bb = enc.backbone
    assert enc.out_channels == [3, 0, *bb.out_channels]
    assert enc.output_stride == 32
    x = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        feats = enc(x)
    assert len(feats) == 6
    assert feats[0] is x
    assert [f.shape[1] for f in feats] == enc.out_channels
    assert [tuple(f.shape[-2:]) for f in feats] == [(96 // s, 160 // s) for s in (1, 2, 4, 8, 16, 32)]


@pytest.mark.parametrize("family,name", FAMILIES, ids=[f for f, _ in FAMILIES])
@pytest.mark.parametrize("arch", ["upernet", "fpn"])
def test_upernet_fpn_forward_non_square(family: str, name: str, arch: str) -> None:
    register_smp_encoders()
    cls = {"upernet": smp.UPerNet, "fpn": smp.FPN}[arch]
    kwargs = {"decoder_channels": 16} if arch == "upernet" else {"decoder_pyramid_channels": 16, "decoder_segmentation_channels": 32}
    with encoder_options(**TINY.get(family, {})):
        model = cls(encoder_name=f"vtdense-{name}", encoder_weights=None, classes=5, **kwargs).eval()
    with torch.no_grad():
        y = model(torch.randn(1, 3, 96, 160))
    assert y.shape == (1, 5, 96, 160)
    assert torch.isfinite(y).all()


def test_encoder_depth_and_options_reach_the_backbone() -> None:
    model = build_segmentor(
        "upernet",
        "swinv2_tiny",
        4,
        backbone_kwargs={**TINY["swinv2"], "window_size": 2, "drop_path_rate": 0.2},
        encoder_depth=4,
        decoder_channels=16,
    ).eval()
    enc = model.encoder
    assert enc.backbone.window_size == (2, 2)
    assert enc.out_channels == [3, 0, 32, 64, 128]
    assert len(enc.backbone.layers) == 3  # the unused stage 4 is not built
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 96)).shape == (1, 4, 64, 96)
    # the context manager does not leak
    plain = build_segmentor("upernet", "swinv2_tiny", 4, backbone_kwargs=TINY["swinv2"], decoder_channels=16)
    assert plain.encoder.backbone.window_size == (4, 4)


def test_in_channels_rebuilds_the_backbone() -> None:
    model = build_segmentor("fpn", "swin_tiny", 2, backbone_kwargs=TINY["swin"], in_channels=4, decoder_pyramid_channels=16)
    assert model.encoder.out_channels[0] == 4
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 4, 64, 64)).shape == (1, 2, 64, 64)


@pytest.mark.parametrize("in_channels", [1, 4])
def test_in_channels_keeps_loaded_weights_and_adapts_the_patch_embedding_as_smp(tmp_path, in_channels: int) -> None:  # noqa: ANN001
    """``in_channels`` != 3 keeps the weights already loaded (``backbone_weights``, or what SMP loads
    from ``encoder_weights`` before it calls ``set_in_channels``), with the patch embedding adapted
    as SMP's ``patch_first_conv`` adapts a first conv."""
    import copy

    from segmentation_models_pytorch.encoders._utils import patch_first_conv

    from vtdense.models.segmentation import VtdenseEncoder

    src = vtdense.create_backbone("mvitv2_tiny", **TINY["mvitv2"])
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    want = copy.deepcopy(src)
    patch_first_conv(want, in_channels, pretrained=True)
    expected = want.state_dict()
    path = tmp_path / "bb.pth"
    torch.save(src.state_dict(), path)
    model = build_segmentor("upernet", "mvitv2_tiny", 3, backbone_kwargs=TINY["mvitv2"], backbone_weights=str(path),
                            in_channels=in_channels, decoder_channels=16)
    smp_path = VtdenseEncoder("mvitv2_tiny", **TINY["mvitv2"])
    smp_path.load_state_dict(src.state_dict())  # SMP's encoder_weights: loaded, then set_in_channels(pretrained=True)
    smp_path.set_in_channels(in_channels, pretrained=True)
    for encoder in (model.encoder, smp_path):
        got = encoder.backbone.state_dict()
        assert got["patch_embed.proj.weight"].shape[1] == in_channels
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, msg=k)
    with torch.no_grad():
        assert model.eval()(torch.randn(1, in_channels, 64, 64)).shape == (1, 3, 64, 64)
    fresh = VtdenseEncoder("mvitv2_tiny", **TINY["mvitv2"])
    fresh.set_in_channels(in_channels, pretrained=False)  # nothing loaded: a new random backbone
    assert fresh.backbone.state_dict()["patch_embed.proj.weight"].shape[1] == in_channels


def test_local_weights_are_loaded(tmp_path) -> None:
    src = vtdense.create_backbone("swinv2_tiny", **TINY["swinv2"])
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.5)
    path = tmp_path / "bb.pth"
    torch.save(src.state_dict(), path)
    model = build_segmentor("upernet", "swinv2_tiny", 3, backbone_kwargs=TINY["swinv2"], backbone_weights=str(path))
    for k, v in src.state_dict().items():
        torch.testing.assert_close(model.encoder.backbone.state_dict()[k], v)
    # a shallower encoder still loads the full checkpoint strictly
    shallow = build_segmentor(
        "upernet", "swinv2_tiny", 3, backbone_kwargs=TINY["swinv2"], backbone_weights=str(path), encoder_depth=4
    )
    assert shallow.encoder.out_channels == [3, 0, 32, 64, 128]
    # it builds the same stages as without weights (so its checkpoints reload without them)
    bare = build_segmentor("upernet", "swinv2_tiny", 3, backbone_kwargs=TINY["swinv2"], encoder_depth=4)
    assert shallow.encoder.backbone.state_dict().keys() == bare.encoder.backbone.state_dict().keys()
    assert len(shallow.encoder.backbone.layers) == 3
    for k, v in shallow.encoder.backbone.state_dict().items():
        torch.testing.assert_close(v, src.state_dict()[k])
    # the weights are still checked against the whole backbone
    torch.save({k: v for k, v in src.state_dict().items() if not k.startswith("layers.3.")}, path)
    with pytest.raises(vtdense.CheckpointError, match="missing keys.*layers.3"):
        build_segmentor("upernet", "swinv2_tiny", 3, backbone_kwargs=TINY["swinv2"], backbone_weights=str(path), encoder_depth=4)


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown segmentation arch 'nope'.*upernet"):
        build_segmentor("nope", "swinv2_tiny", 3)
    with pytest.raises(ValueError, match="unknown backbone 'nope'"):
        build_segmentor("upernet", "nope", 3)
    with pytest.raises(ValueError, match="'fpn'.*encoder_depth in 5"):
        build_segmentor("fpn", "swinv2_tiny", 3, encoder_depth=4)
    with pytest.raises(ValueError, match="encoder_weights='imagenet' is not a Hugging Face Hub id"):
        with encoder_options(**TINY["swinv2"]):
            smp.UPerNet(encoder_name="vtdense-swinv2_tiny", encoder_weights="imagenet")
    with pytest.raises(ValueError, match="fixed output strides.*encoder_output_stride=16"):
        with encoder_options(**TINY["swinv2"]):
            smp.DeepLabV3Plus(encoder_name="vtdense-swinv2_tiny", encoder_weights=None)
    assert set(ARCHITECTURES) >= {"upernet", "fpn"}
