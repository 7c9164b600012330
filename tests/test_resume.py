"""Kill a real training process and resume it: the result equals a run that was never stopped.

Each recipe runs as a subprocess (``OMP_NUM_THREADS=1``, float32, CPU) with ``last.ckpt`` written
every 2 optimiser steps. One run goes uninterrupted; another is killed with SIGKILL right after a
mid-epoch checkpoint (detection), or sent SIGTERM, which writes its own checkpoint (segmentation),
and is then resumed with ``--ckpt_path last``. The final weights must be bit-identical and the metrics equal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from vtdense.data.synthetic import make_synthetic_coco
from vtdense.data.synthetic_seg import generate_synthetic_segmentation

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(key, None)
    return env


def _detection_args(root: Path, out: Path) -> list[str]:
    from tests.test_recipe_coco import tiny_args

    return ["recipes/coco_swin.py", *tiny_args(root, out), "--trainer.max_epochs=2", "--trainer.check_val_every_n_epoch=1",
            "--model.checkpoint_every_n_steps=2", "--model.warmup_steps=2", "--data.persistent_workers=false"]


def _segmentation_args(root: Path, out: Path) -> list[str]:
    config = {
        "model": {"backbone_kwargs": {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 4], "window_size": 4},
                  "arch_kwargs": {"decoder_channels": 16}, "aux_channels": 16, "num_vis": 1, "warmup_steps": 2,
                  "checkpoint_every_n_steps": 2},
        "data": {"root": str(root), "batch_size": 2, "val_batch_size": 2, "num_workers": 0, "scale": [64, 48],
                 "crop_size": [32, 32]},
        "trainer": {"default_root_dir": str(out), "enable_progress_bar": False, "enable_model_summary": False,
                    "max_epochs": 2, "max_steps": -1, "check_val_every_n_epoch": 1, "val_check_interval": None,
                    "log_every_n_steps": 1},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiny.yaml").write_text(yaml.safe_dump(config))
    return ["recipes/ade20k_swinv2.py", "--config", str(CONFIGS / "ade20k_swinv2_demo.yaml"), "--config", str(out / "tiny.yaml")]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _finish(args: list[str], log: Path) -> None:
    proc = _start(args, log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]


def _step_of(path: Path) -> tuple[int, int]:
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    return int(ckpt["global_step"]), int(ckpt["epoch"])


def _final(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    runs = sorted((out / "lightning_logs").glob("version_*"))
    assert len(runs) == 1, runs  # the resumed run continued in the same run directory
    ckpt = torch.load(runs[0] / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    return ckpt["state_dict"], json.loads((runs[0] / "metrics.json").read_text())["metrics"]


def _interrupt_and_resume(args_for, root: Path, tmp: Path, sig: int) -> tuple[Path, int]:
    sig = int(sig)
    out = tmp / f"killed_{sig}"
    args = args_for(root, out)
    proc = _start(args, tmp / f"first_{sig}.log")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if list(out.glob("lightning_logs/version_*/checkpoints/last.ckpt")):
            proc.send_signal(sig)  # right after the first (mid-epoch, step 2) checkpoint
            break
        time.sleep(0.02)
    code = proc.wait(timeout=120)
    assert code != 0 or sig == signal.SIGTERM, (tmp / f"first_{sig}.log").read_text()[-3000:]
    last = next(out.glob("lightning_logs/version_*/checkpoints/last.ckpt"))
    step, _ = _step_of(last)
    _finish(args + ["--ckpt_path", "last"], tmp / f"resume_{sig}.log")
    log = (tmp / f"resume_{sig}.log").read_text()
    # the restored state, read in the resumed process: a run that ignored the checkpoint would train
    # the same deterministic steps from scratch to the same weights, and print no such line
    assert re.search(rf"^resumed at epoch \d+, step {step} from \S*last\.ckpt$", log, re.M), log[-3000:]
    return out, step


def _assert_same(reference: Path, resumed: Path) -> None:
    sd_ref, m_ref = _final(reference)
    sd_res, m_res = _final(resumed)
    assert sd_ref.keys() == sd_res.keys()
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_res[k]), k
    assert m_ref == m_res


@pytest.fixture(scope="module")
def coco6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_coco(tmp_path_factory.mktemp("resume") / "coco", num_train=6, num_val=2, size_range=(64, 96),
                               num_classes=2, seed=7)


@pytest.fixture(scope="module")
def ade6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_synthetic_segmentation(tmp_path_factory.mktemp("resume") / "ade", num_train=12, num_val=2,
                                           size_range=(48, 64), seed=8)


def test_detection_sigkill_mid_epoch_resumes_to_the_same_weights(coco6: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    _finish(_detection_args(coco6, reference), tmp_path / "reference.log")
    resumed, step = _interrupt_and_resume(_detection_args, coco6, tmp_path, signal.SIGKILL)
    # killed after the step-2 checkpoint (epoch 0 of 3 steps), or, when the machine is loaded and
    # the poll comes late, after the step-4 one (epoch 1): mid-epoch either way
    assert step in (2, 4)
    _assert_same(reference, resumed)


def test_segmentation_sigterm_resumes_to_the_same_weights(ade6: Path, tmp_path: Path) -> None:
    """(SIGKILL after a step checkpoint is the detection test's; segmentation takes the signal a
    cluster sends before it preempts a job.)"""
    reference = tmp_path / "reference"
    _finish(_segmentation_args(ade6, reference), tmp_path / "reference.log")
    # SIGTERM: the process writes last.ckpt at the end of the batch it was in. The signal is sent
    # right after the step-2 checkpoint, so that is step 3, or step 2 itself when it lands between
    # the step checkpoint and the end of that batch (a short window, longer on a loaded machine).
    resumed, step = _interrupt_and_resume(_segmentation_args, ade6, tmp_path, signal.SIGTERM)
    log = (tmp_path / f"first_{int(signal.SIGTERM)}.log").read_text()
    saved = re.search(r"SIGTERM: saved \S+ at step (\d+)", log)
    assert saved, log[-3000:]
    assert int(saved.group(1)) == step  # last.ckpt is the one the signal wrote
    assert 2 <= step < 6
    _assert_same(reference, resumed)
