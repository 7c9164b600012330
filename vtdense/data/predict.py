"""Images to predict on: list a file, a folder or a glob, decode, and preprocess like validation.

:func:`list_images` turns what a user types (``photo.jpg``, ``photos/``, ``"photos/*.jpg"``,
``"shots/**/*.png"``) into a sorted list of image files and checks it before any model runs:

- a path that does not exist, a glob that matches nothing, or a folder without images raises one
  :class:`FileNotFoundError` naming the path;
- a file that is not an image PIL can identify raises one
  :class:`~vtdense.data.errors.BadSampleError` naming the file (only the header is read);
- in a folder or a glob, files whose suffix is not an image suffix (``notes.txt``) are left out
  with one counted warning.

:class:`PredictImages` decodes each file with :func:`vtdense.data.images.decode_image` (EXIF
orientation applied, 16-bit and palette modes handled), applies the task's evaluation resize and
returns ``(image, target)`` with ``orig_size`` (the displayed full-resolution ``(H0, W0)``, the
frame predictions are reported in), ``file_name`` (unique, relative to the folder or glob root)
and ``index``. It also takes tensors. :func:`collate_predict` batches images of different sizes
as lists, the detection data contract, so the same batches feed every task's ``predict_step``.
"""

from __future__ import annotations

import glob
import logging
import numbers
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Union

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from vtdense.data.ade20k import SegEvalTransform
from vtdense.data.errors import BadSampleError
from vtdense.data.images import decode_image
from vtdense.data.transforms import DEFAULT_MAX_SIZE, DEFAULT_TEST_SCALE, DetectionEvalViews

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageFile",
    "ImageSource",
    "PredictImages",
    "check_eval_scale",
    "collate_predict",
    "detection_predict_transform",
    "first_names",
    "list_coco_images",
    "list_images",
    "segmentation_predict_transform",
]

logger = logging.getLogger(__name__)

#: File suffixes taken from a folder or a glob (case-insensitive).
IMAGE_SUFFIXES: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")
#: One image: a file path, or a ``[3, H, W]`` (or ``[H, W]``) tensor, uint8 0..255 or float 0..1.
ImageSource = Union[str, os.PathLike, Tensor]
#: Decoding reduces images whose long side exceeds this (never below the model's input size).
_DECODE_MAX_SIDE = 4096
_GLOB_CHARS = frozenset("*?[")


def first_names(names: Sequence[str], limit: int = 5) -> str:
    """``"a.jpg, b.png, ..."``: the first ``limit`` names, for a message about many files."""
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _check_header(path: Path) -> None:
    """Raise :class:`BadSampleError` naming ``path`` unless PIL identifies it as an image (header only)."""
    try:
        with Image.open(path) as img:
            img.size  # noqa: B018 - identified from the header; pixels are decoded later
    except Exception as e:
        raise BadSampleError(
            f"{path} is not an image PIL can read ({type(e).__name__}: {e})", file=path
        ) from None


class ImageFile(NamedTuple):
    """One listed image: ``path`` on disk, ``file_name`` relative to the folder or glob root
    (``a/b.jpg``), ``name`` the unique output name without suffix (``a/b``, or ``a/b_jpg`` when
    ``a/b.png`` is listed too), and ``image_id``, the id a COCO file gives it (else ``None``)."""

    path: Path
    file_name: str
    name: str
    image_id: int | None = None


def _image_files(files: Sequence[Path], base: Path | None) -> list[ImageFile]:
    rel = []
    for f in files:
        try:
            r = f.relative_to(base) if base is not None else Path(f.name)
        except ValueError:
            r = Path(f.name)
        rel.append(r)
    stems = [r.with_suffix("").as_posix() for r in rel]
    counts: dict[str, int] = {}
    for s in stems:
        counts[s.lower()] = counts.get(s.lower(), 0) + 1
    # a stem shared by several files gets its suffix: x.jpg, x.png -> x_jpg, x_png
    wanted = [s if counts[s.lower()] == 1 else f"{s}_{r.suffix.lstrip('.').lower()}" for r, s in zip(rel, stems)]
    # names still equal (a.JPG and a.jpg; b.png beside b_png.png), compared without case as some file
    # systems do: the later ones get _2, _3, ... never another file's name
    reserved = {w.lower() for w in wanted}
    taken: set[str] = set()
    names = []
    for w in wanted:
        name, k = w, 2
        while name.lower() in taken or (name != w and name.lower() in reserved):
            name, k = f"{w}_{k}", k + 1
        taken.add(name.lower())
        names.append(name)
    return [ImageFile(f, r.as_posix(), n) for f, r, n in zip(files, rel, names)]


