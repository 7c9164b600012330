"""ADE20K semantic segmentation with a Swin V2 backbone and UPerNet (or any vtdense backbone / SMP decoder).

With no arguments this trains a small Swin V2 UPerNet on a generated ADE20K-layout set on the
CPU (``configs/ade20k_swinv2_demo.yaml``) and prints the final metrics. The published recipe
(Swin V2-T UPerNet, 160k iterations, batch 16)::

    python recipes/ade20k_swinv2.py --config recipes/configs/ade20k_swinv2_t_upernet_160k.yaml \\
        --data.root /data/ade20k --trainer.devices 8 --trainer.precision bf16-mixed

Every option is a flag (``--help``, ``--print_config``); see ``vtdense.cli.run_recipe``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from vtdense.cli import run_recipe  # noqa: E402
from vtdense.data.ade20k import ADE20KDataModule  # noqa: E402
from vtdense.tasks.segmentation import SegmentationTask  # noqa: E402

__all__ = ["DEFAULT_CONFIG", "main"]

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "ade20k_swinv2_demo.yaml"


def main(args: list[str] | None = None) -> dict[str, float]:
    """Run the recipe; ``args`` defaults to the command line."""
    return run_recipe(SegmentationTask, ADE20KDataModule, default_config=DEFAULT_CONFIG, args=args)


if __name__ == "__main__":
    main()
