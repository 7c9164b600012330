"""Prediction edge cases: predict options checked before the model runs (``--data.eval_scale``,
``--data.test_scale``, ``--output``), boxes drawn on very wide and tall images, and files that are
not checkpoints at all.

The checkpoints and photos are the fixtures of ``tests/test_predict.py`` (one-step fits of tiny models).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
from PIL import Image

from vtdense.checkpoints.io import read_task_checkpoint
from vtdense.cli import run_script
from vtdense.data.predict import segmentation_predict_transform
from vtdense.tasks.detection import DetectionTask
from vtdense.tasks.predict import read_display_image
from vtdense.tasks.segmentation import SegmentationTask

from test_predict import TINY_SWIN, _recipe, det_ckpt, photos, seg_ckpt  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _predict_cli(recipe: str, ckpt: Path, photos: Path, *options: str) -> list[str]:
    return ["predict", f"--ckpt_path={ckpt}", f"--data.predict_path={photos}", "--data.num_workers=0",
            "--progress_bar=false", *options]


def _exit_status_and_stderr(recipe: str, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """Run a recipe command as ``python recipes/<recipe>.py ...`` does (:func:`run_script`), in process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_script(lambda: _recipe(recipe).main(argv))
    return exit_.value.code, capsys.readouterr().err


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("bad", [(0, 0), (-5, 10), 64, (64, 48, 32), (64.0, 48.0), "512", ()])
def test_a_bad_eval_scale_is_one_error_naming_it(bad: Any) -> None:
    """An ``eval_scale`` that is not one or two positive ints: zero or negative sides resized every
    image to 1 x 1 (from a file) or hit a torch internal assert (from a tensor), a bare int gave
    "'int' object is not iterable"; now one ``ValueError`` naming the option and the value."""
    message = re.escape(f"must be one or two positive ints (long, short), e.g. [2048, 512], got {bad!r}")
    with pytest.raises(ValueError, match=rf"^scale {message}$"):
        segmentation_predict_transform(bad)
    task = SegmentationTask(backbone="swinv2_tiny", backbone_kwargs=TINY_SWIN, num_classes=3,
                            arch_kwargs={"decoder_channels": 8}, aux_channels=8)
    with pytest.raises(ValueError, match=rf"^eval_scale {message}$"):
        task.predict_transform(eval_scale=bad)


def test_good_eval_scales_still_resize_as_validation() -> None:
    image = torch.zeros(3, 60, 80, dtype=torch.uint8)
    assert segmentation_predict_transform((64,))(image).shape == (3, 48, 64)
    assert segmentation_predict_transform([64, 48])(image).shape == (3, 48, 64)
    assert segmentation_predict_transform((np.int64(128), 32))(image).shape == (3, 32, 43)
    assert segmentation_predict_transform(None)(image).shape == (3, 60, 80)


@pytest.mark.parametrize("bad", ["64", "[0, 0]", "[-5, 10]", "[64, 48, 32]"])
def test_predict_cli_checks_eval_scale_before_the_model_runs(
    seg_ckpt: Path, photos: Path, tmp_path: Path, bad: str, capsys: pytest.CaptureFixture  # noqa: F811
) -> None:
    argv = _predict_cli("ade20k_swinv2", seg_ckpt, photos, f"--data.eval_scale={bad}", f"--output={tmp_path / 'out'}")
    with patch.object(SegmentationTask, "predict_step", side_effect=AssertionError("the model ran")):
        with pytest.raises(ValueError, match=re.escape(f"--data.eval_scale must be one or two positive ints (long, short), "
                                                       f"e.g. [2048, 512], got {bad}")) as err:
            _recipe("ade20k_swinv2").main(argv)
        assert getattr(err.value, "vtdense_before_run", False)
        status, stderr = _exit_status_and_stderr("ade20k_swinv2", argv, capsys)
    assert status == 2 and stderr.startswith("error: --data.eval_scale must be") and stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("option", "value"), [("test_scale", "0"), ("test_scale", "-10"), ("max_size", "0")])
def test_predict_cli_names_a_bad_test_scale_or_max_size(
    det_ckpt: Path, photos: Path, option: str, value: str, capsys: pytest.CaptureFixture  # noqa: F811
) -> None:
    argv = _predict_cli("coco_swin", det_ckpt, photos, f"--data.{option}={value}")
    with patch.object(DetectionTask, "predict_step", side_effect=AssertionError("the model ran")):
        status, stderr = _exit_status_and_stderr("coco_swin", argv, capsys)
    assert status == 2 and stderr == f"error: --data.{option} must be a positive int, got {value}\n"


def test_predict_cli_refuses_an_output_that_is_a_file_before_the_model_runs(
    det_ckpt: Path, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture  # noqa: F811
) -> None:
    """``--output`` naming an existing file (or a folder below one) ran the whole model, then failed
    with a ``NotADirectoryError`` traceback; now one line naming the option and the path, exit 2."""
    taken = tmp_path / "taken.png"
    Image.new("RGB", (8, 6)).save(taken)
    with patch.object(DetectionTask, "predict_step", side_effect=AssertionError("the model ran")):
        status, stderr = _exit_status_and_stderr("coco_swin", _predict_cli("coco_swin", det_ckpt, photos, f"--output={taken}"), capsys)
        assert status == 2
        assert stderr == f"error: --output {taken} is a file; it must be a folder (new or existing) for the predictions\n"
        below = taken / "run1"
        status, stderr = _exit_status_and_stderr("coco_swin", _predict_cli("coco_swin", det_ckpt, photos, f"--output={below}"), capsys)
        assert status == 2 and stderr == f"error: --output {below} cannot be a folder: {taken} is a file\n"
    assert taken.is_file() and taken.stat().st_size > 0  # untouched