def list_images(path: str | os.PathLike[str]) -> list[ImageFile]:
    """The image files of ``path`` (a file, a folder or a glob), sorted, with unique output names.

    A folder is listed without descending into sub-folders; a glob with ``**`` is recursive.

    Args:
        path: An image file, a folder of images, or a glob pattern.

    Returns:
        One :class:`ImageFile` per image; names are relative to the folder (or the glob's fixed
        leading folder) and output names are unique within the list.

    Raises:
        FileNotFoundError: ``path`` does not exist, the glob matches no image, or the folder holds none.
        BadSampleError: A file is not an image (PIL cannot identify its header); names the file.
    """
    text = os.fspath(path)
    p = Path(text).expanduser()
    if p.is_file():
        _check_header(p)
        return [ImageFile(p, p.name, p.stem)]
    if p.is_dir():
        candidates = sorted(f for f in p.iterdir() if f.is_file())
        base: Path | None = p
        where = f"folder {p}"
    elif any(c in text for c in _GLOB_CHARS):
        candidates = sorted(Path(f) for f in glob.glob(os.path.expanduser(text), recursive=True) if os.path.isfile(f))
        fixed = []
        for part in Path(os.path.expanduser(text)).parts:
            if any(c in part for c in _GLOB_CHARS):
                break
            fixed.append(part)
        base = Path(*fixed) if fixed else Path(".")
        where = f"glob {text!r}"
    else:
        raise FileNotFoundError(f"predict path not found: {p} (give an image, a folder of images or a glob)")
    files = [f for f in candidates if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")]
    others = [f for f in candidates if f not in set(files)]
    if not files:
        what = f" ({len(others)} other files, e.g. {others[0].name})" if others else ""
        raise FileNotFoundError(
            f"no images in {where}{what}; looked for files ending in {', '.join(IMAGE_SUFFIXES)}"
        )
    if others:
        shown = first_names([f.name for f in others], 3)
        logger.warning("%s: left out %d files that are not images by their suffix (%s)", where, len(others), shown)
    for f in files:
        _check_header(f)
    return _image_files(files, base)


# ------------------------------------------------------------------------------- transforms
def _as_image_tensor(image: Tensor) -> Tensor:
    """``[3, H, W]`` uint8 or float 0..1 from ``[3, H, W]``, ``[1, H, W]`` or ``[H, W]``."""
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"an image tensor must be [3, H, W], [1, H, W] or [H, W], got shape {tuple(image.shape)}")
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    if image.dtype != torch.uint8 and not image.is_floating_point():
        raise ValueError(f"an image tensor must be uint8 (0..255) or float (0..1), got {image.dtype}")
    return image


def detection_predict_transform(
    test_scale: int = DEFAULT_TEST_SCALE, max_size: int | None = DEFAULT_MAX_SIZE,
    scales: Sequence[int] | None = None, flip: bool = False, views_max_size: int | None = None,
) -> Callable[[Tensor], Any]:
    """The detection validation resize (short side ``test_scale``, long side at most ``max_size``),
    with the test-time views of ``scales``, ``flip`` and ``views_max_size``
    (:class:`~vtdense.data.transforms.DetectionEvalViews`).

    Returns:
        A function from a ``[3, H, W]`` uint8 (0..255) or float (0..1) tensor to the float32
        ``[3, h, w]`` model input in 0..1 (exactly :func:`detection_eval_transforms`); with several
        views, to ``(image, {"views": [{"image", "flip"}, ...]})``, whose second part
        :class:`PredictImages` puts into the target.
    """
    transform = DetectionEvalViews(int(test_scale), None if max_size is None else int(max_size), scales, flip, views_max_size)

    def apply(image: Tensor) -> Any:
        out, target = transform(tv_tensors.Image(_as_image_tensor(image)), {})
        out = TF.to_dtype(out.as_subclass(Tensor), torch.float32, scale=True)
        if "views" not in target:
            return out
        return out, {"views": [{"image": TF.to_dtype(v["image"], torch.float32, scale=True), "flip": v["flip"]}
                               for v in target["views"]]}

    longest = views_max_size if scales is not None and views_max_size is not None else max_size
    if longest is not None:
        apply.model_long_side = int(longest)  # type: ignore[attr-defined]  # read by PredictImages
    return apply


