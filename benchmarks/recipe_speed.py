"""The detection recipe end to end, as a user runs it, against its isolated training step.

``python recipes/coco_swin.py`` runs in a subprocess with :class:`StepTimer` added to the trainer's
callbacks. The timer records when every training step ends, and after the last one times the
model's own step (forward, backward, AdamW) on the last few batches of the run in the same process:
the isolated step, with no data loading, logging or Lightning in between, on the same mix of shapes. The report gives images per second

- over the whole run (from the start of training: first-shape set-up and start-up included),
- after the first ``warmup`` steps (the steady rate a long run sees),
- and of the isolated step,

On the CPU it runs the demo config (the published one takes tens of seconds per step there); with
``--device cuda`` the published config on one GPU in bf16, over the built-in synthetic data written
in COCO layout (images are resized to the published 480-800 scales like real ones)::

    python benchmarks/recipe_speed.py --device cpu --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, "recipes", "coco_swin.py")
sys.path.insert(0, HERE)

from common import sync  # noqa: E402


class StepTimer(Callback):
    """Times every training step of a run, then the isolated step on the last batches; writes JSON.

    Args:
        out: JSON file written at the end of training.
        isolated_batches: how many of the run's last batches the isolated step is timed on.
        isolated_repeats: timed passes over them (after one untimed pass).
    """

    def __init__(self, out: str, isolated_batches: int = 5, isolated_repeats: int = 2) -> None:
        self.out = out
        self.isolated_batches = isolated_batches
        self.isolated_repeats = isolated_repeats
        self.start = 0.0
        self.ends: list[float] = []
        self.images: list[int] = []
        self.last: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sync(str(pl_module.device))
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        sync(str(pl_module.device))
        self.ends.append(time.perf_counter())
        self.images.append(len(batch[0]))
        self.last = (self.last + [batch])[-self.isolated_batches:]

    def _isolated(self, trainer: Trainer, pl_module: LightningModule) -> list[float]:
        """Seconds per image of each timed pass over the kept batches."""
        params = [p for p in pl_module.parameters() if p.requires_grad]
        # the AdamW implementation the run stepped with (fused where the task chose it)
        fused = any(g.get("fused") for opt in trainer.optimizers for g in opt.param_groups)
        opt = torch.optim.AdamW(params, lr=1e-6, fused=fused)
        pl_module.train()
        per_image = []
        for i in range(1 + self.isolated_repeats):
            total, images_seen = 0.0, 0
            for images, targets in self.last:
                train_targets = [pl_module._train_target(t) for t in targets]
                sync(str(pl_module.device))
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with trainer.precision_plugin.train_step_context():
                    losses = pl_module(list(images), train_targets)
                sum(losses.values()).backward()
                opt.step()
                sync(str(pl_module.device))
                total += time.perf_counter() - t
                images_seen += len(images)
            if i >= 1:
                per_image.append(total / images_seen)
        return per_image

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.ends or not trainer.is_global_zero:
            return
        isolated = self._isolated(trainer, pl_module)
        payload = dict(start=self.start, ends=self.ends, images=self.images, isolated_s_per_image=isolated,
                       isolated_batches=len(self.last), batch=max(self.images), device=str(pl_module.device),
                       precision=str(trainer.precision))
        with open(self.out, "w") as f:
            json.dump(payload, f)


def summarise(timing: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Images per second over the run, after ``warmup`` steps, and of the isolated step."""
    ends, images = timing["ends"], timing["images"]
    total = sum(images) / (ends[-1] - timing["start"])
    warmup = min(warmup, len(ends) - 2)
    steady = sum(images[warmup + 1:]) / (ends[-1] - ends[warmup])
    iso = min(timing["isolated_s_per_image"])
    return dict(steps=len(ends), warmup_steps=warmup, batch=timing["batch"], precision=timing["precision"],
                images_per_s_whole_run=total, images_per_s_after_warmup=steady,
                images_per_s_isolated_step=1 / iso, isolated_batches=timing["isolated_batches"],
                first_step_s=ends[0] - timing["start"])


def run(device: str = "cpu", steps: int = 40, warmup: int = 10, data_root: str | None = None,
        timeout: float = 900) -> dict[str, Any]:
    """Run the recipe for ``steps`` training steps in a subprocess; :func:`summarise` of its timing."""
    with tempfile.TemporaryDirectory(prefix="vtdense-recipe-") as tmp:
        out = os.path.join(tmp, "timing.json")
        timer = json.dumps({"class_path": "recipe_speed.StepTimer", "init_args": {"out": out}})
        cmd = [sys.executable, RECIPE, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
               f"--trainer.default_root_dir={tmp}", "--trainer.enable_progress_bar=false",
               f"--trainer.callbacks+={timer}"]
        if device == "cuda":
            if data_root is None:
                from vtdense.data.synthetic import synthetic_coco_root

                data_root = str(synthetic_coco_root())
            cmd += [f"--data.root={data_root}", "--trainer.devices=1", "--trainer.accelerator=gpu",
                    "--trainer.precision=bf16-mixed", "--model.num_vis_images=0"]
        elif data_root is not None:
            cmd += [f"--data.root={data_root}", "--trainer.accelerator=cpu", "--trainer.devices=1"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.isfile(out):
            raise RuntimeError(f"the recipe failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            timing = json.load(f)
    report = summarise(timing, warmup)
    report.update(device=device, config="published, bf16, 1 GPU" if device == "cuda" else "CPU demo",
                  process_s=time.perf_counter() - t)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    """The report as Markdown lines (a section of RESULTS.md)."""
    r = report
    return [f"### Recipe end to end: `recipes/coco_swin.py`, {r['config']}, {r['steps']} steps of batch {r['batch']}", "",
            "| measure | img/s | vs isolated step |", "|---|---|---|",
            f"| whole run, first step and start-up included | {r['images_per_s_whole_run']:.2f} | "
            f"{r['images_per_s_whole_run'] / r['images_per_s_isolated_step']:.2f} |",
            f"| after {r['warmup_steps']} warm-up steps | {r['images_per_s_after_warmup']:.2f} | "
            f"{r['images_per_s_after_warmup'] / r['images_per_s_isolated_step']:.2f} |",
            f"| isolated step (the run's last {r['isolated_batches']} batches, same process) | "
            f"{r['images_per_s_isolated_step']:.2f} | 1.00 |", "",
            f"First step: {r['first_step_s']:.1f} s; the whole process, start-up and final validation included: "
            f"{r['process_s']:.0f} s."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--data-root", default=None, help="COCO-layout data (default: the demo's built-in data)")
    args = ap.parse_args(argv)
    report = run(args.device, args.steps, args.warmup, args.data_root)
    print("\n".join(markdown(report)))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
