"""Weights by name: Hub ids resolved through huggingface_hub from a local cache, offline.

Every entry point that takes weights is exercised with the same fake repo: ``create_backbone
(pretrained=)``, ``load_pretrained``, ``build_detector(backbone_weights=)``, ``build_segmentor
(backbone_weights=)``, SMP's ``encoder_weights`` and the tasks' ``backbone_weights``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import segmentation_models_pytorch as smp
import timm
import torch

import vtdense
from vtdense import CheckpointError
from vtdense.checkpoints.hub import _split, is_hub_id, window_from_hub_config
from vtdense.models.detection import build_detector
from vtdense.models.segmentation import build_segmentor, encoder_options

from hub_cache import hub_cache  # noqa: F401  (fixture)
from test_swin import randomize_

TINY = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=7)
REPO = "timm/swin_tiny_patch4_window7_224.ms_in1k"


@pytest.fixture
def timm_repo(hub_cache):  # noqa: F811
    """A timm-style repo (classification state dict with head, safetensors + config.json)."""
    from timm.models.swin_transformer import SwinTransformer

    ref = randomize_(SwinTransformer(img_size=224, num_classes=5, **TINY), seed=7).eval()
    sd = ref.state_dict()
    config = {"architecture": "swin_tiny_patch4_window7_224", "num_classes": 5, "pretrained_cfg": {"input_size": [3, 224, 224]}}
    hub_cache(REPO, {"model.safetensors": sd, "config.json": config})
    return sd


def _assert_backbone_has(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    checked = 0
    for k, v in sd.items():
        if k in own:
            assert torch.equal(own[k], v), k
            checked += 1
    assert checked > 50


def test_create_backbone_and_load_pretrained_by_hub_id(timm_repo) -> None:
    model = vtdense.create_backbone("swin_tiny", pretrained=REPO, **TINY)
    _assert_backbone_has(model, timm_repo)
    report = model.load_report
    assert report.container == "safetensors" and report.format == "timm" and report.source == REPO
    assert {k for k, _ in report.dropped} == {"head.fc.weight", "head.fc.bias", "norm.weight", "norm.bias"}
    assert report.source_window == (7, 7)  # from config.json's architecture
    # the same through load_pretrained, with timm's hf-hub: prefix
    again = vtdense.create_backbone("swin_tiny", **TINY)
    missing, unexpected = vtdense.load_pretrained(again, "hf-hub:" + REPO)
    assert unexpected == [] and all(k.startswith("out_norms.") for k in missing)
    _assert_backbone_has(again, timm_repo)


def test_bin_fallback_revision_and_explicit_file(hub_cache) -> None:  # noqa: F811
    src = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=1)
    hub_cache("me/bin_only", {"pytorch_model.bin": src.state_dict()})
    _assert_backbone_has(vtdense.create_backbone("swin_tiny", pretrained="me/bin_only", **TINY), src.state_dict())
    other = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=2)
    hub_cache("me/bin_only", {"weights/v2.pth": {"model": other.state_dict()}}, revision="v2")
    got = vtdense.create_backbone("swin_tiny", pretrained="hf-hub:me/bin_only@v2/weights/v2.pth", **TINY)
    _assert_backbone_has(got, other.state_dict())


def test_a_pull_request_revision_keeps_its_slashes(hub_cache) -> None:  # noqa: F811
    """``org/repo@refs/pr/3`` is the Hub's pull-request 3, not revision ``refs`` and file ``pr/3``."""
    main = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=3)
    pr = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=4)
    hub_cache("me/prs", {"model.safetensors": main.state_dict()})
    hub_cache("me/prs", {"model.safetensors": pr.state_dict(), "sub/w.pth": {"model": main.state_dict()}}, revision="refs/pr/3")
    _assert_backbone_has(vtdense.create_backbone("swin_tiny", pretrained="me/prs@refs/pr/3", **TINY), pr.state_dict())
    got = vtdense.create_backbone("swin_tiny", pretrained="hf-hub:me/prs@refs/pr/3/sub/w.pth", **TINY)
    _assert_backbone_has(got, main.state_dict())
    with pytest.raises(CheckpointError, match="refs/pr.*incomplete"):
        vtdense.create_backbone("swin_tiny", pretrained="hf-hub:me/prs@refs/pr", **TINY)
    # huggingface_hub's own hf:// spelling of the revision; a branch named "refs" is still one
    got = vtdense.create_backbone("swin_tiny", pretrained="hf://me/prs@refs%2Fpr%2F3", **TINY)
    _assert_backbone_has(got, pr.state_dict())
    assert _split("hf-hub:me/prs@refs/model.safetensors") == ("me/prs", "refs", "model.safetensors")
    assert _split("me/data@refs/convert/parquet") == ("me/data", "refs/convert/parquet", None)


