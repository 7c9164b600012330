"""Checkpoint containers and layouts: detectron2 pickles (and refusing unsafe ones), safetensors
save/load with the config in the metadata, format detection and the load report."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torchvision

import vtdense
from vtdense import CheckpointError
from vtdense.checkpoints.convert import detect_format

from hub_cache import hub_cache  # noqa: F401  (fixture)
from test_mvitv2 import to_flat
from test_swin import randomize_

SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)
MVIT = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=1)


def _write_d2_pickle(path: Path, sd: dict[str, torch.Tensor]) -> None:
    """detectron2 model-zoo layout: numpy arrays under ``model``, plus ``__author__``."""
    blob = {"model": {k: v.numpy() for k, v in sd.items()}, "__author__": "Detectron2 Model Zoo", "matching_heuristics": True}
    with path.open("wb") as f:
        pickle.dump(blob, f, protocol=2)


def _swin_to_d2(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k)  # merging ends a stage
        k = re.sub(r"^out_norms\.stage(\d)\.", lambda m: f"norm{int(m[1]) - 1}.", k)
        out["backbone.bottom_up." + k] = v
    out["backbone.fpn_lateral2.weight"] = torch.zeros(4, 4)  # neck and heads are not the backbone's
    out["roi_heads.box_predictor.cls_score.weight"] = torch.zeros(3, 4)
    return out


def _same(a: torch.nn.Module, b: torch.nn.Module, size=(1, 3, 64, 96)) -> None:
    x = torch.randn(*size)
    with torch.no_grad():
        for (k, fa), fb in zip(a.eval()(x).items(), b.eval()(x).values()):
            assert torch.equal(fa, fb), k


def test_detectron2_pickles_load_for_swin_and_mvitv2(tmp_path: Path) -> None:
    src = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=1)
    _write_d2_pickle(tmp_path / "swin.pkl", _swin_to_d2(src.state_dict()))
    dst = vtdense.create_backbone("swin_tiny", **SWIN)
    report = vtdense.load_pretrained(dst, tmp_path / "swin.pkl")
    assert report == ([], []) and report.container == "detectron2-pkl" and report.format == "detectron2"
    assert {k for k, _ in report.dropped} == {"backbone.fpn_lateral2.weight", "roi_heads.box_predictor.cls_score.weight"}
    assert ("backbone.bottom_up.layers.0.downsample.reduction.weight", "layers.1.downsample.reduction.weight") in report.loaded
    _same(src, dst)

    src = randomize_(vtdense.create_backbone("mvitv2_tiny", **MVIT), seed=2)
    sd = src.state_dict()
    flat = to_flat({k: v for k, v in sd.items() if not k.startswith("out_norms.")}, src.depths, True)
    d2 = {f"backbone.bottom_up.{k}": v for k, v in flat.items()}
    d2.update({f"backbone.bottom_up.scale{i + 2}_norm.{p}": sd[f"out_norms.stage{i + 1}.{p}"] for i in range(4) for p in ("weight", "bias")})
    _write_d2_pickle(tmp_path / "model_final.pkl", d2)
    dst = vtdense.create_backbone("mvitv2_tiny", **MVIT)
    report = vtdense.load_pretrained(dst, str(tmp_path / "model_final.pkl"))
    assert report == ([], []) and report.format == "detectron2"
    _same(src, dst)


class _Payload:
    """Pickles as a call to os.system: what an attacker would hide in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["evil.pkl", "evil.pth"])
def test_pickle_with_a_payload_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "PWNED"
    blob = {"model": {"w": np.zeros(3, dtype=np.float32), "x": _Payload(marker)}, "__author__": "x"}
    path = tmp_path / name
    path.write_bytes(pickle.dumps(blob, protocol=2))
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as err:
        vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **SWIN), path)
    if name.endswith(".pkl"):
        assert re.search(r"refused to unpickle (posix|os|nt)\.system", str(err.value))
    assert not marker.exists()
    pickle.loads(pickle.dumps(blob["model"]["w"]))  # sanity: the array part alone is fine


