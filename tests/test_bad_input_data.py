"""Bad input to the datasets: one clear error at start-up, or a counted skip at load time with a report.

Each test is one row of the README's "Bad input: what you see" table.
"""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vtdense.data import COCODatasetError, COCODetection, SegmentationFolder, collate_detection
from vtdense.data.errors import SKIP_REPORT_NAME, BadSampleError, read_skip_report, write_skip_report
from vtdense.data.synthetic_seg import generate_synthetic_segmentation

CATS = [{"id": 1, "name": "thing"}, {"id": 2, "name": "other"}]


def write_coco(root: Path, images: list[tuple[str, int, int]], anns: list[dict[str, Any]] | None = None,
               **extra: Any) -> Path:
    """Write ``root/ann.json`` for ``images`` = [(file_name, height, width)] (ids 1..n); return its path."""
    root.mkdir(parents=True, exist_ok=True)
    data = {
        "images": [{"id": i + 1, "file_name": f, "height": h, "width": w} for i, (f, h, w) in enumerate(images)],
        "annotations": anns if anns is not None else [],
        "categories": CATS,
        **extra,
    }
    path = root / "ann.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def ann(ann_id: int, image_id: int, bbox: list[float], category_id: int = 1, **kw: Any) -> dict[str, Any]:
    return {"id": ann_id, "image_id": image_id, "category_id": category_id, "bbox": bbox, "iscrowd": 0, **kw}


def solid(path: Path, h: int, w: int, colour: tuple[int, int, int] = (90, 120, 150), **save: Any) -> None:
    Image.new("RGB", (w, h), colour).save(path, **save)


