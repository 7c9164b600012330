"""mmseg's ``PhotoMetricDistortion`` in torch, with OpenCV's 8-bit RGB <-> HSV conversions.

The law (mmseg 0.x ``mmseg/datasets/pipelines/transforms.py``), on a uint8 image, each step with
probability 1/2 drawn by ``np.random.randint(2)`` from numpy's global generator:

1. brightness: add ``uniform(-brightness_delta, brightness_delta)`` (float32), clip to
   ``[0, 255]``, truncate to uint8;
2. ``mode = randint(2)``; when ``mode == 1`` contrast comes here: multiply by
   ``uniform(*contrast_range)``, clip, truncate;
3. saturation: to HSV, multiply S by ``uniform(*saturation_range)``, clip, truncate, back to RGB;
4. hue: to HSV, ``H = (H + randint(-hue_delta, hue_delta)) % 180`` (numpy's ``randint`` excludes
   its upper bound, so the shift lies in ``[-hue_delta, hue_delta - 1]``), back to RGB;
5. when ``mode == 0`` contrast comes last.

The draws are made in mmseg's order from ``np.random``, so from the same numpy state this module
makes the draws mmseg's transform makes (:mod:`vtdense.data.seeding` seeds numpy per sample; the
earlier vtdense steps draw from ``random``, not numpy as mmseg's pipeline does). mmseg works on BGR
images and vtdense on RGB; H, S and V do not depend on the channel order, nor do the other steps.

HSV is OpenCV's 8-bit HSV (``cv2.COLOR_RGB2HSV`` / ``COLOR_HSV2RGB``, as ``mmcv.bgr2hsv`` /
``hsv2bgr``): H in ``[0, 180)``, S and V in ``[0, 255]``. :func:`rgb_to_hsv` is OpenCV's
fixed-point algorithm (division tables with a 12-bit shift). :func:`hsv_to_rgb` follows OpenCV's
float32 path, which differs between its two code paths: the SIMD loop (whole blocks of
``4 x float lanes`` pixels of each row) computes ``1 - s*h`` with a fused multiply-add and
truncates ``255 * x`` to an integer, while the scalar loop over the rest of the row rounds it
half to even (the two differ by at most one level). ``cv_simd_block`` gives that block width (16
for SSE, 32 for AVX2, 64 for AVX-512 code); rows whose width is a multiple of it (the 512-pixel
crops of the ADE20K recipe) are all SIMD. Checked on every HSV triple against the opencv-python
wheels 4.8.0, 5.0.0 (block 32 on x86) and 4.14.0 (block 64 on an AVX-512 CPU): bit-exact; 4.5.5
(block 32) compiles its scalar loop differently and differs by one level on 172 of the
11,796,480 triples, in row tails only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["PhotoMetricParams", "PhotoMetricDistortion", "rgb_to_hsv", "hsv_to_rgb"]

_HSV_SHIFT = 12
_F32 = torch.float32
#: For each sector of the hue circle, indices into (v, v(1-s), v(1-s f), v(1-s(1-f))) of R, G, B.
_SECTOR_RGB = torch.tensor([[0, 3, 1], [2, 0, 1], [1, 0, 3], [1, 2, 0], [3, 1, 0], [0, 1, 2]])


def _div_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """OpenCV's ``sdiv_table`` / ``hdiv_table180``: ``round(255 * 4096 / i)``, ``round(180 * 4096 / (6 i))``."""
    i = torch.arange(1, 256, dtype=torch.float64, device=device)
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    sdiv = torch.cat([zero, torch.round((255 << _HSV_SHIFT) / i)]).to(torch.int32)
    hdiv = torch.cat([zero, torch.round((180 << _HSV_SHIFT) / (6.0 * i))]).to(torch.int32)
    return sdiv, hdiv


