"""Data: COCO detection and ADE20K segmentation (datasets, datamodules, transforms) and synthetic generators."""

from vtdense.data.ade20k import ADE20KDataModule, SegmentationFolder, seg_collate
from vtdense.data.coco import COCODataModule, COCODatasetError, COCODetection, collate_detection
from vtdense.data.errors import BadSampleError, write_skip_report
from vtdense.data.synthetic import make_synthetic_coco, synthetic_coco_root
from vtdense.data.synthetic_seg import generate_synthetic_segmentation
from vtdense.data.transforms import detection_eval_transforms, detection_train_transforms

__all__ = [
    "ADE20KDataModule",
    "BadSampleError",
    "COCODataModule",
    "COCODatasetError",
    "COCODetection",
    "SegmentationFolder",
    "collate_detection",
    "detection_eval_transforms",
    "detection_train_transforms",
    "generate_synthetic_segmentation",
    "make_synthetic_coco",
    "seg_collate",
    "synthetic_coco_root",
    "write_skip_report",
]