@pytest.fixture
def four_images(tmp_path: Path) -> Path:
    """A folder with four distinct 24x32 PNGs a..d (red channel = 10 * index)."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, name in enumerate("abcd"):
        solid(folder / f"{name}.png", 24, 32, (10 * i, 0, 0))
    return folder


# ------------------------------------------------------------------------------- start-up errors
def test_empty_dataset_is_an_error_at_start_up(tmp_path: Path) -> None:
    path = write_coco(tmp_path, [])
    with pytest.raises(COCODatasetError, match=rf"{path}: the dataset is empty"):
        COCODetection(tmp_path, path)
    (tmp_path / "seg" / "images" / "training").mkdir(parents=True)
    (tmp_path / "seg" / "annotations" / "training").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images"):
        SegmentationFolder(tmp_path / "seg", "training", 3)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{'images': []}", r"is not a valid COCO JSON file: Expecting property name"),
        (b"\xff\xfe\x00garbage", r"is not a valid COCO JSON file"),
        (b'{"images": [], "categories": []}', r"missing list 'annotations' \(an image-info file"),
        (b'{"annotations": [], "categories": []}', r"missing list 'images'"),
        (b'{"images": {}, "annotations": [], "categories": []}', r"'images' is a dict, not a list"),
    ],
)
def test_annotation_file_not_coco_json(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(COCODatasetError, match=message) as info:
        COCODetection(tmp_path, path)
    assert str(info.value).startswith(str(path))


def test_duplicate_image_and_annotation_ids(tmp_path: Path) -> None:
    solid(tmp_path / "a.png", 20, 20)
    solid(tmp_path / "b.png", 20, 20)
    path = write_coco(tmp_path, [("a.png", 20, 20), ("b.png", 20, 20)])
    data = json.loads(path.read_text())
    data["images"][1]["id"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(COCODatasetError, match=r"duplicate image id 1 \(a.png and b.png\)"):
        COCODetection(tmp_path, path)
    path = write_coco(tmp_path, [("a.png", 20, 20), ("b.png", 20, 20)], [ann(5, 1, [1, 1, 5, 5]), ann(5, 2, [1, 1, 5, 5])])
    with pytest.raises(COCODatasetError, match=r"ann.json: duplicate annotation id 5"):
        COCODetection(tmp_path, path)


def test_image_size_in_json_must_be_positive_integers(tmp_path: Path) -> None:
    solid(tmp_path / "a.png", 20, 20)
    path = write_coco(tmp_path, [("a.png", 0, 20)])
    with pytest.raises(COCODatasetError, match=r"image id 1 \(a.png\) has height=0"):
        COCODetection(tmp_path, path)


# ------------------------------------------------------------------------------------- boxes
def test_boxes_outside_the_image_are_clipped_or_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    solid(tmp_path / "a.png", 40, 60)
    anns = [
        ann(1, 1, [-10, -5, 30, 20]),     # partly outside: clipped to [0, 0, 20, 15]
        ann(2, 1, [50, 30, 40, 40]),      # partly outside: clipped to [50, 30, 60, 40]
        ann(3, 1, [70, 10, 10, 10]),      # entirely right of the image: nothing left after clipping
        ann(4, 1, [10, -30, 10, 10]),     # entirely above the image
    ]
    path = write_coco(tmp_path, [("a.png", 40, 60)], anns)
    with caplog.at_level(logging.WARNING, logger="vtdense.data.coco"):
        train = COCODetection(tmp_path, path, train=True)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "vtdense.data.coco"]
    assert "dropped 2 degenerate annotations (2 empty after clipping to the image" in warning
    assert "first: annotation 3 of image id 1" in warning and str(path) in warning
    assert [(r["annotation_id"], r["when"]) for r in train.skipped] == [(3, "start-up"), (4, "start-up")]
    _, t = train[0]
    assert t["boxes"].tolist() == [[0, 0, 20, 15], [50, 30, 60, 40]]
    assert t["masks"].shape == (2, 40, 60)
    # evaluation keeps all four; its original-coordinate boxes are the JSON's, as pycocotools reads them
    ev = COCODetection(tmp_path, path, train=False)
    _, t = ev[0]
    assert t["orig_boxes"].tolist() == [[-10, -5, 20, 15], [50, 30, 90, 70], [70, 10, 80, 20], [10, -30, 20, -20]]
    assert ev.skipped == []


def test_zero_area_and_negative_boxes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    solid(tmp_path / "a.png", 40, 60)
    anns = [
        ann(1, 1, [5, 5, 10, 10]),
        ann(2, 1, [5, 5, 0, 10]),                 # zero width
        ann(3, 1, [5, 5, 10, 10], area=0.0),      # zero area
        ann(4, 1, [30, 20, -10, 5]),              # negative width
        ann(5, 1, [30, 20, 5, -5]),               # negative height
    ]
    path = write_coco(tmp_path, [("a.png", 40, 60)], anns)
    with caplog.at_level(logging.WARNING, logger="vtdense.data.coco"):
        train = COCODetection(tmp_path, path, train=True)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "vtdense.data.coco"]
    assert "dropped 4 degenerate annotations" in warning
    assert "1 zero width or height" in warning and "1 zero area" in warning and "2 negative width or height" in warning
    assert {r["annotation_id"]: r["reason"] for r in train.skipped} == {
        2: "annotation dropped: zero width or height", 3: "annotation dropped: zero area",
        4: "annotation dropped: negative width or height", 5: "annotation dropped: negative width or height",
    }
    assert train[0][1]["boxes"].tolist() == [[5, 5, 15, 15]]
    # evaluation keeps the zero-size ones (pycocotools scores them as unmatched ground truth) but
    # drops negative sizes, which no tool can score
    ev = COCODetection(tmp_path, path, train=False)
    assert ev[0][1]["orig_boxes"].shape == (3, 4)
    assert [r["annotation_id"] for r in ev.skipped] == [4, 5]


def test_invalid_area_names_the_annotation(tmp_path: Path) -> None:
    solid(tmp_path / "a.png", 40, 60)
    path = write_coco(tmp_path, [("a.png", 40, 60)], [ann(9, 1, [5, 5, 10, 10], area="big")])
    with pytest.raises(COCODatasetError, match="annotation 9 has an invalid area 'big'"):
        COCODetection(tmp_path, path)


# ------------------------------------------------------------------------- load-time skipping
def _broken_files(folder: Path) -> None:
    """b.png becomes random bytes, c.png the first half of a valid PNG (truncated)."""
    (folder / "b.png").write_bytes(np.random.default_rng(0).bytes(500))
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, "PNG")
    (folder / "c.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_undecodable_and_truncated_images_are_skipped_at_load_time(
    four_images: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_coco(four_images, [(f"{n}.png", 24, 32) for n in "abcd"], [ann(1, 1, [1, 1, 5, 5])])
    _broken_files(four_images)
    ds = COCODetection(four_images, path)  # start-up only checks that the files exist
    with caplog.at_level(logging.WARNING, logger="vtdense.data.errors"):
        ids = [t["image_id"] for _, t in (ds[i] for i in range(4))]
    # each bad index is replaced by the next loadable one: deterministic, batch sizes unchanged
    assert ids == [1, 4, 4, 4]
    messages = [r.getMessage() for r in caplog.records if r.name == "vtdense.data.errors"]
    assert len(messages) == 2
    assert "1 so far" in messages[0] and f"{four_images / 'b.png'} (image id 2) not an image PIL can read" in messages[0]
    assert "2 so far" in messages[1] and f"{four_images / 'c.png'} (image id 3) cannot be decoded" in messages[1]
    assert [(r["image_id"], r["when"]) for r in ds.skipped] == [(2, "load"), (3, "load")]
    # a bad index is not decoded again, and does not warn again, in the same process
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtdense.data.errors"):
        assert ds[1][1]["image_id"] == 4
    assert not caplog.records
    strict = COCODetection(four_images, path, on_bad_sample="error")
    with pytest.raises(COCODatasetError, match=r"c.png \(image id 3\) cannot be decoded"):
        strict[2]


def test_skips_in_dataloader_workers_reach_the_report(four_images: Path, tmp_path: Path) -> None:
    path = write_coco(four_images, [(f"{n}.png", 24, 32) for n in "abcd"])
    _broken_files(four_images)
    ds = COCODetection(four_images, path)
    run_dir = tmp_path / "run"
    ds.skip_file = write_skip_report(ds.skipped, run_dir)
    assert ds.skip_file == run_dir / SKIP_REPORT_NAME and read_skip_report(ds.skip_file) == []

    def epoch(workers: int) -> list[int]:
        loader = DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=collate_detection)
        return [t["image_id"] for _, targets in loader for t in targets]

    assert epoch(2) == epoch(0) == [1, 4, 4, 4]  # same samples with and without worker processes
    records = read_skip_report(ds.skip_file)
    # workers and the main process each met both files; the report lists each once
    assert sorted((Path(r["file"]).name, r["image_id"]) for r in records) == [("b.png", 2), ("c.png", 3)]


def test_all_images_bad_is_one_error(tmp_path: Path) -> None:
    for n in "ab":
        (tmp_path / f"{n}.png").write_bytes(b"not an image")
    path = write_coco(tmp_path, [("a.png", 4, 4), ("b.png", 4, 4)])
    with pytest.raises(BadSampleError, match=r"none of its 2 samples could be loaded; first problem: .*a.png"):
        COCODetection(tmp_path, path)[0]


def test_write_skip_report_replaces_and_append_dedupes(tmp_path: Path) -> None:
    from vtdense.data.errors import append_skip_record, skip_record

    first = [skip_record("x.json", "annotation dropped: zero area", image_id=1, annotation_id=7, when="start-up")]
    path = write_skip_report(first, tmp_path / "run")
    assert read_skip_report(path) == first
    rec = skip_record("b.png", "cannot be decoded", image_id=2)
    append_skip_record(path, rec)
    append_skip_record(path, rec)
    assert read_skip_report(path) == first + [rec]
    with open(path, "a", encoding="utf-8") as f:  # a line cut by a kill is ignored on reading
        f.write('{"file": "cut')
    assert read_skip_report(path) == first + [rec]
    assert write_skip_report([], tmp_path / "run") == path and read_skip_report(path) == []
    assert [p.name for p in (tmp_path / "run").iterdir()] == [SKIP_REPORT_NAME]


def test_missing_image_at_load_time_is_skipped(four_images: Path) -> None:
    path = write_coco(four_images, [(f"{n}.png", 24, 32) for n in "abcd"])
    ds = COCODetection(four_images, path)
    (four_images / "a.png").unlink()  # deleted after start-up
    assert ds[0][1]["image_id"] == 2
    assert "image file not found" in ds.skipped[0]["reason"]


# ------------------------------------------------------------------------- pixel modes, EXIF
def _mode_images() -> dict[str, tuple[Image.Image, tuple[int, int, int]]]:
    """PIL images in awkward modes, each with the RGB value its pixels must decode to."""
    pal = Image.new("P", (8, 6), 1)
    pal.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 0
    return {
        "gray.png": (Image.new("L", (8, 6), 77), (77, 77, 77)),
        "bilevel.png": (Image.new("1", (8, 6), 1), (255, 255, 255)),
        "rgba.png": (Image.new("RGBA", (8, 6), (10, 20, 30, 0)), (10, 20, 30)),
        "la.png": (Image.new("LA", (8, 6), (40, 128)), (40, 40, 40)),
        "palette.png": (pal, (200, 100, 50)),
        "palette_transparent.png": (pal_t, (200, 100, 50)),
        # 16-bit grayscale: PIL's convert("RGB") clips these to 255 (all white)
        "gray16.png": (Image.fromarray(np.full((6, 8), 32896, np.uint16)), (128, 128, 128)),
        "int32.tif": (Image.fromarray(np.full((6, 8), 65535, np.int32)), (255, 255, 255)),
        "float.tif": (Image.fromarray(np.full((6, 8), 0.5, np.float32)), (128, 128, 128)),
        "cmyk.jpg": (Image.new("CMYK", (8, 6), (0, 255, 255, 0)), (255, 0, 0)),
    }


def test_pixel_modes_become_correct_rgb(tmp_path: Path) -> None:
    from vtdense.data.images import decode_image

    modes = _mode_images()
    images = []
    for name, (img, _) in modes.items():
        img.save(tmp_path / name, **({"quality": 100} if name.endswith(".jpg") else {}))
        images.append((name, 6, 8))
    opened = {name: Image.open(tmp_path / name).mode for name in modes}
    assert opened["gray16.png"] == "I;16" and opened["cmyk.jpg"] == "CMYK" and opened["float.tif"] == "F"
    ds = COCODetection(tmp_path, write_coco(tmp_path, images))
    for i, (name, (_, rgb)) in enumerate(modes.items()):
        image, target = ds[i]
        assert target["image_id"] == i + 1 and image.shape == (3, 6, 8)
        got = (image[:, 3, 4] * 255).round().tolist()
        tol = 3 if name.endswith(".jpg") else 0
        assert all(abs(g - e) <= tol for g, e in zip(got, rgb)), (name, got, rgb)
        assert decode_image(tmp_path / name).image.mode == "RGB"
    assert ds.skipped == []


def _exif_jpeg(path: Path, displayed: np.ndarray, orientation: int) -> None:
    """Save ``displayed`` (H, W, 3) as a JPEG whose stored pixels need ``orientation`` to display it."""
    img = Image.fromarray(displayed)
    stored = {1: img, 6: img.transpose(Image.Transpose.ROTATE_90), 8: img.transpose(Image.Transpose.ROTATE_270),
              3: img.transpose(Image.Transpose.ROTATE_180)}[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, exif=exif, quality=95)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotated_jpeg_boxes_match_the_rotated_pixels(tmp_path: Path, orientation: int) -> None:
    displayed = np.zeros((40, 64, 3), np.uint8)
    displayed[5:15, 40:60] = (255, 255, 255)  # a white patch at x 40-60, y 5-15 as displayed
    _exif_jpeg(tmp_path / "r.jpg", displayed, orientation)
    assert Image.open(tmp_path / "r.jpg").size == ((64, 40) if orientation == 3 else (40, 64))  # stored (W, H)
    path = write_coco(tmp_path, [("r.jpg", 40, 64)], [ann(1, 1, [40, 5, 20, 10])])
    image, target = COCODetection(tmp_path, path)[0]
    assert image.shape == (3, 40, 64)
    x0, y0, x1, y1 = (int(v) for v in target["boxes"][0])
    inside, outside = image[:, y0:y1, x0:x1], image.clone()
    outside[:, y0:y1, x0:x1] = 0
    assert inside.mean() > 0.9 and outside.max() < 0.2


def test_exif_size_disagreeing_with_json_names_the_orientation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _exif_jpeg(tmp_path / "r.jpg", np.zeros((40, 64, 3), np.uint8), 6)
    solid(tmp_path / "ok.png", 30, 30)
    # the JSON was made from the stored (unrotated) pixels: 64 high, 40 wide
    path = write_coco(tmp_path, [("r.jpg", 64, 40), ("ok.png", 30, 30)])
    ds = COCODetection(tmp_path, path)
    with caplog.at_level(logging.WARNING, logger="vtdense.data.errors"):
        assert ds[0][1]["image_id"] == 2
    [message] = [r.getMessage() for r in caplog.records]
    assert f"{tmp_path / 'r.jpg'} (image id 1) is stored as 64x40 (HxW) with EXIF orientation 6" in message
    assert "displayed as 40x64" in message and "says 64x40" in message and "made on the stored pixels" in message
    with pytest.raises(COCODatasetError, match="EXIF orientation 6"):
        COCODetection(tmp_path, path, on_bad_sample="error")[0]


# ------------------------------------------------------------------------------ label maps
@pytest.fixture
def seg_root(tmp_path: Path) -> Path:
    return generate_synthetic_segmentation(tmp_path / "ade", num_train=3, num_val=1, size_range=(32, 40), seed=2)


@pytest.mark.parametrize("defect", ["size", "class", "mode", "truncated"])
def test_bad_label_map_is_skipped_at_load_time(seg_root: Path, defect: str, caplog: pytest.LogCaptureFixture) -> None:
    labels = sorted((seg_root / "annotations" / "training").glob("*.png"))
    victim = labels[0]
    h, w = np.asarray(Image.open(victim)).shape
    if defect == "size":
        Image.fromarray(np.ones((h + 1, w), np.uint8)).save(victim)
        expected = f"label map {victim} is {w}x{h + 1} \\(WxH\\) but its image .* is {w}x{h}"
    elif defect == "class":
        Image.fromarray(np.full((h, w), 200, np.uint8)).save(victim)
        expected = f"label map {victim} holds class value 200, above the class count"
    elif defect == "mode":
        Image.new("RGB", (w, h)).save(victim)
        expected = f"label map {victim} has mode 'RGB'"
    else:
        victim.write_bytes(victim.read_bytes()[:60])
        expected = f"label map {victim} cannot be decoded"
    ds = SegmentationFolder(seg_root, "training", 8)
    with caplog.at_level(logging.WARNING, logger="vtdense.data.errors"):
        sample = ds[0]
    assert torch.equal(sample["mask"], ds[1]["mask"])  # the next sample took its place
    assert sample["substitute"] is True and ds[1]["substitute"] is False  # so evaluation can leave it out
    [message] = [r.getMessage() for r in caplog.records]
    assert "1 so far" in message
    assert [r["file"] for r in ds.skipped] == [str(victim)]
    assert re.search(expected, ds.skipped[0]["reason"]), ds.skipped[0]["reason"]
    with pytest.raises(BadSampleError, match=expected):
        SegmentationFolder(seg_root, "training", 8, on_bad_sample="error")[0]


def test_segmentation_image_modes_and_exif(tmp_path: Path) -> None:
    root = tmp_path / "seg"
    (root / "images" / "training").mkdir(parents=True)
    (root / "annotations" / "training").mkdir(parents=True)
    Image.fromarray(np.full((6, 8), 32896, np.uint16)).save(root / "images" / "training" / "a.png")
    displayed = np.zeros((10, 16, 3), np.uint8)
    displayed[:, 8:] = 255  # right half white as displayed
    _exif_jpeg(root / "images" / "training" / "b.jpg", displayed, 6)
    Image.fromarray(np.ones((6, 8), np.uint8)).save(root / "annotations" / "training" / "a.png")
    label = np.ones((10, 16), np.uint8)
    label[:, 8:] = 2
    Image.fromarray(label).save(root / "annotations" / "training" / "b.png")
    ds = SegmentationFolder(root, "training", 3, on_bad_sample="error")
    gray, _ = ds.load(0)
    assert gray.unique().tolist() == [128]
    image, mask = ds.load(1)
    assert image.shape == (3, 10, 16) and mask.shape == (10, 16)
    assert image[:, :, 9:].float().mean() > 240 and image[:, :, :7].float().mean() < 15
    assert (mask[:, 8:] == 1).all() and (mask[:, :8] == 0).all()


@pytest.mark.parametrize("fmt", ["png", "tif", "webp", "jpg"])
def test_every_exif_orientation_decodes_to_the_displayed_pixels_and_size(tmp_path: Path, fmt: str) -> None:
    """Orientations 1-8 in each container: the pixels are the displayed ones and ``full_size`` is
    their size, ``stored_size`` the file's. Pillow's TIFF reader reports a rotated image's size
    already displayed, which the decoder took for the stored one (sizes swapped for 5-8)."""
    from vtdense.data.images import decode_image

    stored = np.random.default_rng(0).integers(0, 255, (30, 50, 3), dtype=np.uint8)  # 30 high, 50 wide
    transposed = stored.transpose(1, 0, 2)
    displayed = {1: stored, 2: stored[:, ::-1], 3: stored[::-1, ::-1], 4: stored[::-1], 5: transposed,
                 6: np.rot90(stored, -1), 7: np.rot90(transposed, 2), 8: np.rot90(stored, 1)}
    for orientation, want in displayed.items():
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = tmp_path / f"o{orientation}.{fmt}"
        Image.fromarray(stored).save(path, exif=exif, **({"quality": 100} if fmt == "jpg" else {"lossless": True} if fmt == "webp" else {}))
        got = decode_image(path)
        pixels = np.asarray(got.image)
        assert pixels.shape == want.shape and got.full_size == want.shape[:2], (fmt, orientation)
        assert got.stored_size == (30, 50) and got.orientation == orientation
        if fmt != "jpg":  # lossless
            assert np.array_equal(pixels, want), (fmt, orientation)
