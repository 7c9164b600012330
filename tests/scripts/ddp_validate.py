"""Validate (or briefly fit, then validate) a tiny vtdense task with N CPU processes (gloo).

Used by ``tests/test_distributed.py``: Lightning's DDP launcher re-runs this file for every
rank, so it must be a script. Rank 0 writes ``--out``: the validation metrics, the run
directory and a checksum of the weights.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from vtdense.data.ade20k import ADE20KDataModule  # noqa: E402
from vtdense.data.coco import COCODataModule  # noqa: E402
from vtdense.tasks.detection import DetectionTask  # noqa: E402
from vtdense.tasks.segmentation import SegmentationTask  # noqa: E402

TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 2, 2], "window_size": 4}


def build(task: str, data: str, compile_backbone: bool | str = False) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The tiny task and its datamodule, with weights fixed by the seed."""
    torch.manual_seed(0)
    if task == "detection":
        model = DetectionTask(
            backbone="swin_tiny", backbone_kwargs=TINY_SWIN, head="mask_rcnn", num_classes=3, fpn_channels=16,
            slim_heads=True, mask_head_channels=16, mask_head_layers=1, box_head_width=32, rois_per_image=16,
            anchor_sizes=[8, 16, 32, 64, 128], num_vis_images=3, lr=1e-3, warmup_steps=1,
            compile_backbone=compile_backbone,
        )
        dm = COCODataModule(root=data, batch_size=1, num_workers=0, train_scales=[80], max_size=128, test_scale=96)
    else:
        model = SegmentationTask(
            backbone="swin_tiny", backbone_kwargs=TINY_SWIN, num_classes=8, arch_kwargs={"decoder_channels": 16},
            aux_channels=16, num_vis=3, lr=1e-3, warmup_steps=1,
            # SMP's head: mmseg's starts its classifier at std 0.01, which leaves a model trained for a few
            # steps with near-tied logits whose argmax flips with the strategies' different float rounding
            head_layout="smp",
        )
        dm = ADE20KDataModule(
            root=data, num_classes=8, batch_size=2, val_batch_size=1, num_workers=0, scale=(64, 48), crop_size=(32, 32)
        )
    return model, dm


#: Set once the trainer exists: this process's rank.
_RANK: list[int] = []


def _record_exit(out: str) -> None:
    """At exit, write ``<out>.exit<rank>``: whether the process group was still alive at the end."""
    if _RANK:
        alive = torch.distributed.is_available() and torch.distributed.is_initialized()
        Path(f"{out}.exit{_RANK[0]}").write_text("alive" if alive else "destroyed")


