"""Mask R-CNN's mask branch padded to a bounded set of RoI batch sizes (vtdense.models.mask_rois)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_models_detection import tiny_detector, toy_batch
from vtdense.models.mask_rois import MaskRoIPadding, pad_mask_rois


def _mask_head_rows(model: torch.nn.Module) -> list[int]:
    """Records the batch size of every mask head call (after the padding pre-hook)."""
    rows: list[int] = []
    model.roi_heads.mask_head.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]), prepend=False)
    return rows


def _pair(multiple: int = 8) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same tiny Mask R-CNN twice: unpadded, and padded on the CPU too."""
    torch.manual_seed(0)
    plain = tiny_detector("mask_rcnn", mask_rois_multiple=None)
    padded = copy.deepcopy(plain)
    pad_mask_rois(padded.roi_heads, multiple, cuda_only=False)
    return plain, padded


def test_published_detector_pads_on_cuda_only() -> None:
    model = tiny_detector("mask_rcnn")
    padding = model.roi_heads.mask_roi_padding
    assert isinstance(padding, MaskRoIPadding) and padding.multiple == 32 and padding.cuda_only
    rows = _mask_head_rows(model)
    pooled: list[int] = []
    model.roi_heads.mask_roi_pool.register_forward_hook(lambda m, a, out: pooled.append(out.shape[0]))
    images, targets = toy_batch(with_masks=True)
    model.train()
    model(images, targets)
    assert rows and rows == pooled, "CPU tensors must not be padded (no cuDNN plan to save there)"
    assert not hasattr(tiny_detector("mask_rcnn", mask_rois_multiple=None).roi_heads, "mask_roi_padding")
    assert not hasattr(tiny_detector("faster_rcnn").roi_heads, "mask_roi_padding")


@pytest.mark.parametrize("value", [0, -8, 2.5, True, "32"])
def test_bad_multiple_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"mask_rois_multiple must be a positive int or null \(option 'mask_rois_multiple'\)"):
        tiny_detector("mask_rcnn", mask_rois_multiple=value)
    with pytest.raises(ValueError, match="mask_rois_multiple"):
        MaskRoIPadding(value)  # type: ignore[arg-type]


def test_training_loss_and_gradients_equal_unpadded() -> None:
    plain, padded = _pair()
    rows = _mask_head_rows(padded)
    images, targets = toy_batch(with_masks=True)
    results = []
    for model in (plain, padded):
        model.train()
        torch.manual_seed(1)  # the same RPN / RoI sampling draws
        losses = model(images, targets)
        sum(losses.values()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((losses, grads))
    (l0, g0), (l1, g1) = results
    assert rows and all(r % 8 == 0 for r in rows)
    assert l0.keys() == l1.keys()
    for k in l0:
        torch.testing.assert_close(l1[k], l0[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert g0.keys() == g1.keys()
    for n in g0:  # the weight gradients sum over more rows (zeros): only the summation order differs
        scale = float(g0[n].abs().max())
        assert float((g1[n] - g0[n]).abs().max()) <= 1e-5 * scale, n
    assert plain.roi_heads.mask_head[0][0].weight.grad.abs().sum() > 0  # the mask branch did train


def test_inference_masks_equal_unpadded() -> None:
    plain, padded = _pair()
    rows = _mask_head_rows(padded)
    images, _ = toy_batch(with_masks=True)
    for model in (plain, padded):  # every image keeps 37 detections of the untrained model: 74 RoIs
        model.roi_heads.score_thresh, model.roi_heads.detections_per_img = 0.0, 37
    with torch.no_grad():
        out0 = plain.eval()(images)
        out1 = padded.eval()(images)
    count = sum(len(o["boxes"]) for o in out0)
    assert count == 74, count
    assert rows == [80]
    for a, b in zip(out0, out1):
        assert a["masks"].shape == b["masks"].shape
        torch.testing.assert_close(b["masks"], a["masks"], rtol=0, atol=1e-6)
        torch.testing.assert_close(b["boxes"], a["boxes"])


def test_shapes_are_bounded_and_empty_batches_pass() -> None:
    padding = MaskRoIPadding(32, cuda_only=False)
    head = torch.nn.Identity()
    seen = set()
    for rows in range(0, 257):
        x = torch.randn(rows, 2, 3, 3)
        out = padding.pad(head, (x,))
        y = x if out is None else out[0]
        seen.add(y.shape[0])
        assert torch.equal(y[:rows], x) and not y[rows:].any()
        cut = padding.cut(head, (y,), y * 2)
        assert torch.equal(y * 2 if cut is None else cut, x * 2)
    assert seen == {0, 32, 64, 96, 128, 160, 192, 224, 256}


def test_threads_keep_their_own_counts_and_models_copy() -> None:
    """nn.DataParallel runs one replica per GPU in its own thread, all with these hooks."""
    import pickle
    import threading

    padding = MaskRoIPadding(8, cuda_only=False)
    head = torch.nn.Identity()
    first, second = torch.randn(3, 2), torch.randn(13, 2)
    barrier = threading.Barrier(2)
    results: dict[int, torch.Tensor] = {}

    def run(x: torch.Tensor) -> None:
        y = padding.pad(head, (x,))[0]
        barrier.wait()  # both threads have padded before either cuts
        results[x.shape[0]] = padding.cut(head, (y,), y)

    threads = [threading.Thread(target=run, args=(x,)) for x in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(results[3], first) and torch.equal(results[13], second)
    copied = copy.deepcopy(tiny_detector("mask_rcnn"))
    assert isinstance(pickle.loads(pickle.dumps(copied.roi_heads.mask_roi_padding)), MaskRoIPadding)
