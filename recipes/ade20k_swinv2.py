"""ADE20K semantic segmentation with a Swin V2 backbone and UPerNet (or any vtdense backbone / SMP decoder).

With no arguments this trains a small Swin V2 UPerNet on a generated ADE20K-layout set on the
CPU (``configs/ade20k_swinv2_demo.yaml``) and prints the final metrics. The published recipe
(Swin V2-T UPerNet, 160k iterations, batch 16)::

    python recipes/ade20k_swinv2.py --data.root /data/ade20k --trainer.devices 8 --trainer.precision bf16-mixed

Given data (``--data.root``, or a dataset at the default location), the published config is the
base; ``--config file.yaml`` replaces it entirely. Every option is a flag (``--help``, ``--print_config``); see ``vtdense.cli.run_recipe``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, which keeps a CPU
# run from slowing down several-fold when another job shares the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from vtdense.cli import run_recipe, run_script  # noqa: E402
from vtdense.data.ade20k import ADE20KDataModule  # noqa: E402
from vtdense.tasks.segmentation import SegmentationTask  # noqa: E402

__all__ = ["DEFAULT_CONFIG", "DEMO_CONFIG", "main"]

CONFIGS = Path(__file__).resolve().parent / "configs"
#: The published recipe, used whenever data is given (--data.root, --config) or found.
DEFAULT_CONFIG = CONFIGS / "ade20k_swinv2_t_upernet_160k.yaml"
#: The CPU demo on built-in synthetic data, used when no data is given or found.
DEMO_CONFIG = CONFIGS / "ade20k_swinv2_demo.yaml"


def main(args: list[str] | None = None) -> dict[str, float]:
    """Run the recipe; ``args`` defaults to the command line."""
    return run_recipe(SegmentationTask, ADE20KDataModule, default_config=DEFAULT_CONFIG, demo_config=DEMO_CONFIG, args=args)


if __name__ == "__main__":
    run_script(main)
