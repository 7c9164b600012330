"""Data: COCO detection (dataset, datamodule, transforms) and synthetic generators."""

from vtdense.data.coco import COCODataModule, COCODatasetError, COCODetection, collate_detection
from vtdense.data.synthetic import make_synthetic_coco, synthetic_coco_root
from vtdense.data.transforms import detection_eval_transforms, detection_train_transforms

__all__ = [
    "COCODataModule",
    "COCODatasetError",
    "COCODetection",
    "collate_detection",
    "detection_eval_transforms",
    "detection_train_transforms",
    "make_synthetic_coco",
    "synthetic_coco_root",
]