def check_eval_scale(scale: Any, option: str = "eval_scale") -> tuple[int, ...]:
    """``scale`` as a tuple of one or two positive ints (the segmentation resize, (long, short)).

    Args:
        scale: What the user gave, e.g. ``[2048, 512]`` (``[512]``: fit into 512 x 512).
        option: The option's name in the error, e.g. ``"--data.eval_scale"`` on the command line.

    Raises:
        ValueError: ``scale`` is not a list or tuple of one or two positive ints (a bare int, a
            zero or negative side, a float): one message naming ``option`` and the value.
    """
    ok = (
        isinstance(scale, Sequence)
        and not isinstance(scale, (str, bytes))
        and len(scale) in (1, 2)
        and all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s > 0 for s in scale)
    )
    if not ok:
        raise ValueError(f"{option} must be one or two positive ints (long, short), e.g. [2048, 512], got {scale!r}")
    return tuple(int(s) for s in scale)


def segmentation_predict_transform(
    scale: Sequence[int] | None = (2048, 512), ratios: Sequence[float] | None = None, flip: bool = False
) -> Callable[[Tensor], Any]:
    """The segmentation validation resize (keep-ratio fit into ``scale`` = (long, short); ``None``: none),
    with the test-time views of ``ratios`` and ``flip`` (:class:`~vtdense.data.ade20k.SegEvalTransform`).

    Returns:
        A function from a ``[3, H, W]`` uint8 (0..255) or float (0..1) tensor to the float32
        ``[3, h, w]`` model input in 0..1 (exactly :class:`~vtdense.data.ade20k.SegEvalTransform`);
        with several views, to ``(image, {"views": [{"image", "flip"}, ...]})``, whose second part
        :class:`PredictImages` puts into the target.

    Raises:
        ValueError: ``scale`` is not one or two positive ints (:func:`check_eval_scale`), or
            ``ratios`` not a list of positive numbers.
    """
    scale = None if scale is None else check_eval_scale(scale, "scale")
    transform = SegEvalTransform(scale, ratios, flip)

    def apply(image: Tensor) -> Any:
        image = _as_image_tensor(image)
        if image.is_floating_point():  # the transform divides by 255
            image = image.float() * 255
        out = transform(image, None)
        if "views" not in out:
            return out["image"].float()
        return out["image"].float(), {"views": [{"image": v["image"].float(), "flip": v["flip"]} for v in out["views"]]}

    if scale is not None:
        apply.model_long_side = transform.long_side  # type: ignore[attr-defined]  # read by PredictImages
    return apply


