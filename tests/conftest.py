"""Shared test fixtures: tiny generated datasets and helpers to edit copies of them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from vtdense.data.synthetic import make_synthetic_coco

# The CPU linear layers' backend, fixed for this process and every subprocess the tests start. Left
# at "auto", each process times both backends at its first call and keeps the faster: on a loaded
# machine two processes can choose differently, and runs that must match to 1e-4 (one node against
# two, a resumed run against an uninterrupted one) then differ by float rounding grown over a few
# optimizer steps (seen once: a checksum of 1591.4933 against 1591.4955). The probe itself is tested
# in subprocesses that set "auto" (tests/test_cpu_linear.py).
os.environ.setdefault("VTDENSE_CPU_MATMUL", "onednn" if torch.backends.mkldnn.is_available() else "blas")

# The recipes' entry point (vtdense.cli.run_script) tells glibc to keep freed memory. Several tests call
# it inside this process, which would change the allocator of every test after them (and their RSS
# readings). It is off here and in the tests' subprocesses; tests/test_allocator.py checks it.
os.environ.setdefault("VTDENSE_KEEP_FREED_MEMORY", "0")

# Under pytest-xdist the workers share the machine's cores: each computes on one thread, as the tests'
# subprocesses do (OMP_NUM_THREADS=1). Two workers with a thread per core each oversubscribed a 2-core
# machine, and a tiny op's OpenMP threads then wait on each other: a compile test ran 20% slower.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

#: Options of the session-wide tiny COCO dataset (3 classes: category ids 1, 3, 7).
TINY_COCO_OPTIONS: dict[str, Any] = {
    "num_train": 12,
    "num_val": 6,
    "size_range": (96, 128),
    "num_classes": 3,
    "max_objects": 4,
    "with_crowd": True,
    "with_gray": True,
    "with_rgba": True,
    "with_palette": True,
    "seed": 0,
}


@pytest.fixture(scope="session")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic COCO dataset: 12 train / 6 val images of 96-128 px.

    It has empty images, crowd annotations (uncompressed RLE on image 0, compressed RLE on
    image 1 of each split), and grayscale / RGBA / palette images at indices 1 / 2 / 3.
    Treat it as read-only; use :func:`coco_copy` to edit annotations.
    """
    return make_synthetic_coco(tmp_path_factory.mktemp("data") / "coco", **TINY_COCO_OPTIONS)


@pytest.fixture
def load_ann(coco_root: Path) -> Callable[[str], dict[str, Any]]:
    """Return a fresh copy of a split's annotation dict (``"train2017"`` or ``"val2017"``)."""

    def load(split: str = "val2017") -> dict[str, Any]:
        with open(coco_root / "annotations" / f"instances_{split}.json", encoding="utf-8") as f:
            return json.load(f)

    return load


@pytest.fixture
def write_ann(tmp_path: Path) -> Callable[[dict[str, Any] | str, str], Path]:
    """Write an annotation dict (or raw text) to ``tmp_path/<name>`` and return its path."""

    def write(content: dict[str, Any] | str, name: str = "instances.json") -> Path:
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
        return path

    return write


@pytest.fixture
def coco_copy(coco_root: Path, tmp_path: Path) -> Path:
    """A writable copy of the tiny COCO dataset (annotations copied, image folders symlinked)."""
    dst = tmp_path / "coco_copy"
    (dst / "annotations").mkdir(parents=True)
    for split in ("train2017", "val2017"):
        shutil.copy(coco_root / "annotations" / f"instances_{split}.json", dst / "annotations")
        (dst / split).symlink_to(coco_root / split, target_is_directory=True)
    return dst