# ---------------------------------------------------------------------------- drawing
def _drawn(task: DetectionTask, out: Path, path: Path, box: list[float]) -> np.ndarray:
    """``write_prediction_files`` of one detection ``box`` on the image at ``path``: the drawing, as an array."""
    with Image.open(path) as img:
        w, h = img.size
    pred = {"boxes": torch.tensor([box]), "labels": torch.tensor([1]), "scores": torch.tensor([0.9]),
            "category_ids": torch.tensor([1])}
    target = {"orig_size": (h, w), "path": str(path), "name": path.stem, "file_name": path.name, "index": 0}
    record = task.write_prediction_files(out, target, pred, torch.zeros(3, 1, 1))
    with Image.open(out / record["vis"]) as png:
        return np.asarray(png.convert("RGB"))


def test_boxes_on_very_wide_and_tall_images_are_drawn_where_they_are(tmp_path: Path) -> None:
    """A 6000 x 5 image is drawn reduced to 3000 x 3: x scales by 0.5, y by 0.6 (each side is rounded
    on its own). The box was scaled by the height's 0.6 on both axes, drawn 1.2x too far right."""
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY_SWIN, head="faster_rcnn", num_classes=2,
                         fpn_channels=16, slim_heads=True, box_head_width=32, rois_per_image=16)
    Image.fromarray(np.zeros((5, 6000, 3), np.uint8)).save(tmp_path / "wide.png")
    Image.fromarray(np.zeros((6000, 5, 3), np.uint8)).save(tmp_path / "tall.png")

    wide = _drawn(task, tmp_path / "out", tmp_path / "wide.png", [3000.0, 0.0, 4500.0, 5.0])
    assert wide.shape == (3, 3000, 3)
    columns = np.nonzero(wide.any(axis=(0, 2)))[0]
    assert (columns.min(), columns.max()) == (1500, 2250)  # x / 2 (was 1800 - 2700)
    assert wide[:, 1500].any() and wide[:, 2250].any()  # both vertical edges of the outline

    tall = _drawn(task, tmp_path / "out", tmp_path / "tall.png", [0.0, 3000.0, 5.0, 4500.0])
    assert tall.shape == (3000, 3, 3)
    rows = np.nonzero(tall.any(axis=(1, 2)))[0]
    assert (rows.min(), rows.max()) == (1500, 2250)  # y / 2: x and y not swapped (x scales by 0.6 here)

    pic, scales = read_display_image({"orig_size": (5, 6000), "path": str(tmp_path / "wide.png")})
    assert tuple(pic.shape) == (3, 3, 3000) and scales == (0.6, 0.5)
    # a tensor source is drawn on the model input: its own scale per axis too
    assert read_display_image({"orig_size": (5, 6000), "path": None}, torch.rand(3, 3, 3000))[1] == (0.6, 0.5)


# ------------------------------------------------------------------------ not checkpoints
def test_a_file_that_is_no_checkpoint_says_so(det_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    """An image, a text file or an empty file given as a checkpoint: "is not a checkpoint", naming the
    file and what was expected, not "cannot load ... safely with torch.load(weights_only=True)"."""
    from vtdense.export import main as export_main

    png = tmp_path / "some.png"
    Image.new("RGB", (8, 6)).save(png)
    status = export_main([str(png), str(tmp_path / "out.onnx")])
    stderr = capsys.readouterr().err
    assert status == 2 and stderr == (
        f"error: {str(png)!r} is not a checkpoint: expected a file written by torch.save (a zip archive such as a "
        "Lightning .ckpt, or a pickle of protocol 2+), but it is a PNG image\n"
    )
    assert not (tmp_path / "out.onnx").exists()
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(png)))} is not a checkpoint: .* but it is a PNG image$"):
        DetectionTask.from_checkpoint(png)
    (tmp_path / "notes.ckpt").write_text("hello world\n")
    with pytest.raises(ValueError, match=r"notes\.ckpt' is not a checkpoint: .* but it starts with b'hello wo'$"):
        read_task_checkpoint(tmp_path / "notes.ckpt")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.ckpt' is not a checkpoint: .* but it is empty$"):
        read_task_checkpoint(tmp_path / "empty.ckpt")

    # real checkpoints still load; a pickle with code in it is still refused by torch's weights_only reader
    assert "state_dict" in read_task_checkpoint(det_ckpt)

    class _Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"state_dict": {}, "x": _Payload()}, protocol=2))
    with pytest.raises(ValueError, match=rf"^cannot load {re.escape(repr(str(evil)))} safely with torch\.load\(weights_only=True\)"):
        read_task_checkpoint(evil)
    assert not (tmp_path / "PWNED").exists()