def list_coco_images(ann_file: str | os.PathLike[str], images_dir: str | os.PathLike[str]) -> tuple[list[ImageFile], list[dict[str, Any]]]:
    """The images a COCO JSON file lists (an image-info file such as ``image_info_test-dev2017.json``,
    or an instances file; annotations are not read), each with its COCO ``image_id``, so that
    predictions can be written as COCO results for those ids (a test-dev submission).

    Args:
        ann_file: The JSON file: ``images`` with ``id`` and ``file_name``; ``categories`` if any.
        images_dir: The folder the ``file_name`` entries are relative to.

    Returns:
        ``(images, categories)``: one :class:`ImageFile` per listed image, in the file's order, and
        the file's categories sorted by id (``[]`` when it has none).

    Raises:
        FileNotFoundError: the file or the folder does not exist, or listed images are missing
            (the first few named, with their count).
        ValueError: the file is not JSON, has no ``images`` list, an entry without an integer
            ``id`` or a ``file_name``, or an id twice; each message names the file.
        BadSampleError: a listed file is not an image (its header).
    """
    from vtdense.data.coco import load_coco_json, parse_coco_categories

    ann, folder = Path(ann_file).expanduser(), Path(images_dir).expanduser()
    data = load_coco_json(ann, lists=("images",))
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder not found: {folder} (the folder {ann.name}'s file_name entries are relative to)")
    images = data["images"]
    if not images:
        raise ValueError(f"{ann}: 'images' is empty")
    seen: dict[int, str] = {}
    for entry in images:
        ok = isinstance(entry, dict) and isinstance(entry.get("id"), int) and isinstance(entry.get("file_name"), str)
        if not ok:
            raise ValueError(f"{ann}: an entry of 'images' without an integer 'id' and a 'file_name': {str(entry)[:200]}")
        if entry["id"] in seen:
            raise ValueError(f"{ann}: duplicate image id {entry['id']} ({seen[entry['id']]} and {entry['file_name']})")
        seen[entry["id"]] = entry["file_name"]
    missing = [e["file_name"] for e in images if not (folder / e["file_name"]).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(images)} images {ann.name} lists are not in {folder}: {first_names(missing)}")
    files = [folder / e["file_name"] for e in images]
    for f in files:
        _check_header(f)
    listed = _image_files(files, folder)
    categories = parse_coco_categories(data, ann) if data.get("categories") else []
    return [f._replace(image_id=int(e["id"])) for f, e in zip(listed, images)], categories


# ---------------------------------------------------------------------------------- dataset
class PredictImages(Dataset):
    """Files (or tensors) preprocessed for prediction, original sizes and names kept.

    Args:
        sources: :class:`ImageFile` items from :func:`list_images`, plain paths, or tensors
            ``[3, H, W]`` uint8 / float 0..1, mixed freely.
        transform: The task's preprocessing, a function ``[3, H, W] -> float [3, h, w]``
            (:func:`detection_predict_transform`, :func:`segmentation_predict_transform`), or to
            ``(image, extras)``, whose ``extras`` dict is added to the target.
        max_decode_side: Files with a longer side are decoded reduced (long side still at least
            this, and at least the model input's longest side where the transform bounds it, as
            the two above do); ``orig_size`` stays the full size.

    Items are ``(image, target)``: ``image`` float32 ``[3, h, w]`` in 0..1, ``target`` a dict with
    ``orig_size`` ``(H0, W0)`` (the displayed full size), ``file_name`` (relative input name,
    ``None`` for a tensor), ``name`` (unique output name, no suffix), ``path`` (the file, ``None``
    for a tensor) and ``index`` (position in ``sources``). A file that cannot be decoded (the
    header passed :func:`list_images`, but the data is truncated or corrupt) is skipped: its item
    is ``None``, with a warning naming it, and :func:`collate_predict` leaves it out; the callers
    count and report the skipped files (:meth:`skipped`).
    """

    def __init__(
        self,
        sources: Sequence[ImageSource | ImageFile],
        transform: Callable[[Tensor], Tensor],
        max_decode_side: int = _DECODE_MAX_SIDE,
    ) -> None:
        self.items: list[tuple[Path | Tensor, str | None, str, int | None]] = []
        for i, s in enumerate(sources):
            if isinstance(s, ImageFile):
                self.items.append((s.path, s.file_name, s.name, s.image_id))
            elif isinstance(s, Tensor):
                self.items.append((_as_image_tensor(s), None, f"image_{i:05d}", None))
            else:
                self.items.append((Path(s), Path(s).name, Path(s).stem, None))
        self.transform = transform
        # never decode below the model's input: its resize would then upsample a reduced decode
        self.max_decode_side = max(int(max_decode_side), int(getattr(transform, "model_long_side", 0)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        src, file_name, name, image_id = self.items[index]
        if isinstance(src, Tensor):
            pixels, orig = src, (int(src.shape[-2]), int(src.shape[-1]))
            path = None
        else:
            try:
                decoded = decode_image(src, max_side=self.max_decode_side)
            except BadSampleError as e:
                logger.warning("skipped image %d (%s): %s", index, file_name, e)
                return None  # type: ignore[return-value]
            pixels, orig, path = TF.pil_to_tensor(decoded.image), decoded.full_size, str(src)
        image = self.transform(pixels)
        extra: dict[str, Any] = {}
        if isinstance(image, tuple):  # the model input and what else the task reads (test-time views)
            image, extra = image
        target = {"orig_size": orig, "file_name": file_name, "name": name, "path": path, "index": index} | extra
        if image_id is not None:
            target["image_id"] = image_id
        return image, target

    def skipped(self, done: Sequence[int]) -> list[str]:
        """Input names (``file_name``, or the output name of a tensor) of the items whose index is
        not in ``done``: the files skipped as undecodable when ``done`` holds every predicted index."""
        have = set(int(i) for i in done)
        return [file_name or name for i, (_, file_name, name, _) in enumerate(self.items) if i not in have]


def collate_predict(batch: Sequence[tuple[Tensor, dict[str, Any]] | None]) -> tuple[list[Tensor], list[dict[str, Any]]]:
    """``(images, targets)`` as lists: images of different sizes are not stacked; skipped items
    (``None``, see :class:`PredictImages`) are left out, so a batch may be empty."""
    kept = [b for b in batch if b is not None]
    return [b[0] for b in kept], [b[1] for b in kept]
