"""Data: COCO detection and ADE20K segmentation (datasets, datamodules, transforms, samplers) and synthetic generators."""

from vtdense.data.ade20k import ADE20KDataModule, SegmentationFolder, seg_collate
from vtdense.data.coco import COCODataModule, COCODatasetError, COCODetection, collate_detection
from vtdense.data.errors import BadSampleError, write_skip_report
from vtdense.data.photometric import PhotoMetricDistortion
from vtdense.data.samplers import (
    EpochRandomSampler,
    GroupedBatchSampler,
    ResumableDataLoader,
    aspect_ratio_group_ids,
    make_train_loader,
)
from vtdense.data.seeding import SampleKey, SeededDataset
from vtdense.data.synthetic import make_synthetic_coco, synthetic_coco_root
from vtdense.data.synthetic_seg import generate_synthetic_segmentation
from vtdense.data.transforms import (
    detection_crop_transforms,
    detection_eval_transforms,
    detection_lsj_transforms,
    detection_train_transforms,
)

__all__ = [
    "ADE20KDataModule",
    "BadSampleError",
    "COCODataModule",
    "COCODatasetError",
    "COCODetection",
    "EpochRandomSampler",
    "GroupedBatchSampler",
    "PhotoMetricDistortion",
    "ResumableDataLoader",
    "SampleKey",
    "SeededDataset",
    "SegmentationFolder",
    "aspect_ratio_group_ids",
    "collate_detection",
    "detection_crop_transforms",
    "detection_eval_transforms",
    "detection_lsj_transforms",
    "detection_train_transforms",
    "generate_synthetic_segmentation",
    "make_synthetic_coco",
    "make_train_loader",
    "seg_collate",
    "synthetic_coco_root",
    "write_skip_report",
]