def test_safetensors_preferred_and_config_read_at_the_same_revision(hub_cache) -> None:  # noqa: F811
    """A repo with both ``model.safetensors`` and ``pytorch_model.bin`` (different weights here):
    the safetensors file is read. ``config.json`` comes from the revision the weights came from
    (its window differs between the two revisions), and is kept as the report's source config."""
    a = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=3)
    b = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=4)
    main_cfg = {"architecture": "swin_tiny_patch4_window7_224"}
    v2_cfg = {"architecture": "swin_tiny_patch4_window12_224"}
    hub_cache("me/both", {"model.safetensors": a.state_dict(), "pytorch_model.bin": b.state_dict(), "config.json": main_cfg})
    hub_cache("me/both", {"model.safetensors": b.state_dict(), "config.json": v2_cfg}, revision="v2")
    model = vtdense.create_backbone("swin_tiny", pretrained="me/both", **TINY)
    _assert_backbone_has(model, a.state_dict())
    report = model.load_report
    assert report.container == "safetensors" and report.source_config == main_cfg and report.source_window == (7, 7)
    model = vtdense.create_backbone("swin_tiny", pretrained="me/both@v2", **TINY)
    _assert_backbone_has(model, b.state_dict())
    assert model.load_report.source_config == v2_cfg and model.load_report.source_window == (12, 12)


def test_local_paths_and_ids_that_cannot_be_fetched(hub_cache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """``~`` is the home directory (a local file); a ``PathLike`` is a local path even where its
    text could be a repo id; an id the Hub client rejects (``..`` in it) and an ``hf-hub:`` name
    without an org are one :class:`CheckpointError` naming what was given."""
    src = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=5)
    monkeypatch.setenv("HOME", str(tmp_path))
    torch.save(src.state_dict(), tmp_path / "w.pth")
    _assert_backbone_has(vtdense.create_backbone("swin_tiny", pretrained="~/w.pth", **TINY), src.state_dict())
    model = vtdense.create_backbone("swin_tiny", **TINY)
    with pytest.raises(CheckpointError, match="checkpoint file not found: org/repo"):
        vtdense.load_pretrained(model, Path("org/repo"))
    with pytest.raises(CheckpointError, match=r"cannot fetch Hub checkpoint 'org/bad\.\.name' \(repo org/bad\.\.name\): HFValidationError"):
        vtdense.load_pretrained(model, "org/bad..name")
    with pytest.raises(CheckpointError, match=r"'justaname' is not a Hugging Face Hub id \(expected org/repo\)"):
        vtdense.load_pretrained(model, "hf-hub:justaname")
    assert window_from_hub_config({"model_name": "swin_base_patch4_window12_384"}) == 12
    assert window_from_hub_config({"architecture": "resnet50"}) is None


