"""The recipes' ``validate`` subcommand: a trained checkpoint scored on a dataset, without training."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from tests.test_recipe_ade20k import _recipe as ade20k_recipe
from tests.test_recipe_ade20k import make_tiny_args as seg_tiny_args
from tests.test_recipe_coco import load_recipe as coco_recipe
from tests.test_recipe_coco import tiny_args as det_tiny_args
from vtdense.data.synthetic import make_synthetic_coco

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["recipe.py"])  # keep pytest's flags out of the recipes' parsers


@pytest.fixture(scope="module")
def det_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Mask R-CNN fitted by the recipe (1 epoch of 2 steps): its root, best checkpoint and final metrics."""
    tmp = tmp_path_factory.mktemp("det")
    root = make_synthetic_coco(tmp / "coco", num_train=4, num_val=4, size_range=(64, 96), num_classes=2, seed=3)
    args = det_tiny_args(root, tmp / "run") + ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2"]
    with contextlib.redirect_stdout(io.StringIO()):
        metrics = coco_recipe().main(args)
    run = tmp / "run" / "lightning_logs" / "version_0"
    best = Path(json.loads((run / "metrics.json").read_text())["checkpoint"])
    return {"tmp": tmp, "root": root, "run": run, "best": best, "metrics": metrics}


def _rescore(ann: Path, results: list, iou: str) -> list[float]:
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann))
        ev = COCOeval(gt, gt.loadRes(results), iou)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return [float(v) for v in ev.stats]