def rgb_to_hsv(image: Tensor) -> Tensor:
    """OpenCV's 8-bit ``COLOR_RGB2HSV``, bit for bit.

    Args:
        image: uint8 ``[..., 3, H, W]`` RGB.

    Returns:
        uint8 ``[..., 3, H, W]``: H in ``[0, 180)``, S and V in ``[0, 255]``.
    """
    sdiv, hdiv = _div_tables(image.device)
    r, g, b = image.to(torch.int32).unbind(-3)
    v = torch.maximum(torch.maximum(r, g), b)
    diff = v - torch.minimum(torch.minimum(r, g), b)
    half = 1 << (_HSV_SHIFT - 1)
    s = (diff * sdiv[v] + half) >> _HSV_SHIFT
    h = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * hdiv[diff] + half) >> _HSV_SHIFT  # arithmetic shift: floors negative values as OpenCV
    h = torch.where(h < 0, h + 180, h)
    return torch.stack([h, s, v], dim=-3).to(torch.uint8)


def hsv_to_rgb(hsv: Tensor, cv_simd_block: int | None = 32) -> Tensor:
    """OpenCV's 8-bit ``COLOR_HSV2RGB`` (float32 arithmetic, H in ``[0, 180)``).

    Args:
        hsv: uint8 ``[..., 3, H, W]`` (H, S, V).
        cv_simd_block: pixels per SIMD block of OpenCV's row loop; the first
            ``W // cv_simd_block * cv_simd_block`` pixels of each row take the SIMD path
            (fused multiply-add, truncation), the others the scalar path (rounding).
            ``None``: every pixel takes the SIMD path.

    Returns:
        uint8 ``[..., 3, H, W]`` RGB.
    """
    one = torch.ones((), dtype=_F32, device=hsv.device)
    inv255 = one / 255
    h, s, v = hsv.to(_F32).unbind(-3)
    s, v = s * inv255, v * inv255
    h = h * (one * 6 / 180)
    pre = torch.trunc(h)
    f = h - pre
    sector = (pre - torch.trunc(pre * (one / 6)) * 6).to(torch.long)

    def one_minus_s_times(x: Tensor) -> Tensor:  # 1 - s*x rounded once (a fused multiply-add)
        return (1.0 - s.double() * x.double()).to(_F32)

    tab = torch.stack([v, v * (one - s), v * one_minus_s_times(f), v * one_minus_s_times(one - f)])
    index = _SECTOR_RGB.to(hsv.device)[sector].movedim(-1, 0)  # [3, ..., H, W]
    rgb = torch.gather(tab, 0, index) * (one * 255)  # [3, ..., H, W]
    out = torch.trunc(rgb)
    width = hsv.shape[-1]
    start = width if cv_simd_block is None else width // cv_simd_block * cv_simd_block
    if start < width:
        out[..., start:] = torch.round(rgb[..., start:])  # round half to even, as cvRound
    return out.clamp_(0, 255).to(torch.uint8).movedim(0, -3)