def test_missing_from_offline_cache_is_one_clear_error(hub_cache, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(CheckpointError, match=r"timm/not_cached.*model.safetensors, pytorch_model.bin.*HF_HUB_OFFLINE=1"):
        vtdense.create_backbone("swin_tiny", pretrained="timm/not_cached", **TINY)
    with pytest.raises(CheckpointError, match="checkpoint file not found: weights/nope.pth"):
        vtdense.create_backbone("swin_tiny", pretrained="weights/nope.pth", **TINY)
    with pytest.raises(CheckpointError, match=r"timm/swin_tiny_patch4_window7_224\.ms_in1k.*HF_HUB_OFFLINE=1"):
        vtdense.create_backbone("swin_tiny", pretrained=True, **TINY)  # the default weights, not in this cache
    # a local file is used as is, even where its name could be a repo id
    local = tmp_path / "org" / "repo"
    local.parent.mkdir()
    src = vtdense.create_backbone("swin_tiny", **TINY)
    torch.save(src.state_dict(), local)
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        _assert_backbone_has(vtdense.create_backbone("swin_tiny", pretrained="org/repo", **TINY), src.state_dict())
    finally:
        os.chdir(cwd)
    assert is_hub_id("timm/x.y") and not is_hub_id("./x/y") and not is_hub_id("a/b/c") and not is_hub_id("a/b.pth")
    assert window_from_hub_config({"architecture": "swinv2_base_window12to24_192to384"}) == 24


def test_detector_segmentor_and_smp_encoder_weights_by_hub_id(timm_repo) -> None:
    det = build_detector("swin_tiny", "retinanet", 2, fpn_channels=32, backbone_kwargs=TINY, backbone_weights=REPO)
    _assert_backbone_has(det.backbone.body, timm_repo)
    assert det.backbone.body.load_report.format == "timm"
    seg = build_segmentor("upernet", "swin_tiny", 3, backbone_kwargs=TINY, backbone_weights=REPO, decoder_channels=16)
    _assert_backbone_has(seg.encoder.backbone, timm_repo)
    with encoder_options(**TINY):  # SMP downloads model.safetensors itself and calls encoder.load_state_dict
        model = smp.UPerNet(encoder_name="vtdense-swin_tiny", encoder_weights=REPO, classes=3, decoder_channels=16)
    _assert_backbone_has(model.encoder.backbone, timm_repo)
    assert model.encoder.load_report.format == "timm"
    with pytest.raises(ValueError, match="only model.safetensors"):
        with encoder_options(**TINY):
            smp.UPerNet(encoder_name="vtdense-swin_tiny", encoder_weights="hf-hub:timm/x/other.pth")
    # the encoder's own state dict still loads natively
    model.encoder.load_state_dict(model.encoder.state_dict())


def test_task_backbone_weights_by_hub_id(timm_repo) -> None:
    from vtdense.tasks.detection import DetectionTask

    task = DetectionTask(
        backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, backbone_weights=REPO, head="retinanet", fpn_channels=32
    )
    task.setup("fit")
    _assert_backbone_has(task.model.backbone.body, timm_repo)


def test_swinv2_hub_checkpoint_gets_the_log_cpb_windows_it_was_trained_with(hub_cache) -> None:  # noqa: F811
    """timm builds ``swinv2_*_window12to16_192to256`` with ``pretrained_window_sizes=(12, 12, 12, 6)``
    (its window-12 pre-training at 192 px shrank the last stage's window to 6). Loaded by Hub id
    into a Swin V2 given no ``pretrained_window_size``, vtdense takes those from the name and
    equals timm; an explicit 0 keeps 0 (then the features differ) and the report says what to
    pass. A plain ``window16_256`` checkpoint fine-tuned at window 24 gets (16, 16, 16, 8)."""
    small = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))
    ref = randomize_(timm.create_model("swinv2_base_window12to16_192to256", pretrained=False, num_classes=0, **small), seed=3, std=0.3).eval()
    repo = "timm/swinv2_base_window12to16_192to256.ms_in22k_ft_in1k"
    hub_cache(repo, {"model.safetensors": ref.state_dict(), "config.json": {"architecture": "swinv2_base_window12to16_192to256"}})
    x = torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(0))  # not the global stream: the tests before it move that
    with torch.no_grad():
        expected = ref.forward_intermediates(x, intermediates_only=True)
    ours = vtdense.create_backbone("swinv2_base", window_size=16, out_norm=False, pretrained=repo, **small).eval()
    assert [s.blocks[0].attn.pretrained_window_size for s in ours.layers] == [(12, 12)] * 3 + [(6, 6)]
    assert ours.config["pretrained_window_size"] == [[12, 12]] * 3 + [[6, 6]]
    assert ours.load_report.notes == ["pretrained_window_size=(12, 12, 12, 6) set from the checkpoint (pass pretrained_window_size to choose another)"]
    with torch.no_grad():
        for want, got in zip(expected, ours(x).values()):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    zero = vtdense.create_backbone("swinv2_base", window_size=16, pretrained_window_size=0, out_norm=False, pretrained=repo, **small).eval()
    assert "pass pretrained_window_size=(12, 12, 12, 6)" in zero.load_report.notes[0]
    with torch.no_grad():
        assert (zero(x)["stage1"] - expected[0]).abs().max() > 1e-3
    wider = vtdense.create_backbone("swinv2_base", window_size=24, pretrained_window_size=16, **small)
    assert "pass pretrained_window_size=(12, 12, 12, 6)" in vtdense.load_pretrained(wider, repo).notes[0]

    plain = "timm/swinv2_tiny_window16_256.ms_in1k"
    hub_cache(plain, {"model.safetensors": vtdense.create_backbone("swinv2_tiny", window_size=16, **small).state_dict(),
                      "config.json": {"architecture": "swinv2_tiny_window16_256"}})
    same = vtdense.create_backbone("swinv2_tiny", window_size=16, pretrained=plain, **small)
    assert "pretrained_window_size" not in same.config and same.load_report.notes == []
    larger = vtdense.create_backbone("swinv2_tiny", window_size=24, pretrained=plain, **small)
    assert larger.config["pretrained_window_size"] == [[16, 16]] * 3 + [[8, 8]]
    assert "normalised by pretrained_window_size=(16, 16, 16, 8)" in larger.load_report.notes[-1]