def _checksum(model: torch.nn.Module) -> float:
    """The sum of every weight. Call it on every rank: gathering an FSDP shard (DTensor) into the full
    parameter is a collective."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return sum(float(p.detach().double().sum()) for p in full)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--task", choices=["detection", "segmentation"], required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num_nodes", type=int, default=1, help="> 1: this process is one node (NODE_RANK, LOCAL_RANK=0 set)")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="with --devices > 1")
    p.add_argument("--fit_steps", type=int, default=0, help="optimiser steps before validating (0: validate only)")
    p.add_argument("--no_validate", action="store_true", help="after fitting, report the weights only (no validation run)")
    p.add_argument("--save_weights", help="write the task's state dict here after fitting")
    p.add_argument("--load_weights", help="load the task's state dict from here before validating")
    p.add_argument("--compile_backbone", default=None, help="detection: DetectionTask's compile_backbone backend")
    p.add_argument("--compare_eager", action="store_true",
                   help="with --compile_backbone: first fit the same task uncompiled (reported as eager_checksum)")
    p.add_argument("--then_fsdp", action="store_true",
                   help="then do the same run under FSDP2 in these processes (reported under 'fsdp')")
    p.add_argument("--then_validate_only", action="store_true",
                   help="then validate the untrained task (no --fit_steps, no --load_weights) under DDP in these "
                        "processes (reported under 'validate_only')")
    p.add_argument("--finetune_at", type=int, default=None,
                   help="fit with Lightning's BackboneFinetuning unfreezing the backbone at this epoch; reports every "
                        "rank's backbone checksum before and after")
    p.add_argument("--root_dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    # registered before vtdense's own handler, so it runs after it (atexit is last in, first out)
    atexit.register(_record_exit, a.out)
    world = a.devices * a.num_nodes

    def make_trainer(root_dir: str, strategy: str = a.strategy, fit_steps: int = a.fit_steps) -> L.Trainer:
        options = dict(accelerator="cpu", strategy=strategy if world > 1 else "auto", precision=a.precision)
        if strategy == "fsdp":
            from vtdense.strategies import trainer_options

            options = trainer_options(options)
        elif a.precision == "16-mixed":
            # Lightning's own fp16 plugin: its CPU flag would quietly run bf16 instead
            from lightning.pytorch.plugins.precision import MixedPrecision

            options.update(precision=None, plugins=[MixedPrecision("16-mixed", "cpu")])
        callbacks = []
        if a.finetune_at is not None:
            from lightning.pytorch.callbacks import BackboneFinetuning

            callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=a.finetune_at))
        return L.Trainer(
            devices=a.devices, num_nodes=a.num_nodes, **options, callbacks=callbacks,
            default_root_dir=root_dir, max_steps=max(fit_steps, 1), num_sanity_val_steps=0,
            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
            limit_val_batches=0 if fit_steps else None,
        )

    from torch._dynamo.utils import counters

    from vtdense.models.compile import is_compiled

    def run(strategy: str, root_dir: str, fit: bool = True) -> dict:
        """Build, (load,) fit and validate the task under ``strategy`` (``fit=False``: validate the
        untrained task); what it reports (collectives: every rank)."""
        before = counters["stats"]["unique_graphs"]
        model, dm = build(a.task, a.data, a.compile_backbone or False)
        trainer = make_trainer(root_dir, strategy, a.fit_steps if fit else 0)
        if not _RANK:
            _RANK.append(trainer.global_rank)
        if a.load_weights and fit:
            model.load_state_dict(torch.load(a.load_weights, weights_only=True))
        before_fit = _checksum(model.backbone) if a.finetune_at is not None else None
        if a.fit_steps and fit:
            trainer.fit(model, datamodule=dm)
            trainer.limit_val_batches = 1.0
            if a.save_weights and trainer.is_global_zero:
                torch.save(model.state_dict(), a.save_weights)
        results = [{}] if a.no_validate else trainer.validate(model, datamodule=dm, verbose=False)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return {"metrics": results[0], "run_dir": str(model.run_dir), "checksum": _checksum(model),
                "world": trainer.world_size, "compiled": is_compiled(model.model),
                "graphs": counters["stats"]["unique_graphs"] - before,
                "sharded": all(hasattr(p, "full_tensor") for p in model.model.parameters()),
                "scaler": type(scaler).__name__ if scaler is not None else None,
                "scale": float(scaler.get_scale()) if scaler is not None else None,
                "dp_size": trainer.strategy.device_mesh["data_parallel"].size() if strategy == "fsdp" and world > 1 else None,
                "global_zero": trainer.is_global_zero,
                "backbone_checksums": None if before_fit is None else [
                    before_fit, *trainer.strategy.all_gather(torch.tensor(_checksum(model.backbone), dtype=torch.float64)).reshape(-1).tolist()],
                "backbone_trainable": None if before_fit is None else all(p.requires_grad for p in model.backbone.parameters())}

    eager_checksum = None
    if a.compare_eager:
        # the same fit without compile first, in these processes (the first fit starts the other ranks;
        # the second trainer finds them started)
        eager, dm = build(a.task, a.data)
        make_trainer(str(Path(a.root_dir) / "eager")).fit(eager, datamodule=dm)
        eager_checksum = _checksum(eager)
    payload = run(a.strategy, a.root_dir)
    payload["eager_checksum"] = eager_checksum
    if a.then_fsdp:  # the same again under FSDP2, in these processes (the trainer joins their process group)
        payload["fsdp"] = run("fsdp", str(Path(a.root_dir) / "fsdp"))
    if a.then_validate_only:  # and the untrained task validated, in these processes again
        payload["validate_only"] = run("ddp", str(Path(a.root_dir) / "validate_only"), fit=False)
    if payload["global_zero"]:
        Path(a.out).write_text(json.dumps(payload))

if __name__ == "__main__":
    main()