def _scale_clip(x: Tensor, alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    """mmseg's ``convert``: ``uint8(clip(float32(x) * alpha + beta, 0, 255))`` (truncating)."""
    y = x.to(_F32)
    if alpha != 1.0:
        y = y * torch.tensor(alpha, dtype=_F32, device=x.device)
    if beta != 0.0:
        y = y + torch.tensor(beta, dtype=_F32, device=x.device)
    return torch.trunc(y.clamp(0, 255)).to(torch.uint8)


@dataclass(frozen=True)
class PhotoMetricParams:
    """One draw of :class:`PhotoMetricDistortion`; ``None`` marks a step that does not fire.

    Attributes:
        brightness: added offset.
        contrast_first: contrast before saturation (mmseg's ``mode == 1``) or last.
        contrast: contrast multiplier.
        saturation: saturation multiplier.
        hue: hue shift in OpenCV's half-degree units.
    """

    brightness: float | None
    contrast_first: bool
    contrast: float | None
    saturation: float | None
    hue: int | None


class PhotoMetricDistortion:
    """mmseg's ``PhotoMetricDistortion`` (see the module docstring for the law).

    Args:
        brightness_delta: brightness offsets are drawn from ``uniform(-delta, delta)``.
        contrast_range: (low, high) of the contrast multiplier.
        saturation_range: (low, high) of the saturation multiplier.
        hue_delta: hue shifts are drawn from ``randint(-hue_delta, hue_delta)`` (high excluded).
        cv_simd_block: see :func:`hsv_to_rgb` and the module docstring.

    Call on a uint8 ``[3, H, W]`` (or ``[..., 3, H, W]``, one draw for all) RGB tensor; returns uint8
    of the same shape. Draws from ``np.random``.
    """

    def __init__(
        self,
        brightness_delta: int = 32,
        contrast_range: Sequence[float] = (0.5, 1.5),
        saturation_range: Sequence[float] = (0.5, 1.5),
        hue_delta: int = 18,
        cv_simd_block: int | None = 32,
    ) -> None:
        self.brightness_delta = brightness_delta
        self.contrast_lower, self.contrast_upper = contrast_range
        self.saturation_lower, self.saturation_upper = saturation_range
        self.hue_delta = hue_delta
        self.cv_simd_block = cv_simd_block

    def sample(self) -> PhotoMetricParams:
        """Draw the parameters from ``np.random`` in mmseg's order (draws do not depend on the image)."""
        rnd = np.random
        brightness = rnd.uniform(-self.brightness_delta, self.brightness_delta) if rnd.randint(2) else None
        contrast_first = bool(rnd.randint(2) == 1)
        contrast = None
        if contrast_first and rnd.randint(2):
            contrast = rnd.uniform(self.contrast_lower, self.contrast_upper)
        saturation = rnd.uniform(self.saturation_lower, self.saturation_upper) if rnd.randint(2) else None
        hue = int(rnd.randint(-self.hue_delta, self.hue_delta)) if rnd.randint(2) else None
        if not contrast_first and rnd.randint(2):
            contrast = rnd.uniform(self.contrast_lower, self.contrast_upper)
        return PhotoMetricParams(brightness, contrast_first, contrast, saturation, hue)

    def apply(self, image: Tensor, params: PhotoMetricParams) -> Tensor:
        """Distort uint8 ``[..., 3, H, W]`` RGB ``image`` with given ``params``; returns uint8 ``[..., 3, H, W]``."""
        if image.dtype != torch.uint8 or image.dim() < 3 or image.shape[-3] != 3:
            raise ValueError(
                f"PhotoMetricDistortion expects a uint8 [..., 3, H, W] image, got {image.dtype} {list(image.shape)}"
            )
        if params.brightness is not None:
            image = _scale_clip(image, beta=params.brightness)
        if params.contrast_first and params.contrast is not None:
            image = _scale_clip(image, alpha=params.contrast)
        if params.saturation is not None:
            h, s, v = rgb_to_hsv(image).unbind(-3)
            hsv = torch.stack([h, _scale_clip(s, alpha=params.saturation), v], dim=-3)
            image = hsv_to_rgb(hsv, self.cv_simd_block)
        if params.hue is not None:
            h, s, v = rgb_to_hsv(image).unbind(-3)
            h = torch.remainder(h.to(torch.int32) + params.hue, 180).to(torch.uint8)
            image = hsv_to_rgb(torch.stack([h, s, v], dim=-3), self.cv_simd_block)
        if not params.contrast_first and params.contrast is not None:
            image = _scale_clip(image, alpha=params.contrast)
        return image

    def __call__(self, image: Tensor) -> Tensor:
        """Draw parameters (:meth:`sample`) and apply them to uint8 ``[..., 3, H, W]`` RGB ``image``."""
        return self.apply(image, self.sample())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(brightness_delta={self.brightness_delta}, "
            f"contrast_range=({self.contrast_lower}, {self.contrast_upper}), "
            f"saturation_range=({self.saturation_lower}, {self.saturation_upper}), "
            f"hue_delta={self.hue_delta}, cv_simd_block={self.cv_simd_block})"
        )