def test_detection_checkpoint_scores_as_its_fit_did_on_a_machine_with_only_the_val_split(
    det_run: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the dataset moved to another place, and only its validation split is there
    moved = tmp_path / "elsewhere"
    shutil.copytree(det_run["root"], moved)
    shutil.rmtree(moved / "train2017")
    (moved / "annotations" / "instances_train2017.json").unlink()
    out = tmp_path / "eval"
    capsys.readouterr()
    metrics = coco_recipe().main(["validate", f"--ckpt_path={det_run['best']}", f"--data.root={moved}", f"--output={out}",
                                  "--progress_bar=false"])
    printed = capsys.readouterr().out
    assert f"metrics of {det_run['best']}" in printed and "val/bbox_mAP" in printed and "bbox.json" in printed

    # the same checkpoint on the same images: the numbers of the fit's final validation
    fitted = det_run["metrics"]
    assert set(metrics) == set(fitted)
    assert metrics == pytest.approx(fitted, abs=1e-9)  # one process, one thread count: the same numbers
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics"] == pytest.approx(metrics, abs=1e-12)
    assert saved["checkpoint"] == str(det_run["best"].resolve())
    assert saved["data"]["root"] == str(moved) and saved["data"]["test_scale"] == 64  # the checkpoint's, with --data.root
    # the results files re-score to the reported numbers with pycocotools
    ann = moved / "annotations" / "instances_val2017.json"
    for iou in ("bbox", "segm"):
        results = json.loads((out / f"{iou}.json").read_text())
        assert results
        stats = _rescore(ann, results, iou)
        assert abs(stats[0] - metrics[f"val/{iou}_mAP"]) < 1e-6 and abs(stats[1] - metrics[f"val/{iou}_mAP50"]) < 1e-6

    # a model option that keeps the network's shapes applies: fewer detections, a lower recall
    stricter = coco_recipe().main(["validate", f"--ckpt_path={det_run['best']}", f"--data.root={moved}",
                                   f"--output={tmp_path / 'strict'}", "--progress_bar=false", "--model.detections_per_img=1"])
    assert len(json.loads((tmp_path / "strict" / "bbox.json").read_text())) <= 4  # one per image
    assert stricter["val/bbox_mAR100"] <= metrics["val/bbox_mAR100"]


def _edit_val(root: Path, dest: Path, edit) -> Path:
    shutil.copytree(root, dest)
    ann = dest / "annotations" / "instances_val2017.json"
    data = json.loads(ann.read_text())
    edit(data)
    ann.write_text(json.dumps(data))
    return dest


def test_bad_input_is_one_error_before_the_model_runs(det_run: dict, tmp_path: Path) -> None:
    best, root = det_run["best"], det_run["root"]

    def rename(data: dict) -> None:
        data["categories"][0]["name"] = "not_a_square"

    def one_class(data: dict) -> None:
        kept = data["categories"][0]["id"]
        data["categories"] = data["categories"][:1]
        data["annotations"] = [a for a in data["annotations"] if a["category_id"] == kept]

    sharded = tmp_path / "last.ckpt"  # what FSDP writes with save_distributed_checkpoint=True: a folder
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")
    bare = tmp_path / "no_data_options.ckpt"  # as a fit without a datamodule writes it
    import torch

    saved = torch.load(best, weights_only=True, map_location="cpu")
    torch.save({k: v for k, v in saved.items() if k != "datamodule_hyper_parameters"}, bare)
    renamed = _edit_val(root, tmp_path / "renamed", rename)
    fewer = _edit_val(root, tmp_path / "fewer", one_class)
    cases = [
        ([f"--ckpt_path={tmp_path / 'nope.ckpt'}"], FileNotFoundError, "checkpoint not found"),
        ([f"--ckpt_path={sharded}"], ValueError, "is the folder of a sharded checkpoint (FSDP with save_distributed_checkpoint=True)"),
        ([f"--ckpt_path={best}", f"--data.root={renamed}"], ValueError, "trained on the categories"),
        ([f"--ckpt_path={bare}"], ValueError, "holds no data options"),
        ([f"--ckpt_path={best}", f"--data.root={fewer}"], ValueError, "num_classes=2 but the data"),
        ([f"--ckpt_path={best}", f"--data.root={tmp_path / 'missing'}"], FileNotFoundError, "COCO root not found"),
        ([f"--ckpt_path={best}", "--model.fpn_channels=8"], ValueError, "does not fit this model"),
        ([f"--ckpt_path={best}", "--model.no_such_option=1"], SystemExit, None),
        ([f"--ckpt_path={best}", "--data.batch_size=two"], SystemExit, None),
        ([f"--ckpt_path={best}", "--data.test_scale=0"], ValueError, "--data:"),
    ]
    for args, error, message in cases:
        out = tmp_path / "out"
        with pytest.raises(error) as info:
            coco_recipe().main(["validate", *args, f"--output={out}", "--progress_bar=false"])
        if message is None:
            assert info.value.code == 2
        else:
            assert message in str(info.value), str(info.value)
            assert getattr(info.value, "vtdense_before_run", False), args  # one line from the script
        assert not out.exists(), args  # nothing written
    # the data named in the message: the checkpoint and both category lists
    with pytest.raises(ValueError, match=r"not_a_square") as info:
        coco_recipe().main(["validate", f"--ckpt_path={best}", f"--data.root={renamed}"])
    assert str(best) in str(info.value)

    # from the script: exit status 2 and one line; a segmentation checkpoint is not a detection one
    seg_ckpt = tmp_path / "seg.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"arch": "upernet"}, "vtdense_task": "SegmentationTask"}, seg_ckpt)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "coco_swin.py"), "validate", f"--ckpt_path={seg_ckpt}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"error: checkpoint {seg_ckpt} is a SegmentationTask checkpoint of another task, "
                                               "not a DetectionTask one"]


