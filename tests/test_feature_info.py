"""``Backbone.feature_info``: timm's ``features_only`` interface, with timm's own values."""

from __future__ import annotations

import pytest
import timm
import torch

import vtdense
from vtdense.backbones.base import FeatureInfo

PAIRS = [("swin_tiny", "swin_tiny_patch4_window7_224"), ("swinv2_tiny", "swinv2_tiny_window8_256"), ("mvitv2_tiny", "mvitv2_tiny"),
         ("mvitv2_large", "mvitv2_large")]


@pytest.mark.parametrize("ours, theirs", PAIRS)
@pytest.mark.parametrize("out_indices", [(0, 1, 2, 3), (1, 3), (2,)])
def test_feature_info_equals_timm_features_only(ours: str, theirs: str, out_indices: tuple[int, ...]) -> None:
    with torch.device("meta"):
        backbone = vtdense.create_backbone(ours, out_indices=out_indices)
        reference = timm.create_model(theirs, features_only=True, out_indices=out_indices, pretrained=False)
    info, ref = backbone.feature_info, reference.feature_info
    assert info.out_indices == tuple(ref.out_indices) == out_indices
    assert info.channels() == ref.channels() == backbone.out_channels
    assert info.reduction() == ref.reduction() == backbone.out_strides
    # by stage index, returned or not (the stages up to the last returned one are built)
    built = range(out_indices[-1] + 1)
    assert len(info) == len(built)
    assert info.channels(list(built)) == [ref.info[i]["num_chs"] for i in built]
    assert info.reduction(0) == 4 and info.channels(0) == ref.info[0]["num_chs"]
    assert [d["index"] for d in info.get_dicts()] == list(out_indices)
    assert info.get_dicts(keys=["num_chs"], idx=0) == {"num_chs": ref.info[0]["num_chs"]}
    assert info.from_other((0,)).channels() == [ref.info[0]["num_chs"]]
    assert isinstance(info, FeatureInfo) and info[0]["module"] == info.module_name(0)


@pytest.mark.parametrize("name", ["swin_tiny", "mvitv2_tiny"])
def test_feature_info_modules_emit_the_stage_maps(name: str) -> None:
    """A forward hook on each named module sees that stage's map (channels-last), which the
    backbone returns as NCHW (``out_norm=False``)."""
    torch.manual_seed(0)
    kw = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1)
    if name == "swin_tiny":
        kw.update(num_heads=(1, 1, 2, 2), window_size=4)
    backbone = vtdense.create_backbone(name, out_norm=False, out_indices=(1, 2, 3), **kw).eval()
    info = backbone.feature_info
    modules = dict(backbone.named_modules())
    seen: dict[str, torch.Tensor] = {}
    for m in info.module_name():
        modules[m].register_forward_hook(lambda mod, args, out, m=m: seen.__setitem__(m, out))
    with torch.no_grad():
        out = backbone(torch.randn(1, 3, 64, 96))
    assert list(seen) == info.module_name()
    for (key, fmap), m, c, s in zip(out.items(), info.module_name(), info.channels(), info.reduction()):
        assert fmap.shape[1:] == (c, 64 // s, 96 // s), key
        torch.testing.assert_close(seen[m].permute(0, 3, 1, 2), fmap, rtol=0, atol=0)


def test_a_backbone_without_stage_sizes_says_so() -> None:
    from vtdense.backbones.base import Backbone

    class Mine(Backbone):
        out_indices = (0,)

        def stage_modules(self) -> list[torch.nn.Module]:
            return []

    with pytest.raises(NotImplementedError, match="Mine sets no stage_channels / stage_strides"):
        Mine().feature_info
