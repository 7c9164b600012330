"""Image decoding for the datasets: file errors, EXIF orientation, pixel modes, bit depth, huge images.

:func:`decode_image` is the one place where vtdense turns an image file into 8-bit RGB pixels:

- **Orientation.** The EXIF orientation tag is applied (``PIL.ImageOps.exif_transpose``), so pixels
  come out as an image viewer shows them. COCO's ``width``/``height`` (and so its boxes) describe
  the displayed image; detectron2's ``read_image`` and OpenCV's ``imread`` apply the tag too.
- **Modes.** Grayscale, bilevel, palette (with or without transparency), RGBA/LA (alpha dropped),
  CMYK and YCbCr become RGB. 16-bit grayscale (``I;16``, ``I``) is scaled from 0..65535 to 0..255
  (PIL's own ``convert("RGB")`` clips it, which turns most 16-bit images white); 32-bit float
  (``F``) is read as 0..1 when its maximum is at most 1, else as 0..255.
- **Huge images.** An image whose long side exceeds ``max_side`` is decoded at a reduced size whose
  long side is still at least ``max_side``: JPEGs through ``draft`` (the decoder's DCT scaling by
  1/2, 1/4 or 1/8, never holding the full-size pixels), other formats by an integer box ``reduce``
  after decoding. Callers scale annotations by :attr:`DecodedImage.scale`. PIL's
  ``DecompressionBombWarning`` (more than ``Image.MAX_IMAGE_PIXELS`` pixels) is silenced, since the
  size is handled here; its ``DecompressionBombError`` (more than twice that) is reported like any
  undecodable file, naming the setting to raise for genuine images.
- **Errors.** A missing, unreadable, truncated or undecodable file raises one
  :class:`~vtdense.data.errors.BadSampleError` naming the file (and image id when given).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from vtdense.data.errors import BadSampleError

__all__ = ["EXIF_ORIENTATION", "DecodedImage", "decode_image", "to_rgb8"]

#: EXIF tag of the orientation (values 1-8; 5-8 swap width and height).
EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = frozenset({5, 6, 7, 8})


@dataclass
class DecodedImage:
    """An image as decoded by :func:`decode_image`.

    Attributes:
        image: 8-bit ``RGB`` PIL image in displayed orientation, possibly reduced (see ``scale``).
        full_size: ``(height, width)`` of the displayed image at full resolution.
        stored_size: ``(height, width)`` of the pixels as stored in the file (before EXIF orientation).
        orientation: The EXIF orientation value (1 when absent).
    """

    image: Image.Image
    full_size: tuple[int, int]
    stored_size: tuple[int, int]
    orientation: int

    @property
    def scale(self) -> tuple[float, float]:
        """``(sy, sx)``: decoded size over full size (``(1.0, 1.0)`` unless the image was reduced)."""
        return self.image.height / self.full_size[0], self.image.width / self.full_size[1]


def to_rgb8(img: Image.Image) -> Image.Image:
    """Convert a PIL image of any common mode to 8-bit RGB (see the module docstring for the rules).

    Raises:
        ValueError: For a mode PIL cannot convert to RGB.
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(img).astype(np.int64)
        a = (np.clip(a, 0, 65535) * 255 + 32767) // 65535
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        a = np.asarray(img, dtype=np.float32)
        a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
        if a.size and float(a.max()) <= 1.0:
            a = a * 255.0
        return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("P", "PA") and (mode == "PA" or "transparency" in img.info):
        img = img.convert("RGBA")
    return img.convert("RGB")


def _label(path: Path, image_id: object) -> str:
    return f"{path}" if image_id is None else f"{path} (image id {image_id})"


def decode_image(
    path: str | os.PathLike[str], *, max_side: int | None = None, image_id: object = None
) -> DecodedImage:
    """Decode an image file to 8-bit RGB in displayed orientation, reducing huge images.

    Args:
        path: The image file.
        max_side: Decode images whose long side exceeds this at a reduced size whose long side is
            at least this (``None``: always full size).
        image_id: Named in error messages when given.

    Returns:
        The decoded image with its full and stored sizes and its EXIF orientation.

    Raises:
        BadSampleError: The file is missing, unreadable, not an image, truncated, above PIL's
            decompression-bomb limit, or in a pixel mode that cannot become RGB.
    """
    path = Path(path)
    what = _label(path, image_id)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as raw:
                try:
                    orientation = int(raw.getexif().get(EXIF_ORIENTATION, 1))
                except Exception:  # a corrupt EXIF block: treat as unrotated
                    orientation = 1
                if orientation not in range(1, 9):
                    orientation = 1
                sw, sh = raw.size
                long_side = max(sw, sh)
                if max_side is not None and long_side > max_side and raw.format == "JPEG":
                    f = max_side / long_side
                    raw.draft(raw.mode, (math.ceil(sw * f), math.ceil(sh * f)))
                raw.load()
                drafted = raw.size != (sw, sh)
                img = raw
                if orientation != 1:
                    img = ImageOps.exif_transpose(img)
                # displayed (w, h): read off the transposed image where it is whole. Some plugins
                # (Pillow's TIFF) report a rotated image's size already displayed, so the stored
                # size cannot be assumed to be what raw.size says.
                if drafted:
                    full = (sw, sh) if orientation not in _SWAPS_SIDES else (sh, sw)
                else:
                    full = img.size
                img = to_rgb8(img)  # loaded pixels stay usable after the file is closed
    except FileNotFoundError:
        raise BadSampleError(f"image file not found: {what}", file=path, image_id=image_id) from None
    except Image.DecompressionBombError as e:
        raise BadSampleError(
            f"image {what} is too large to decode: {e}. If the image is genuine, raise PIL.Image.MAX_IMAGE_PIXELS",
            file=path, image_id=image_id,
        ) from None
    except MemoryError:
        raise
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, EOFError... on bad files
        kind = "not an image PIL can read" if isinstance(e, Image.UnidentifiedImageError) else "cannot be decoded"
        raise BadSampleError(
            f"image {what} {kind} (corrupt or truncated?): {type(e).__name__}: {e}", file=path, image_id=image_id
        ) from None
    if max_side is not None and max(img.size) > max_side:
        factor = max(img.size) // max_side
        if factor > 1:
            img = img.reduce(factor)
    stored = full if orientation not in _SWAPS_SIDES else (full[1], full[0])
    return DecodedImage(image=img, full_size=(full[1], full[0]), stored_size=(stored[1], stored[0]), orientation=orientation)