def test_save_backbone_writes_safetensors_with_config_and_old_files_still_load(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = randomize_(vtdense.create_backbone("swinv2_tiny", **SWIN), seed=3)
    path = vtdense.save_backbone(model, tmp_path / "bb.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(model.state_dict())
    assert json.loads(meta["vtdense_backbone"]) == json.loads(json.dumps({"name": "swinv2_tiny", **SWIN}))
    again = vtdense.load_backbone(path)
    assert again.load_report.container == "safetensors" and again.load_report.format == "vtdense"
    _same(model, again)
    # the torch.save files of earlier vtdense versions
    old = tmp_path / "old.pth"
    torch.save({"vtdense_backbone": {"name": "swinv2_tiny", **SWIN}, "state_dict": model.state_dict()}, old)
    _same(model, vtdense.load_backbone(old))
    with pytest.raises(CheckpointError, match="save_backbone"):
        torch.save(model.state_dict(), tmp_path / "plain.pth")
        vtdense.load_backbone(tmp_path / "plain.pth")
    with pytest.raises(ValueError, match="JSON"):
        bad = vtdense.create_backbone("swin_tiny", **SWIN)
        bad.config["window_size"] = object()
        vtdense.save_backbone(bad, tmp_path / "bad.safetensors")


def test_larger_window_reports_why(tmp_path: Path, hub_cache) -> None:  # noqa: F811
    v2 = vtdense.save_backbone(randomize_(vtdense.create_backbone("swinv2_tiny", **SWIN), seed=4), tmp_path / "v2.safetensors")
    wide = vtdense.load_backbone(v2, window_size=8)  # V2: pretrained window set from the file
    assert {m.pretrained_window_size for m in wide.modules() if hasattr(m, "cpb_mlp")} == {(4, 4)}
    assert any("normalised by pretrained_window_size=4" in n for n in wide.load_report.notes)
    plain = vtdense.create_backbone("swinv2_tiny", **{**SWIN, "window_size": 8})
    report = vtdense.load_pretrained(plain, v2)
    assert any("pass pretrained_window_size=4" in n for n in report.notes)
    assert "pass pretrained_window_size=4" in str(report)
    # V1: bias tables resized, each listed with the reason
    v1 = vtdense.save_backbone(vtdense.create_backbone("swin_tiny", **SWIN), tmp_path / "v1.safetensors")
    report = vtdense.load_backbone(v1, window_size=6).load_report
    assert len(report.resized) == sum(SWIN["depths"])
    key, old, new, why = report.resized[0]
    assert key.endswith("relative_position_bias_table") and old == (49, 1) and new == (121, 1) and "bicubic" in why
    assert "resized layers.*.blocks.*.attn.relative_position_bias_table" in str(report)
    # MViTv2 tables resampled for another img_size
    mv = vtdense.save_backbone(vtdense.create_backbone("mvitv2_tiny", **MVIT), tmp_path / "mv.safetensors")
    report = vtdense.load_backbone(mv, img_size=448).load_report
    assert report.resized and all("rel-pos" in why for *_, why in report.resized)
    # and a vtdense file from the Hub
    hub_cache("me/vt", {"model.safetensors": v2.read_bytes()})
    _same(vtdense.load_backbone(v2), vtdense.load_backbone("me/vt"))


def test_format_detection() -> None:
    from timm.models.swin_transformer import SwinTransformer as TimmSwin

    cfg = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=7)
    timm_sd = TimmSwin(img_size=224, num_classes=3, **cfg).state_dict()
    official = {re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k): v for k, v in timm_sd.items()}
    feats = timm.create_model("swin_tiny_patch4_window7_224", features_only=True, pretrained=False, **cfg).state_dict()
    cases = {"timm": timm_sd, "official": {"model": official}, "timm features_only": feats}
    for expected, sd in cases.items():
        report = vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **cfg), sd)
        assert report.format == expected
    with torch.device("meta"):  # key names suffice (loading torchvision layouts: tests/test_swin.py)
        tv = torchvision.models.swin_t().state_dict()
        assert detect_format(tv, vtdense.create_backbone("swin_tiny")) == "torchvision"
    own = vtdense.create_backbone("swin_tiny", **cfg)
    assert vtdense.load_pretrained(own, own.state_dict()).format == "vtdense"
    mv = vtdense.create_backbone("mvitv2_tiny", **MVIT)
    flat = to_flat({k: v for k, v in mv.state_dict().items() if not k.startswith("out_norms.")}, mv.depths, True)
    assert vtdense.load_pretrained(mv, {"model_state": flat}).format == "mvit (original)"
