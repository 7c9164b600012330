"""Two real CPU processes (gloo DDP) against one: metrics and outputs are the same.

Every test launches ``tests/scripts/ddp_validate.py`` (or a recipe) as a subprocess; Lightning's
DDP launcher starts the second rank. The validation sets have 5 images, so the distributed
sampler pads rank 1 with a repeat that must not be counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from ranks import run_ranks
from vtdense.data.synthetic import make_synthetic_coco
from vtdense.data.synthetic_seg import generate_synthetic_segmentation

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "ddp_validate.py"


def _env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT) prints every thread's Python stack to stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1")
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(key, None)
    return env


#: Runs already made in this worker, by their command: several tests compare against the same run
#: (2 processes, 3 segmentation steps under DDP or FSDP), which is made once. Those tests share an
#: xdist group, so that they meet in one worker.
_RUNS: dict[tuple, dict] = {}
SHARED_RUNS = pytest.mark.xdist_group("distributed_shared_runs")


def _shared_run(tmp: Path, task: str, data: Path, devices: int, *extra: str) -> dict:
    """:func:`_run`, made once per worker for one command (its outputs stay under the first test's
    ``tmp``); for runs that only report, never for a run a test then changes."""
    key = (task, str(data), devices, extra)
    if key not in _RUNS:
        _RUNS[key] = _run(tmp, task, data, devices, *extra)
    return _RUNS[key]


def _run(tmp: Path, task: str, data: Path, devices: int, *extra: str) -> dict:
    tag = f"{task}_{devices}_{hashlib.sha1(' '.join(extra).encode()).hexdigest()[:8]}"  # one output per kind of run
    out = tmp / f"{tag}.json"
    cmd = [sys.executable, str(SCRIPT), "--task", task, "--data", str(data), "--devices", str(devices),
           "--root_dir", str(tmp / f"run_{tag}"), "--out", str(out), *extra]
    proc = run_ranks(cmd, cwd=tmp, env=_env(), timeout=240)
    exits = {p.name: p.read_text() for p in tmp.glob(f"{out.name}.exit*")}  # what each rank saw at exit
    assert proc.returncode == 0, f"exit records {exits}, output written: {out.is_file()}\n{proc.stderr[-6000:]}"
    if devices > 1:
        _assert_group_destroyed_at_exit(out, devices)
    return json.loads(out.read_text())


def _assert_group_destroyed_at_exit(out: Path, devices: int) -> None:
    """Every rank tore its gloo group down before interpreter shutdown (``vtdense.distributed``).

    The script's own atexit hook, registered before vtdense's, records what it sees after it.
    Rank 0 is the process ``subprocess.run`` waited for; the others are its children and may
    still be leaving, so their records get a little time to appear.
    """
    records = [Path(f"{out}.exit{rank}") for rank in range(devices)]
    deadline = time.monotonic() + 60
    while not all(r.is_file() for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [r.read_text() if r.is_file() else "no record" for r in records] == ["destroyed"] * devices


@pytest.fixture(scope="module")
def coco5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_coco(
        tmp_path_factory.mktemp("ddp") / "coco", num_train=4, num_val=5, size_range=(64, 96), num_classes=3,
        max_objects=4, seed=3,
    )


@pytest.fixture(scope="module")
def ade5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_synthetic_segmentation(
        tmp_path_factory.mktemp("ddp") / "ade", num_train=4, num_val=5, size_range=(48, 64), seed=4
    )


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def test_detection_metrics_two_processes_equal_one(coco5: Path, tmp_path: Path) -> None:
    weights = tmp_path / "trained.pt"
    one = _run(tmp_path, "detection", coco5, 1, "--fit_steps", "40", "--save_weights", str(weights))
    two = _run(tmp_path, "detection", coco5, 2, "--load_weights", str(weights), "--then_fsdp")
    assert two["world"] == 2 and one["checksum"] == two["checksum"]
    m1, m2 = _numbers(one["metrics"]), _numbers(two["metrics"])
    assert set(m1) == set(m2) and "val/segm_mAP" in m1
    for key in m1:
        assert m2[key] == pytest.approx(m1[key], abs=1e-6), key
    assert m1["val/bbox_mAR100"] > 0  # the comparison is not between empty results
    # the results files hold each of the 5 images once, with the same detections
    for iou in ("bbox", "segm"):
        r1 = json.loads((Path(one["run_dir"]) / f"{iou}.json").read_text())
        r2 = json.loads((Path(two["run_dir"]) / f"{iou}.json").read_text())
        assert len({r["image_id"] for r in r1}) == 5 and len(r1) == len(r2)
        assert [(r["image_id"], r["category_id"]) for r in r1] == [(r["image_id"], r["category_id"]) for r in r2]
        assert [r["score"] for r in r1] == pytest.approx([r["score"] for r in r2], abs=1e-6)
        if iou == "bbox":
            flat = lambda rs: [v for r in rs for v in r["bbox"]]  # noqa: E731
            assert flat(r1) == pytest.approx(flat(r2), abs=1e-4)
    # pycocotools on the 2-process bbox.json gives the logged mAP
    gt = COCO(str(coco5 / "annotations" / "instances_val2017.json"))
    ev = COCOeval(gt, gt.loadRes(str(Path(two["run_dir"]) / "bbox.json")), "bbox")
    ev.evaluate(), ev.accumulate(), ev.summarize()
    assert ev.stats[0] == pytest.approx(m2["val/bbox_mAP"], abs=1e-6)
    pngs = sorted(p.name for p in (Path(two["run_dir"]) / "predictions").glob("*.png"))
    assert len(pngs) == 3
    # the same weights sharded by FSDP2 over the 2 processes (the same launch) give the same metrics
    fsdp = two["fsdp"]
    assert fsdp["sharded"] and fsdp["dp_size"] == 2 and fsdp["checksum"] == one["checksum"]
    for key, value in _numbers(fsdp["metrics"]).items():
        assert value == pytest.approx(m1[key], abs=1e-6), key


def test_compile_backbone_under_ddp_and_fsdp_trains_like_eager(coco5: Path, tmp_path: Path) -> None:
    """``compile_backbone`` (Dynamo capture, "eager" backend) in 2 gloo processes: the backbone + FPN
    go through Dynamo under DDP and under FSDP2 (sharded first, then compiled), and 3 optimiser
    steps give the weights eager DDP gives. One launch fits three times in the same processes, as a
    script that fits several times does: eager DDP (``--compare_eager``), compiled DDP, then compiled
    FSDP2 (``--then_fsdp``). (No validation run after: an eval-mode graph would be a second trace in
    each process, and what is compared is the trained weights.)"""
    run = _run(tmp_path, "detection", coco5, 2, "--fit_steps", "3", "--strategy", "ddp", "--compile_backbone", "eager",
               "--no_validate", "--compare_eager", "--then_fsdp")
    fsdp = run["fsdp"]
    assert run["compiled"] == "eager" and run["graphs"] > 0 and not run["sharded"]
    assert fsdp["compiled"] == "eager" and fsdp["graphs"] > 0  # the FSDP2 model traced graphs of its own
    assert fsdp["sharded"] and fsdp["dp_size"] == 2  # its backbone's parameters are DTensor shards
    assert run["eager_checksum"] is not None
    assert run["checksum"] == pytest.approx(run["eager_checksum"], abs=1e-6)
    assert fsdp["checksum"] == pytest.approx(run["eager_checksum"], abs=1e-6)


#: The shared 2-process segmentation launch: 3 steps under DDP, the same under FSDP2, then the
#: untrained task validated (what the one-process validation is compared with).
SHARED_SEGMENTATION = ("--fit_steps", "3", "--strategy", "ddp", "--then_fsdp", "--then_validate_only")


@SHARED_RUNS
def test_segmentation_metrics_two_processes_equal_one(ade5: Path, tmp_path: Path) -> None:
    one = _run(tmp_path, "segmentation", ade5, 1)
    two = _shared_run(tmp_path, "segmentation", ade5, 2, *SHARED_SEGMENTATION)["validate_only"]
    assert two["world"] == 2 and one["checksum"] == two["checksum"]
    m1, m2 = _numbers(one["metrics"]), _numbers(two["metrics"])
    assert set(m1) == set(m2) and "val/mIoU" in m1
    for key in m1:
        if m1[key] != m1[key]:  # nan: class absent everywhere
            assert m2[key] != m2[key], key
        else:
            assert m2[key] == pytest.approx(m1[key], abs=1e-6), key
    j1 = json.loads((Path(one["run_dir"]) / "metrics.json").read_text())
    j2 = json.loads((Path(two["run_dir"]) / "metrics.json").read_text())
    assert j2["mIoU"] == pytest.approx(j1["mIoU"], abs=1e-6) and j2["per_class_iou"] == pytest.approx(j1["per_class_iou"])
    # the same 3 images are drawn, named by their dataset position
    names = lambda r: sorted(p.name for p in (Path(r["run_dir"]) / "predictions").glob("*.png"))  # noqa: E731
    assert names(one) == names(two) == ["val_000.png", "val_001.png", "val_002.png"]


def test_backbone_finetuning_trains_one_backbone_on_every_rank(ade5: Path, tmp_path: Path) -> None:
    """Lightning's ``BackboneFinetuning`` under DDP: the backbone, frozen when DDP wrapped the model and
    trained from epoch 1, gets the gradients averaged over the processes (DDP only averages what trained
    when it wrapped the model; Lightning issue #20340), so both ranks hold the same trained weights."""
    two = _run(tmp_path, "segmentation", ade5, 2, "--fit_steps", "3", "--finetune_at", "1", "--no_validate")
    before, *ranks = two["backbone_checksums"]
    assert two["world"] == 2 and len(ranks) == 2 and two["backbone_trainable"]
    assert ranks[0] != before  # the backbone trained
    assert ranks[0] == ranks[1]  # the same on both ranks


def test_coco_recipe_ddp_bf16_writes_what_one_process_writes(coco5: Path, tmp_path: Path) -> None:
    """The issue's command shape: recipe, 2 gloo processes, DDP, bf16-mixed, fit then validate."""
    from tests.test_recipe_coco import tiny_args  # the demo config shrunk to 64 px

    args = tiny_args(coco5, tmp_path / "run") + [
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.precision=bf16-mixed",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.check_val_every_n_epoch=1",
        "--data.persistent_workers=false",
    ]
    proc = run_ranks([sys.executable, str(REPO / "recipes" / "coco_swin.py"), *args], cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("final metrics") == 1  # printed once, by rank 0
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    saved = json.loads((run / "metrics.json").read_text())
    assert (run / "checkpoints" / "last.ckpt").is_file() and saved["checkpoint"].endswith(".ckpt")
    pngs = [p.name for p in (run / "predictions").glob("*.png")]  # 2 drawn per validation: fit's and the final one
    assert sum(n.startswith("fit_") for n in pngs) == 2 and sum(n.startswith("validate_") for n in pngs) == 2
    gt = COCO(str(coco5 / "annotations" / "instances_val2017.json"))
    results = json.loads((run / "bbox.json").read_text())
    assert results and {r["image_id"] for r in results} <= set(gt.getImgIds())
    # 5 images on 2 ranks: the sampler pads rank 1 with a repeat of an image, whose detections must
    # be dropped, not written (and scored) twice
    keys = [(r["image_id"], r["category_id"], tuple(round(v, 2) for v in r["bbox"]), round(r["score"], 4)) for r in results]
    assert len(keys) == len(set(keys)), "detections of one image written twice"
    ev = COCOeval(gt, gt.loadRes(str(run / "bbox.json")), "bbox")
    ev.evaluate(), ev.accumulate(), ev.summarize()
    assert ev.stats[0] == pytest.approx(saved["metrics"]["val/bbox_mAP"], abs=1e-6)


def test_trainer_options_turn_fsdp_and_fp16_into_the_sharded_scaler() -> None:
    """``trainer_options`` (in one process, no process group): ``strategy="fsdp"`` becomes vtdense's
    FSDP2 strategy; ``16-mixed`` and its alias ``16`` become a ``MixedPrecision`` plugin with the
    sharded scaler for the accelerator named, appended to the plugins given, with the precision flag
    cleared (Lightning refuses both); other strategies pass through untouched."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from vtdense.strategies import VtdenseFSDPStrategy, trainer_options

    plain = {"strategy": "ddp", "precision": "16-mixed"}
    assert trainer_options(plain) is plain
    for precision in ("16-mixed", "16"):
        got = trainer_options({"strategy": "fsdp", "precision": precision, "accelerator": "cpu", "plugins": ["x"]})
        assert isinstance(got["strategy"], VtdenseFSDPStrategy) and got["precision"] is None
        assert got["plugins"][0] == "x" and len(got["plugins"]) == 2
        plugin = got["plugins"][1]
        assert plugin.precision == "16-mixed" and plugin.device == "cpu" and isinstance(plugin.scaler, ShardedGradScaler)
    got = trainer_options({"strategy": "fsdp", "precision": "bf16-mixed", "accelerator": "cpu"})
    assert got["precision"] == "bf16-mixed" and "plugins" not in got


def test_fsdp_strategy_shards_every_transformer_block(tmp_path: Path) -> None:
    """``--trainer.strategy fsdp`` builds vtdense's FSDP2 strategy, which makes every Swin block an
    FSDP unit (plus the entry modules), recomputes the blocks in backward, and keeps parameter names."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import torch

    from vtdense import create_backbone as vtdense_backbone
    from vtdense.backbones.swin import SwinBlock
    from vtdense.cli import VtdenseCLI
    from vtdense.data.coco import COCODataModule
    from vtdense.models.detection import build_detector
    from vtdense.strategies import VtdenseFSDPStrategy, shard_blocks
    from vtdense.tasks.detection import DetectionTask

    cli = VtdenseCLI(DetectionTask, COCODataModule, run=False, args=[
        "--trainer.strategy=fsdp", "--trainer.accelerator=cpu", "--trainer.devices=1", "--model.num_classes=3",
        "--trainer.precision=16-mixed", "--data.synthetic_if_missing=false", "--trainer.logger=false",
    ])
    assert isinstance(cli.trainer.strategy, VtdenseFSDPStrategy)
    # fp16 under FSDP: a real fp16 autocast (not Lightning's CPU switch to bf16) with the sharded scaler
    plugin = cli.trainer.precision_plugin
    assert plugin.precision == "16-mixed" and isinstance(plugin.scaler, ShardedGradScaler)

    model = build_detector("swin_tiny", "mask_rcnn", 3, backbone_kwargs={"embed_dim": 16, "depths": [1, 2, 1, 1],
                                                                      "num_heads": [1, 1, 1, 1]})
    names = [n for n, _ in model.named_parameters()]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg_store'}", rank=0, world_size=1)
    try:
        blocks = shard_blocks(model)
        assert len(blocks) == 5 and all(isinstance(b, SwinBlock) and isinstance(b, FSDPModule) for b in blocks)
        assert isinstance(model, FSDPModule)
        assert all(stage.grad_checkpointing for stage in model.backbone.body.layers)
        assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
        assert shard_blocks(model) == []  # idempotent: Lightning calls configure_model for every stage
        # MViTv2: every MultiScaleBlock (pooling attention, hybrid windows) is a unit too, and it still trains
        from vtdense.backbones.mvitv2 import MultiScaleBlock

        mvit = vtdense_backbone("mvitv2_tiny", embed_dim=16, depths=[1, 2, 1, 1], num_heads=1, window_size=8)
        blocks = shard_blocks(mvit)
        assert len(blocks) == 5 and all(isinstance(b, MultiScaleBlock) and isinstance(b, FSDPModule) for b in blocks)
        sum(f.mean() for f in mvit(torch.randn(1, 3, 64, 64)).values()).backward()
        assert all(p.grad is not None for p in mvit.parameters())
    finally:
        dist.destroy_process_group()


@SHARED_RUNS
def test_fsdp_training_and_metrics_equal_ddp(ade5: Path, tmp_path: Path) -> None:
    """2 processes, FSDP2 against DDP: the same trained weights and the same metrics (segmentation,
    3 optimiser steps, with BatchNorm in the decoder; the runs the two-node test compares with)."""
    ddp = _shared_run(tmp_path, "segmentation", ade5, 2, *SHARED_SEGMENTATION)
    fsdp = ddp["fsdp"]  # the same run under FSDP2, in the same launch
    assert ddp["dp_size"] is None and fsdp["dp_size"] == 2 and fsdp["sharded"]
    # Relative 1e-6 of a checksum near 1600: the two strategies round differently (sharded against whole
    # tensors in the optimiser), and steps with BatchNorm amplify that by seed; on one code, 6 steps with
    # weight seeds 0 to 3 gave differences of 1.6e-10, 2.3e-10, 7.9e-4 and 0.
    assert fsdp["world"] == 2 and fsdp["checksum"] == pytest.approx(ddp["checksum"], rel=1e-6)
    m1, m2 = _numbers(ddp["metrics"]), _numbers(fsdp["metrics"])
    assert set(m1) == set(m2)
    for key in m1:
        assert (m1[key] != m1[key] and m2[key] != m2[key]) or m2[key] == pytest.approx(m1[key], abs=1e-6), key


def test_fp16_training_under_ddp_and_fsdp(ade5: Path, tmp_path: Path) -> None:
    """``16-mixed`` on 2 processes with real fp16 autocast: DDP with Lightning's grad scaler and FSDP
    with the sharded one train to the same weights."""
    ddp = _run(tmp_path, "segmentation", ade5, 2, "--fit_steps", "3", "--precision", "16-mixed", "--then_fsdp")
    fsdp = ddp["fsdp"]  # the same run under FSDP2, in the same launch
    assert ddp["scaler"] == "GradScaler" and fsdp["scaler"] == "ShardedGradScaler"
    assert fsdp["checksum"] == pytest.approx(ddp["checksum"], abs=1e-4)
    # both skipped the same overflow steps, and not all 3 (that would leave 65536 / 8)
    assert ddp["scale"] == fsdp["scale"] > 65536 / 8


# FSDP only: the nodes' launch (ranks from NODE_RANK and LOCAL_RANK, the meeting point) is Lightning's
# and the same for DDP, whose 2-process run FSDP is compared with in test_fsdp_training_and_metrics_equal_ddp;
# what vtdense adds across nodes is FSDP's device mesh.
@SHARED_RUNS
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_two_nodes_of_one_process_train_like_one_node_of_two(strategy: str, ade5: Path, tmp_path: Path) -> None:
    """``num_nodes=2`` as a cluster runs it: one process per node, started by the scheduler (here
    by the test) with ``NODE_RANK`` and ``LOCAL_RANK`` set, meeting at ``MASTER_ADDR:MASTER_PORT``.
    The global ranks are 0 and 1; FSDP's data-parallel mesh spans both nodes; 3 steps give the
    weights one node with 2 processes gives."""
    import socket

    one_node = _shared_run(tmp_path, "segmentation", ade5, 2, *SHARED_SEGMENTATION)["fsdp"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "nodes.json"
    procs = []
    for node in (0, 1):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node), LOCAL_RANK="0", WORLD_SIZE="2")
        cmd = [sys.executable, str(SCRIPT), "--task", "segmentation", "--data", str(ade5), "--devices", "1", "--num_nodes", "2",
               "--fit_steps", "3", "--strategy", strategy, "--root_dir", str(tmp_path / "nodes"), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node, proc in enumerate(procs):
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"node {node}:\n{err[-4000:]}"
    two_nodes = json.loads(out.read_text())
    assert two_nodes["world"] == one_node["world"] == 2
    assert two_nodes["dp_size"] == one_node["dp_size"] == (2 if strategy == "fsdp" else None)
    assert two_nodes["checksum"] == pytest.approx(one_node["checksum"], abs=1e-4)
    assert _numbers(two_nodes["metrics"]) == pytest.approx(_numbers(one_node["metrics"]), abs=1e-5)


def test_fsdp_overflow_step_is_skipped_on_every_rank(tmp_path: Path) -> None:
    """fp16 under FSDP: an inf loss on one rank only (it reaches every shard through the gradient
    reduce-scatter) makes both ranks skip the step, weights unchanged and finite, and halve the
    scale; the next, finite step updates both the same way."""
    proc = run_ranks([sys.executable, str(REPO / "tests" / "scripts" / "fsdp_overflow.py"), str(tmp_path / "out.json")],
                     cwd=tmp_path, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["autocast_dtype"] == "torch.float16"
        assert r["unchanged_after_overflow"] and r["finite"]
        assert r["scale_after_overflow"] == r["scale_before"] / 2
        assert r["changed_after_good_step"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


@pytest.mark.parametrize("recipe,precision", [("coco_swin", "16-mixed"), ("ade20k_swinv2", "bf16-mixed")])
def test_recipes_run_under_fsdp(recipe: str, precision: str, coco5: Path, tmp_path: Path) -> None:
    """Both recipes, 2 gloo processes, ``--trainer.strategy fsdp``: fit, validate the best
    checkpoint, and write what one process writes; the gathered checkpoint loads in one process."""
    import torch

    if recipe == "coco_swin":
        from tests.test_recipe_coco import tiny_args

        args = tiny_args(coco5, tmp_path / "run") + ["--trainer.limit_train_batches=2"]
    else:
        from tests.test_recipe_ade20k import make_tiny_args

        args = make_tiny_args(tmp_path)
    args += [
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=fsdp", f"--trainer.precision={precision}",
        "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=1",
    ]
    if recipe == "coco_swin":
        args.append("--data.persistent_workers=false")
    proc = run_ranks([sys.executable, str(REPO / "recipes" / f"{recipe}.py"), *args], cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("final metrics") == 1
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    saved = json.loads((run / "metrics.json").read_text())
    assert (run / "checkpoints" / "last.ckpt").is_file() and saved["checkpoint"].endswith(".ckpt")
    assert list((run / "predictions").glob("*.png"))
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert all(type(v) is torch.Tensor for v in ckpt["state_dict"].values())  # gathered, not shards
    if recipe == "coco_swin":
        from vtdense.tasks.detection import DetectionTask

        assert ckpt["MixedPrecision"]["scale"] > 0  # the fp16 scaler's state is saved for resuming
        task = DetectionTask.from_checkpoint(run / "checkpoints" / "last.ckpt")
        gt = COCO(str(coco5 / "annotations" / "instances_val2017.json"))
        assert json.loads((run / "bbox.json").read_text())  # score_thresh 0: every image has detections
        ev = COCOeval(gt, gt.loadRes(str(run / "bbox.json")), "bbox")
        ev.evaluate(), ev.accumulate(), ev.summarize()
        assert ev.stats[0] == pytest.approx(saved["metrics"]["val/bbox_mAP"], abs=1e-6)
    else:
        from vtdense.tasks.segmentation import SegmentationTask

        task = SegmentationTask.from_checkpoint(run / "checkpoints" / "last.ckpt")
    assert sum(p.numel() for p in task.parameters()) == sum(v.numel() for k, v in ckpt["state_dict"].items()
                                                          if k in dict(task.named_parameters()))