def test_two_processes_score_what_one_does(det_run: dict, tmp_path: Path) -> None:
    """``--devices 2`` on 2 CPU processes (gloo): the metric over all images, as one process gives it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # one image per batch: a batch's images are padded to its largest, and the two ranks batch other pairs
    args = ["validate", f"--ckpt_path={det_run['best']}", "--data.batch_size=1", "--progress_bar=false"]
    one = coco_recipe().main([*args, f"--output={tmp_path / 'one'}"])
    assert one["val/bbox_mAR100"] > 0  # the comparison is not between empty results
    out = tmp_path / "ddp"
    cmd = [sys.executable, str(REPO / "recipes" / "coco_swin.py"), *args, "--device=cpu", "--devices=2", f"--output={out}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stderr + proc.stdout  # really two ranks
    assert proc.stdout.count("metrics of") == 1  # rank 0 reports
    saved = json.loads((out / "metrics.json").read_text())["metrics"]
    assert saved == pytest.approx(one, abs=1e-6)  # (the ranks compute on one thread each: float rounding)
    for iou in ("bbox", "segm"):  # each image's detections once, as one process writes them
        r1, r2 = (sorted(json.loads(path.read_text()), key=lambda r: (r["image_id"], r["category_id"], -r["score"]))
                  for path in (tmp_path / "one" / f"{iou}.json", out / f"{iou}.json"))
        assert [(r["image_id"], r["category_id"]) for r in r1] == [(r["image_id"], r["category_id"]) for r in r2]
        assert [r["score"] for r in r1] == pytest.approx([r["score"] for r in r2], abs=1e-5)
        assert len({r["image_id"] for r in r2}) == 4


def test_segmentation_checkpoint_scores_as_its_fit_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe: ModuleType = ade20k_recipe()
    args = seg_tiny_args(tmp_path) + ["--trainer.max_epochs", "1", "--trainer.max_steps", "2"]
    fitted = recipe.main(args)
    run = next((tmp_path / "run").rglob("metrics.json")).parent
    best = Path(json.loads((run / "metrics.json").read_text())["checkpoint"])
    out = tmp_path / "eval"
    capsys.readouterr()
    metrics = recipe.main(["validate", f"--ckpt_path={best}", f"--output={out}", "--progress_bar=false"])
    assert "val/mIoU" in capsys.readouterr().out
    assert set(metrics) == set(fitted) and metrics == pytest.approx(fitted, abs=1e-9, nan_ok=True)
    saved = json.loads((out / "metrics.json").read_text())
    per_class = json.loads((run / "metrics.json").read_text())["per_class_iou"]  # the task's own table, kept
    assert saved["per_class_iou"] == pytest.approx(per_class, nan_ok=True) and len(per_class) == 8

    # multi-scale + flip test-time augmentation from the command line: validate scores it, and predict
    # with the same options writes the label maps that give validate's mIoU
    tta = ["--data.eval_ratios=[0.75, 1.25]", "--data.eval_flip=true"]
    scored = recipe.main(["validate", f"--ckpt_path={best}", f"--output={tmp_path / 'tta'}", "--progress_bar=false", *tta])
    used = json.loads((tmp_path / "tta" / "metrics.json").read_text())["data"]
    assert used["eval_ratios"] == [0.75, 1.25] and used["eval_flip"] is True
    root = Path(saved["data"]["root"])
    recipe.main(["predict", f"--ckpt_path={best}", f"--data.predict_path={root / 'images' / 'validation'}",
                 f"--output={tmp_path / 'pred'}", "--progress_bar=false", "--data.num_workers=0", *tta])
    _check_label_maps_score(tmp_path / "pred", root, scored["val/mIoU"], len(per_class))
    with pytest.raises(ValueError, match=r"--data\.eval_ratios must be a non-empty list"):
        recipe.main(["predict", f"--ckpt_path={best}", f"--data.predict_path={root / 'images' / 'validation'}",
                     "--data.eval_ratios=[0]"])

    # data whose classes.txt names the classes otherwise: one error naming the index and both names
    other = tmp_path / "other"
    shutil.copytree(root, other)
    names = (other / "classes.txt").read_text().split("\n")
    (other / "classes.txt").write_text("\n".join(["renamed", *names[1:]]))
    with pytest.raises(ValueError, match=rf"0: '{names[0]}' / 'renamed'") as info:
        recipe.main(["validate", f"--ckpt_path={best}", f"--data.root={other}", f"--output={tmp_path / 'x'}"])
    assert getattr(info.value, "vtdense_before_run", False)
    assert not (tmp_path / "x").exists()


def _check_label_maps_score(out: Path, root: Path, miou: float, num_classes: int) -> None:
    """The label PNGs ``predict`` wrote into ``out`` score ``miou`` against the validation labels (ADE20K's
    ``reduce_zero_label``: 0 is ignored, ``k`` is class ``k - 1``)."""
    import numpy as np
    import torch
    from PIL import Image
    from torchmetrics.classification import MulticlassJaccardIndex

    metric = MulticlassJaccardIndex(num_classes=num_classes, ignore_index=255, average="macro")
    labels = sorted((root / "annotations" / "validation").glob("*.png"))
    assert labels
    for ann in labels:
        gt = torch.from_numpy(np.array(Image.open(ann)).astype(np.int64))
        gt = torch.where(gt == 0, 255, gt - 1)
        pred = torch.from_numpy(np.array(Image.open(out / "labels" / ann.name)).astype(np.int64))
        metric.update(pred, gt)
    assert float(metric.compute()) == pytest.approx(miou, abs=1e-6)


def test_predict_from_a_coco_file_writes_the_results_validate_scores(det_run: dict, tmp_path: Path) -> None:
    """``predict --data.predict_path image_info.json --data.predict_images DIR`` (a COCO test-dev
    submission): ``results.json`` carries the file's image ids and the checkpoint's category ids, at
    the model's own score threshold, and holds the detections ``validate`` writes for those images."""
    best, root = det_run["best"], det_run["root"]
    instances = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    info = tmp_path / "image_info.json"  # as test-dev's: images and categories, no annotations
    info.write_text(json.dumps({"images": instances["images"], "categories": instances["categories"]}))
    out = tmp_path / "pred"
    coco_recipe().main(["predict", f"--ckpt_path={best}", f"--data.predict_path={info}", f"--data.predict_images={root / 'val2017'}",
                        f"--output={out}", "--progress_bar=false", "--data.num_workers=0"])
    results = json.loads((out / "results.json").read_text())
    index = json.loads((out / "images.json").read_text())
    assert sorted(i["id"] for i in index["images"]) == sorted(i["id"] for i in instances["images"])
    assert {r["image_id"] for r in results} <= {i["id"] for i in instances["images"]}
    assert {r["category_id"] for r in results} <= {c["id"] for c in instances["categories"]}

    # validate, one image per batch as predict runs, writes the same detections, and pycocotools gives
    # predict's file the mAP validate reports
    metrics = coco_recipe().main(["validate", f"--ckpt_path={best}", "--data.batch_size=1", f"--output={tmp_path / 'val'}",
                                  "--progress_bar=false"])
    reference = json.loads((tmp_path / "val" / "bbox.json").read_text())
    key = lambda r: (r["image_id"], r["category_id"], round(r["score"], 4))  # noqa: E731
    assert len(results) == len(reference) > 0 and sorted(map(key, results)) == sorted(map(key, reference))
    stats = _rescore(root / "annotations" / "instances_val2017.json", results, "bbox")
    assert abs(stats[0] - metrics["val/bbox_mAP"]) < 1e-6 and abs(stats[8] - metrics["val/bbox_mAR100"]) < 1e-6

    # multi-scale + flip test-time augmentation: validate and predict with the same options agree, and
    # pycocotools gives predict's file the mAP validate reports
    tta = ["--data.test_scales=[64, 96, 160]", "--data.test_flip=true", "--data.test_max_size=320"]
    coco_recipe().main(["predict", f"--ckpt_path={best}", f"--data.predict_path={info}", f"--data.predict_images={root / 'val2017'}",
                        f"--output={tmp_path / 'pred_tta'}", "--progress_bar=false", "--data.num_workers=0", *tta])
    metrics = coco_recipe().main(["validate", f"--ckpt_path={best}", "--data.batch_size=1", f"--output={tmp_path / 'val_tta'}",
                                  "--progress_bar=false", *tta])
    results = json.loads((tmp_path / "pred_tta" / "results.json").read_text())
    reference = json.loads((tmp_path / "val_tta" / "bbox.json").read_text())
    assert len(results) == len(reference) > 0 and sorted(map(key, results)) == sorted(map(key, reference))
    stats = _rescore(root / "annotations" / "instances_val2017.json", results, "bbox")
    assert abs(stats[0] - metrics["val/bbox_mAP"]) < 1e-6
    plain = json.loads((tmp_path / "val" / "bbox.json").read_text())
    assert sorted(map(key, plain)) != sorted(map(key, reference))  # the views were used

    # what is wrong with the file or the folder: one error before the model runs
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"images": instances["images"], "categories": [{**c, "id": c["id"] + 100} for c in instances["categories"]]}))
    moved = tmp_path / "half"
    shutil.copytree(root / "val2017", moved)
    next(moved.iterdir()).unlink()
    cases = [
        ([f"--data.predict_path={info}"], ValueError, "give --data.predict_images"),
        ([f"--data.predict_path={other}", f"--data.predict_images={root / 'val2017'}"], ValueError, "trained on the categories"),
        ([f"--data.predict_path={info}", f"--data.predict_images={moved}"], FileNotFoundError, "1 of 4 images image_info.json lists"),
        ([f"--data.predict_path={root / 'val2017'}", f"--data.predict_images={moved}"], ValueError, "only to a COCO JSON"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message) as caught:
            coco_recipe().main(["predict", f"--ckpt_path={best}", *args, f"--output={tmp_path / 'x'}"])
        assert getattr(caught.value, "vtdense_before_run", False)
    assert not (tmp_path / "x").exists()