def test_pretrained_true_loads_timms_default_weights(hub_cache) -> None:  # noqa: F811
    """``pretrained=True`` fetches :data:`DEFAULT_WEIGHTS` (here from the offline cache)."""
    src = randomize_(vtdense.create_backbone("swin_tiny", **TINY), seed=7)
    hub_cache("timm/swin_tiny_patch4_window7_224.ms_in1k", {"model.safetensors": src.state_dict()})
    model = vtdense.create_backbone("swin_tiny", pretrained=True, **TINY)
    _assert_backbone_has(model, src.state_dict())
    with pytest.raises(ValueError, match=r"no default weights for 'swinv2_large'.*window_size=12"):
        vtdense.create_backbone("swinv2_large", pretrained=True)


def test_default_weights_are_timms_defaults_and_fit_the_default_backbones() -> None:
    """Every :data:`DEFAULT_WEIGHTS` id is timm's default tag for its network, and timm's model of it
    loads into the backbone built with the defaults (shapes checked on the meta device; only the
    detection output norms, which classification weights lack, stay missing)."""
    from timm.models import get_pretrained_cfg

    from vtdense.backbones.registry import DEFAULT_WEIGHTS

    assert set(DEFAULT_WEIGHTS) == set(vtdense.list_backbones()) - {"swinv2_large"}
    for name, hub_id in DEFAULT_WEIGHTS.items():
        arch = hub_id.split("/")[1].split(".")[0]
        assert get_pretrained_cfg(arch).hf_hub_id == hub_id, name
        with torch.device("meta"):
            reference = timm.create_model(arch, pretrained=False)
            ours = vtdense.create_backbone(name)
        report = vtdense.load_pretrained(ours, reference.state_dict())
        assert not report.unexpected and all(k.startswith("out_norms.") for k in report.missing), (name, report.missing)
