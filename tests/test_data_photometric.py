"""mmseg's PhotoMetricDistortion in torch against a numpy + OpenCV oracle of the law.

The oracle below is written from the law (mmseg 0.x ``PhotoMetricDistortion``, which converts with
``mmcv.bgr2hsv`` / ``hsv2bgr``, i.e. ``cv2.cvtColor``) on HWC RGB uint8 arrays; both it and the
module under test draw from ``np.random``, seeded identically.
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest
import torch

from vtdense.data import PhotoMetricDistortion
from vtdense.data.ade20k import SegTrainTransform
from vtdense.data.photometric import PhotoMetricParams, hsv_to_rgb, rgb_to_hsv
from vtdense.data.seeding import seeded_rng

cv2 = pytest.importorskip("cv2")

#: ``VTDENSE_EXHAUSTIVE_HSV=1`` compares the conversions on their whole domain (16,777,216 RGB colours,
#: 11,796,480 HSV triples; 4-15 s more on 2 cores) instead of every 11th / 7th element.
_EXHAUSTIVE = os.environ.get("VTDENSE_EXHAUSTIVE_HSV") == "1"


def _chw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1)


def _hwc(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.permute(1, 2, 0).numpy())


def _every(*sizes: int) -> np.ndarray:
    """Every uint8 triple ``(a, b, c)`` with ``a < sizes[0]``, ... as ``[prod(sizes), 3]``, last varying fastest."""
    out = np.empty((*sizes, 3), dtype=np.uint8)
    for k, n in enumerate(sizes):
        out[..., k] = np.arange(n, dtype=np.uint8).reshape([-1 if i == k else 1 for i in range(3)])
    return out.reshape(-1, 3)


@functools.cache
def _hsv_grid() -> np.ndarray:
    """Every 8-bit OpenCV HSV triple (H < 180) as ``[180 * 256 * 256, 3]`` (shared: do not modify)."""
    return _every(180, 256, 256)


@functools.cache
def _cv_simd_block() -> int:
    """The HSV->RGB SIMD block width of the installed OpenCV on this CPU (see ``hsv_to_rgb``)."""
    rng = np.random.default_rng(0)
    probe = _hsv_grid()[rng.integers(0, 180 * 256 * 256, size=127 * 800)].reshape(800, 127, 3)
    ref = cv2.cvtColor(probe, cv2.COLOR_HSV2RGB)
    for block in (4, 8, 16, 32, 64, 128):
        if np.array_equal(_hwc(hsv_to_rgb(_chw(probe), block)), ref):
            return block
    pytest.fail("no SIMD block width reproduces this OpenCV's HSV2RGB")


def _test_image(h: int, w: int, seed: int) -> np.ndarray:
    """Random HWC RGB uint8 with rows of grays, saturated colours, black and white pixels."""
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img[0] = rng.integers(0, 256, (w, 1), dtype=np.uint8)  # grays
    img[1] = 0
    img[2] = 255
    img[3, :, :] = rng.choice([0, 255], (w, 3)).astype(np.uint8)  # pure primaries / secondaries
    img[4] = rng.integers(0, 256, (w, 3), dtype=np.uint8)
    img[4, :, rng.integers(0, 3)] = 255  # one channel saturated
    img[5] = rng.integers(0, 256, (w, 3), dtype=np.uint8)
    img[5, :, rng.integers(0, 3)] = 0  # one channel at zero
    return img


class _Oracle:
    """The law on HWC RGB uint8 numpy arrays, OpenCV doing the HSV conversions; records what fired."""

    def __init__(
        self,
        brightness_delta: int = 32,
        contrast_range: tuple[float, float] = (0.5, 1.5),
        saturation_range: tuple[float, float] = (0.5, 1.5),
        hue_delta: int = 18,
    ) -> None:
        self.bd, self.cr, self.sr, self.hd = brightness_delta, contrast_range, saturation_range, hue_delta

    @staticmethod
    def _affine(x: np.ndarray, alpha: float = 1, beta: float = 0) -> np.ndarray:
        return np.clip(x.astype(np.float32) * alpha + beta, 0, 255).astype(np.uint8)

    def __call__(self, img: np.ndarray) -> tuple[np.ndarray, dict]:
        draws: dict = {}
        if np.random.randint(2):
            draws["brightness"] = np.random.uniform(-self.bd, self.bd)
            img = self._affine(img, beta=draws["brightness"])
        draws["mode"] = np.random.randint(2)

        def contrast(img: np.ndarray) -> np.ndarray:
            if np.random.randint(2):
                draws["contrast"] = np.random.uniform(*self.cr)
                img = self._affine(img, alpha=draws["contrast"])
            return img

        if draws["mode"] == 1:
            img = contrast(img)
        if np.random.randint(2):
            draws["saturation"] = np.random.uniform(*self.sr)
            hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
            hsv[..., 1] = self._affine(hsv[..., 1], alpha=draws["saturation"])
            img = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
        if np.random.randint(2):
            draws["hue"] = np.random.randint(-self.hd, self.hd)
            hsv = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
            hsv[..., 0] = (hsv[..., 0].astype(int) + draws["hue"]) % 180
            img = cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)
        if draws["mode"] == 0:
            img = contrast(img)
        return img, draws


def test_rgb_to_hsv_bit_exact() -> None:
    every = _every(256, 256, 256)[:: 1 if _EXHAUSTIVE else 11]
    rows = np.ascontiguousarray(every[: len(every) // 256 * 256].reshape(-1, 256, 3))  # OpenCV's SIMD path
    ours = _hwc(rgb_to_hsv(_chw(rows)))
    np.testing.assert_array_equal(ours, cv2.cvtColor(rows, cv2.COLOR_RGB2HSV))
    # odd widths: OpenCV's scalar tail loop; and the BGR entry point mmcv uses gives the same H, S, V
    flat = every[::7][: 5 * 13 * 2000]
    for w in (1, 5, 13):
        img = flat.reshape(-1, w, 3)
        ref = cv2.cvtColor(img, cv2.COLOR_RGB2HSV)
        np.testing.assert_array_equal(_hwc(rgb_to_hsv(_chw(img))), ref)
        np.testing.assert_array_equal(cv2.cvtColor(np.ascontiguousarray(img[..., ::-1]), cv2.COLOR_BGR2HSV), ref)
    assert int(ours[..., 0].max()) == 179


def test_hsv_to_rgb_bit_exact() -> None:
    grid = _hsv_grid()[:: 1 if _EXHAUSTIVE else 7]
    grid = np.ascontiguousarray(grid[: len(grid) // 256 * 256].reshape(-1, 256, 3))  # width: a multiple of any block
    ref = cv2.cvtColor(grid, cv2.COLOR_HSV2RGB)
    np.testing.assert_array_equal(_hwc(hsv_to_rgb(_chw(grid), None)), ref)
    np.testing.assert_array_equal(cv2.cvtColor(grid[:4096], cv2.COLOR_HSV2BGR)[..., ::-1], ref[:4096])


@pytest.mark.parametrize("width", [1, 7, 63, 65, 100, 513])
def test_hsv_to_rgb_row_tails(width: int) -> None:
    """Rows not a multiple of OpenCV's SIMD block: the tail pixels round instead of truncating."""
    block = _cv_simd_block()
    rng = np.random.default_rng(width)
    img = _hsv_grid()[rng.integers(0, 180 * 256 * 256, size=width * (30_000 // width))].reshape(-1, width, 3)
    ref = cv2.cvtColor(img, cv2.COLOR_HSV2RGB)
    np.testing.assert_array_equal(_hwc(hsv_to_rgb(_chw(img), block)), ref)
    if width % block:  # the two paths do differ, by one level at most
        all_simd = _hwc(hsv_to_rgb(_chw(img), None)).astype(int)
        assert 0 < np.abs(all_simd - ref).max() <= 1


@pytest.mark.parametrize("shape", [(12, 128), (9, 37)])
def test_round_trip_matches_opencv(shape: tuple[int, int]) -> None:
    img = _test_image(*shape, seed=3)
    ref = cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_RGB2HSV), cv2.COLOR_HSV2RGB)
    ours = hsv_to_rgb(rgb_to_hsv(_chw(img)), _cv_simd_block())
    np.testing.assert_array_equal(_hwc(ours), ref)


@pytest.mark.parametrize("shape", [(10, 64), (7, 45)])
def test_distortion_matches_oracle_in_every_branch(shape: tuple[int, int]) -> None:
    oracle, ours = _Oracle(), PhotoMetricDistortion(cv_simd_block=_cv_simd_block())
    seen = set()
    for seed in range(400):
        img = _test_image(*shape, seed=seed)
        np.random.seed(seed)
        ref, draws = oracle(img)
        after_oracle = np.random.random()
        np.random.seed(seed)
        params = ours.sample()
        out = ours.apply(_chw(img), params)
        assert np.random.random() == after_oracle  # same number of draws consumed
        assert params == PhotoMetricParams(
            draws.get("brightness"), draws["mode"] == 1, draws.get("contrast"), draws.get("saturation"), draws.get("hue")
        )
        np.testing.assert_array_equal(_hwc(out), ref, err_msg=f"seed {seed}: {params}")
        seen.add(tuple(k in draws for k in ("brightness", "contrast", "saturation", "hue")) + (draws["mode"],))
    assert seen == set(itertools.product([False, True], [False, True], [False, True], [False, True], [0, 1]))


def test_call_draws_like_sample_then_apply() -> None:
    t, img = PhotoMetricDistortion(), _chw(_test_image(8, 32, seed=0))
    np.random.seed(5)
    a = t(img)
    np.random.seed(5)
    assert torch.equal(a, t.apply(img, t.sample()))
    assert a.dtype == torch.uint8 and a.shape == img.shape


def test_draws_follow_the_law() -> None:
    t = PhotoMetricDistortion()
    n = 4000
    draws = []
    for seed in range(n):
        np.random.seed(seed)
        draws.append(t.sample())
    for name in ("brightness", "contrast", "saturation", "hue"):
        fired = sum(getattr(p, name) is not None for p in draws) / n
        assert abs(fired - 0.5) < 0.04, (name, fired)  # about 5 standard deviations
    assert abs(sum(p.contrast_first for p in draws) / n - 0.5) < 0.04
    bright = np.array([p.brightness for p in draws if p.brightness is not None])
    assert bright.min() >= -32 and bright.max() < 32 and bright.min() < -31 and bright.max() > 31
    for name, lo, hi in (("contrast", 0.5, 1.5), ("saturation", 0.5, 1.5)):
        vals = np.array([getattr(p, name) for p in draws if getattr(p, name) is not None])
        assert vals.min() >= lo and vals.max() < hi and vals.min() < lo + 0.01 and vals.max() > hi - 0.01
        assert abs(vals.mean() - (lo + hi) / 2) < 0.03
    hues = {p.hue for p in draws if p.hue is not None}
    assert hues == set(range(-18, 18))  # numpy's randint excludes the upper bound


def test_special_pixels() -> None:
    """Black stays black under brightness <= 0, contrast, saturation and hue; grays stay as they are; white saturates."""
    t = PhotoMetricDistortion()
    black = torch.zeros(3, 4, 32, dtype=torch.uint8)
    assert torch.equal(t.apply(black, PhotoMetricParams(-5.0, True, 1.4, 1.5, 17)), black)
    gray = torch.arange(0, 256, 8, dtype=torch.uint8).expand(3, 4, 32).contiguous()
    out = t.apply(gray, PhotoMetricParams(None, False, None, 1.5, -18))
    assert torch.equal(out, gray)
    white = torch.full((3, 4, 32), 255, dtype=torch.uint8)
    assert torch.equal(t.apply(white, PhotoMetricParams(20.0, False, None, None, None)), white)


def test_rejects_non_uint8() -> None:
    with pytest.raises(ValueError, match="uint8"):
        PhotoMetricDistortion().apply(torch.zeros(3, 4, 4), PhotoMetricParams(None, False, None, None, None))


def test_seg_train_transform_uses_it_deterministically() -> None:
    t = SegTrainTransform(scale=(64, 48), ratio_range=(1.0, 1.0), crop_size=(32, 32), cat_max_ratio=1.0)
    assert isinstance(t.jitter, PhotoMetricDistortion)
    image, mask = _chw(_test_image(48, 64, seed=1)), torch.zeros(48, 64, dtype=torch.long)
    outs = []
    for _ in range(2):
        with seeded_rng(123):
            outs.append(t(image, mask)["image"])
    assert torch.equal(outs[0], outs[1])
    assert SegTrainTransform(photometric=False).jitter is None
