"""torchvision's R-CNN heads with fewer host waits: the same results from the same random draws.

On a GPU the host must stop and wait for the device whenever it needs a value the device computes:
an output whose size depends on the data (``torch.where(mask)``, ``nonzero``, indexing or assigning
through a boolean mask), ``.item()`` / ``.tolist()``, and NMS, which finishes on the host. Each wait
drains the device's queue, so the host's work after it no longer overlaps the kernels before it.
torchvision's Mask R-CNN waits 49 times in a training step at batch 2 (``benchmarks/host_syncs.py``
counts them; the H200 profile saw 51 ``cudaStreamSynchronize`` per step), and the step is bound by
the host.

This module replaces the methods and helpers that wait without need. Every replacement computes
what torchvision's computes, from the same random draws, so losses, gradients and detections are
unchanged (the tests compare them with torchvision's on the same model):

* :class:`WaitFreeMatcher`: the matcher's labels are written with ``masked_fill`` and its
  low-quality matches with ``torch.where``, where torchvision assigns through boolean masks and finds
  the best pairs with ``torch.where(matrix == best)``: no wait (three per image before, two in the RoI
  heads' matcher).
* :class:`CountingSampler`: the positive/negative sampler reads all images' counts in one transfer and
  finds the candidates with ``nonzero_static`` of that size; the ``randperm`` draws are torchvision's,
  in the same order. One wait per call instead of two per image; the counts it returns also let the
  RPN loss and the RoI subsampling find their indices without a wait.
* :class:`LowWaitRPN`: labels written with ``masked_fill`` (two waits per image before), the sampled
  indices from the counts (two waits), and the proposals filtered for all images at once: clipping,
  the size and score tests as one mask, compacted with one read of the counts, where torchvision
  waits twice per image (NMS still waits once per image).
* :class:`LowWaitRoIHeads`: labels written with ``masked_fill`` (two waits per image), the sampled
  indices from the counts (one wait per image), the positives of the box loss and of the mask branch
  from the counts too (one wait, and one per image), and in prediction the detections' score and size
  tests read for all images at once (two waits per image before; NMS still waits once per image).
* :class:`~vtdense.models.roi_pool.LevelSortedRoIAlign` for the box and mask RoI pooling: one wait per
  call instead of one per pyramid level.
* :class:`CachedWeightsBoxCoder`: the box coder's weights made a tensor once per device, where
  torchvision copies them to the device in every ``encode`` (a blocking copy: a wait), and the RPN's
  per-level NMS offsets computed on the device (torchvision copies a ``1`` to it per image).

Together: 9 waits in the step that ``benchmarks/host_syncs.py`` counts, where torchvision's heads
wait 49 times (two of the rest are torchvision's check for degenerate target boxes, two NMS); the
count sees data-dependent ops and host reads, not blocking host-to-device copies, of which four per
step are gone too (the box coder's two, the NMS offsets' two).

The intended differences, each set by :func:`~vtdense.models.detection.build_detector` as mmdet and
detectron2 have it and left at torchvision's on heads it did not build: the box regression losses of
the RPN and the RoI box head are smooth L1 with the head's ``box_loss_beta`` (0, L1; torchvision fixes
1/9), and the mask loss's targets are aligned and binary (``aligned_mask_targets``,
``binary_mask_targets``; :mod:`vtdense.models.mask_targets`).

While a graph is built (``torch.compile``, ``torch.export``, ONNX, TorchScript) every method runs
torchvision's own code, except that the losses keep ``box_loss_beta`` (so compiled and eager
training agree). :func:`reduce_host_waits` installs these on a torchvision R-CNN in place;
:func:`restore_torchvision_heads` puts torchvision's classes back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler, BoxCoder, Matcher, encode_boxes
from torchvision.models.detection.retinanet import RetinaNetClassificationHead, RetinaNetRegressionHead
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops import boxes as box_ops

from vtdense.layers.tracing import fresh_tables, tracing
from vtdense.models.mask_targets import mask_loss
from vtdense.models.nms import batched_nms
from vtdense.models.retinanet_waits import LowWaitClassificationHead, LowWaitRegressionHead
from vtdense.models.roi_pool import LevelSortedRoIAlign

__all__ = [
    "CachedWeightsBoxCoder",
    "CountingSampler",
    "LowWaitRPN",
    "LowWaitRoIHeads",
    "TORCHVISION_BOX_LOSS_BETA",
    "WaitFreeMatcher",
    "box_loss_beta",
    "box_regression_loss",
    "reduce_host_waits",
    "restore_torchvision_heads",
]


class WaitFreeMatcher(Matcher):
    """torchvision's :class:`~torchvision.models.detection._utils.Matcher` (same thresholds and
    labels) without a host wait. ``(M gt, N predictions)`` quality matrix -> ``(N,)`` int64 matches:
    a gt index, ``BELOW_LOW_THRESHOLD`` (-1) or ``BETWEEN_THRESHOLDS`` (-2).

    With low-quality matches allowed, each gt's best predictions (ties included) become matches
    whatever their quality, as torchvision and detectron2 match. :attr:`min_low_quality` set (a
    number) matches as mmdet's ``MaxIoUAssigner`` with ``match_low_quality=True``, ``min_pos_iou``
    and ``gt_max_assign_all=True``: only gts whose best quality is at least that number get their
    best predictions, and a prediction that is the best of several such gts goes to the last of
    them in gt order (mmdet walks the gts in order), not to the gt it overlaps most.
    """

    #: mmdet's ``min_pos_iou`` for low-quality matches; ``None``: torchvision's rule (no minimum).
    min_low_quality: float | None = None

    def __call__(self, match_quality_matrix: Tensor) -> Tensor:
        mmdet = self.min_low_quality is not None
        if (tracing() and not mmdet) or match_quality_matrix.numel() == 0:  # torchvision's errors for empty input
            return super().__call__(match_quality_matrix)
        matched_vals, matches = match_quality_matrix.max(dim=0)
        all_matches = matches.clone() if self.allow_low_quality_matches else None
        below = matched_vals < self.low_threshold
        between = (matched_vals >= self.low_threshold) & (matched_vals < self.high_threshold)
        matches.masked_fill_(below, self.BELOW_LOW_THRESHOLD)
        matches.masked_fill_(between, self.BETWEEN_THRESHOLDS)
        if all_matches is not None:
            best = match_quality_matrix.max(dim=1).values
            is_best = match_quality_matrix == best[:, None]  # (M, N): prediction n is among gt m's best
            if mmdet:
                is_best &= (best >= self.min_low_quality)[:, None]
                # the last gt in order of which the prediction is a best; -1 where it is none's
                gt = torch.arange(1, is_best.shape[0] + 1, dtype=torch.int32, device=is_best.device)
                last = (is_best * gt[:, None]).amax(dim=0) - 1
                matches = torch.where(last >= 0, last, matches)
            else:
                matches = torch.where(is_best.any(dim=0), all_matches, matches)
        return matches


class CountingSampler(BalancedPositiveNegativeSampler):
    """torchvision's balanced positive/negative sampler (same sizes, same ``randperm`` draws in the
    same order) with one host wait per call; :meth:`sample` also returns the counts it drew."""

    def sample(self, matched_idxs: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[int], list[int]]:
        """``matched_idxs``: one ``(N_i,)`` tensor per image (-1 ignored, 0 negative, > 0 positive).

        Returns:
            ``(pos_masks, neg_masks, num_pos, num_neg)``: per image, ``(N_i,)`` uint8 masks of the
            sampled positives and negatives, and how many of each were sampled.
        """
        if not matched_idxs:
            return [], [], [], []
        positive = [m >= 1 for m in matched_idxs]
        negative = [m == 0 for m in matched_idxs]
        counts = torch.stack([mask.sum() for pair in zip(positive, negative) for mask in pair]).tolist()
        pos_masks, neg_masks, num_pos, num_neg = [], [], [], []
        for i, m in enumerate(matched_idxs):
            n_positive, n_negative = counts[2 * i], counts[2 * i + 1]
            pos_idx = torch.nonzero_static(positive[i], size=n_positive)[:, 0]
            neg_idx = torch.nonzero_static(negative[i], size=n_negative)[:, 0]
            n_pos = min(n_positive, int(self.batch_size_per_image * self.positive_fraction))
            n_neg = min(n_negative, self.batch_size_per_image - n_pos)
            perm1 = torch.randperm(n_positive, device=m.device)[:n_pos]
            perm2 = torch.randperm(n_negative, device=m.device)[:n_neg]
            pos_mask = torch.zeros_like(m, dtype=torch.uint8)
            neg_mask = torch.zeros_like(m, dtype=torch.uint8)
            pos_mask.index_fill_(0, pos_idx[perm1], 1)  # not `[idx] = 1`: that copies the 1 to the device
            neg_mask.index_fill_(0, neg_idx[perm2], 1)
            pos_masks.append(pos_mask)
            neg_masks.append(neg_mask)
            num_pos.append(n_pos)
            num_neg.append(n_neg)
        return pos_masks, neg_masks, num_pos, num_neg

    def __call__(self, matched_idxs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        if tracing():
            return super().__call__(matched_idxs)
        pos_masks, neg_masks, _, _ = self.sample(matched_idxs)
        return pos_masks, neg_masks


class CachedWeightsBoxCoder(BoxCoder):
    """torchvision's :class:`~torchvision.models.detection._utils.BoxCoder` that keeps its four
    weights as a tensor per dtype and device: torchvision makes that tensor from the Python tuple in
    every ``encode``, a blocking host-to-device copy (the host waits for the device) on a GPU, once in
    the RPN and once in the RoI heads per training step. ``(N, 4)`` gt boxes and proposals ->
    ``(N, 4)`` regression targets, the same values."""

    def encode_single(self, reference_boxes: Tensor, proposals: Tensor) -> Tensor:
        device, dtype = reference_boxes.device, reference_boxes.dtype
        if fresh_tables(device):
            return super().encode_single(reference_boxes, proposals)
        return encode_boxes(reference_boxes, proposals, device_constant(self, "weights", dtype, device))

    def decode_single(self, rel_codes: Tensor, boxes: Tensor) -> Tensor:
        """``(N, 4 * K)`` deltas and ``(N, 4)`` reference boxes -> ``(N, 4 * K)`` boxes: torchvision's
        arithmetic, op for op, with the half-size factor a Python number where torchvision copies a
        ``0.5`` to the device (a blocking copy) in every call."""
        boxes = boxes.to(rel_codes.dtype)
        wx, wy, ww, wh = self.weights
        width, height = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        centre_x = (boxes[:, 0] + 0.5 * width)[:, None]
        centre_y = (boxes[:, 1] + 0.5 * height)[:, None]
        new_x = rel_codes[:, 0::4] / wx * width[:, None] + centre_x
        new_y = rel_codes[:, 1::4] / wy * height[:, None] + centre_y
        half_w = 0.5 * (torch.exp(torch.clamp(rel_codes[:, 2::4] / ww, max=self.bbox_xform_clip)) * width[:, None])
        half_h = 0.5 * (torch.exp(torch.clamp(rel_codes[:, 3::4] / wh, max=self.bbox_xform_clip)) * height[:, None])
        return torch.stack((new_x - half_w, new_y - half_h, new_x + half_w, new_y + half_h), dim=2).flatten(1)


def device_constant(owner: Any, name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``owner.<name>`` (a sequence of Python numbers) as a 1-D tensor of ``dtype`` on ``device``,
    made once and kept on ``owner`` (per values, dtype, device and inference mode, so that numbers
    assigned later are followed): making it in every call is a blocking host-to-device copy on a
    GPU. Not for use while :func:`fresh_tables` holds."""
    values = tuple(getattr(owner, name))
    cache = owner.__dict__.setdefault("_device_constants", {})
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    hit = cache.get(key)
    if hit is None or hit[0] != values:
        hit = cache[key] = (values, torch.as_tensor(values, dtype=dtype, device=device))
    return hit[1]


#: torchvision's smooth L1 beta for the RPN and RoI box losses; vtdense's detectors use 0 (L1), as
#: mmdet (``L1Loss``) and detectron2 (``smooth_l1_beta=0``) do. A head without a ``box_loss_beta``
#: attribute uses torchvision's.
TORCHVISION_BOX_LOSS_BETA: float = 1 / 9


def box_loss_beta(head: object) -> float:
    """The smooth L1 beta of ``head``'s box regression loss (0: L1); torchvision's when unset."""
    return float(getattr(head, "box_loss_beta", TORCHVISION_BOX_LOSS_BETA))


def box_regression_loss(deltas: Tensor, targets: Tensor, beta: float) -> Tensor:
    """Summed smooth L1 of ``deltas - targets`` with ``beta`` (``beta == 0``: summed L1)."""
    if beta == 0:
        return torch.nn.functional.l1_loss(deltas, targets, reduction="sum")
    return torch.nn.functional.smooth_l1_loss(deltas, targets, beta=beta, reduction="sum")


def _fastrcnn_loss(class_logits: Tensor, box_regression: Tensor, labels: list[Tensor], regression_targets: list[Tensor],
                   num_positive: int | None, beta: float = TORCHVISION_BOX_LOSS_BETA) -> tuple[Tensor, Tensor]:
    """torchvision's Fast R-CNN losses (cross-entropy over the sampled RoIs; smooth L1 with ``beta``,
    of the positives' deltas for their class, over the number of sampled RoIs). The positives are
    found from their count, known on the host (``num_positive``), instead of a ``torch.where``; with
    ``None`` (while a graph is built) by ``torch.where``, as torchvision."""
    labels_all = torch.cat(labels)
    targets_all = torch.cat(regression_targets)
    classification = torch.nn.functional.cross_entropy(class_logits, labels_all)
    pos = torch.where(labels_all > 0)[0] if num_positive is None else _nonzero(labels_all > 0, num_positive)
    deltas = box_regression.reshape(class_logits.shape[0], box_regression.shape[-1] // 4, 4)
    box_loss = box_regression_loss(deltas[pos, labels_all[pos]], targets_all[pos], beta)
    return classification, box_loss / labels_all.numel()


def _nonzero(mask: Tensor, count: int) -> Tensor:
    """``torch.where(mask)[0]`` for a 1-D mask with ``count`` non-zeros known on the host."""
    return torch.nonzero_static(mask, size=count)[:, 0]


def _label_targets(labels: Tensor, matched_idxs: Tensor, matcher: Matcher) -> Tensor:
    """Background (below the low threshold) to 0, between the thresholds to -1, in place."""
    labels.masked_fill_(matched_idxs == matcher.BELOW_LOW_THRESHOLD, 0)
    return labels.masked_fill_(matched_idxs == matcher.BETWEEN_THRESHOLDS, -1)


def _counting(sampler: object) -> bool:
    return isinstance(sampler, CountingSampler) and not tracing()


class LowWaitRPN(RegionProposalNetwork):
    """torchvision's :class:`~torchvision.models.detection.rpn.RegionProposalNetwork` (same
    arguments, submodules and state-dict keys) with fewer host waits: see the module docstring."""

    def assign_targets_to_anchors(self, anchors: list[Tensor], targets: list[dict[str, Tensor]]) -> tuple[list[Tensor], list[Tensor]]:
        if tracing():
            return super().assign_targets_to_anchors(anchors, targets)
        labels, matched_gt_boxes = [], []
        for anchors_per_image, targets_per_image in zip(anchors, targets):
            gt_boxes = targets_per_image["boxes"]
            if gt_boxes.numel() == 0:  # a background image
                matched_gt_boxes.append(torch.zeros(anchors_per_image.shape, dtype=torch.float32, device=anchors_per_image.device))
                labels.append(torch.zeros((anchors_per_image.shape[0],), dtype=torch.float32, device=anchors_per_image.device))
                continue
            matched_idxs = self.proposal_matcher(self.box_similarity(gt_boxes, anchors_per_image))
            matched_gt_boxes.append(gt_boxes[matched_idxs.clamp(min=0)])
            labels.append(_label_targets((matched_idxs >= 0).to(torch.float32), matched_idxs, self.proposal_matcher))
        return labels, matched_gt_boxes

    def compute_loss(self, objectness: Tensor, pred_bbox_deltas: Tensor, labels: list[Tensor],
                     regression_targets: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Objectness cross-entropy over the sampled anchors and the positives' box loss (smooth L1
        with :attr:`box_loss_beta`, 0: L1) over their number, as torchvision's (which fixes beta at
        1/9). While a graph is built the sampled anchors are found as torchvision finds them."""
        beta = box_loss_beta(self)
        counting = _counting(self.fg_bg_sampler)
        if not counting and beta == TORCHVISION_BOX_LOSS_BETA:
            return super().compute_loss(objectness, pred_bbox_deltas, labels, regression_targets)
        if counting:
            pos_masks, neg_masks, num_pos, num_neg = self.fg_bg_sampler.sample(labels)
            pos_inds = _nonzero(torch.cat(pos_masks), sum(num_pos))
            neg_inds = _nonzero(torch.cat(neg_masks), sum(num_neg))
        else:
            pos_masks, neg_masks = self.fg_bg_sampler(labels)
            pos_inds = torch.where(torch.cat(pos_masks))[0]
            neg_inds = torch.where(torch.cat(neg_masks))[0]
        sampled = torch.cat([pos_inds, neg_inds])
        labels_all = torch.cat(labels)
        targets_all = torch.cat(regression_targets)
        box_loss = box_regression_loss(pred_bbox_deltas[pos_inds], targets_all[pos_inds], beta) / sampled.numel()
        objectness_loss = torch.nn.functional.binary_cross_entropy_with_logits(objectness.flatten()[sampled], labels_all[sampled])
        return objectness_loss, box_loss

    def filter_proposals(self, proposals: Tensor, objectness: Tensor, image_shapes: list[tuple[int, int]],
                         num_anchors_per_level: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        """``proposals (B, A, 4)``, ``objectness (B*A, 1)`` -> per image up to ``post_nms_top_n``
        boxes ``(K_i, 4)`` and their probabilities ``(K_i,)``, as torchvision's."""
        if tracing():
            return super().filter_proposals(proposals, objectness, image_shapes, num_anchors_per_level)
        num_images = proposals.shape[0]
        objectness = objectness.detach().reshape(num_images, -1)
        top_n_idx = self._get_top_n_idx(objectness, num_anchors_per_level)
        scores = objectness.gather(1, top_n_idx).sigmoid()
        boxes = proposals.gather(1, top_n_idx.unsqueeze(-1).expand(-1, -1, 4))
        taken = [min(self.pre_nms_top_n(), n) for n in num_anchors_per_level]  # what _get_top_n_idx took per level
        levels = torch.cat([torch.full((k,), i, dtype=torch.int64, device=boxes.device) for i, k in enumerate(taken)])
        for i, (height, width) in enumerate(image_shapes):  # as box_ops.clip_boxes_to_image
            boxes[i, :, 0::2].clamp_(min=0, max=width)
            boxes[i, :, 1::2].clamp_(min=0, max=height)
        widths, heights = boxes[..., 2] - boxes[..., 0], boxes[..., 3] - boxes[..., 1]
        keep = (widths >= self.min_size) & (heights >= self.min_size) & (scores >= self.score_thresh)
        # The kept boxes of each image first, in their order: then one read of the counts.
        order = torch.argsort(keep.logical_not().to(torch.uint8), dim=1, stable=True)
        counts = keep.sum(dim=1).tolist()
        final_boxes, final_scores = [], []
        for i, count in enumerate(counts):
            idx = order[i, :count]
            b, s, lvl = boxes[i, idx], scores[i, idx], levels[idx]
            kept = batched_nms(b, s, lvl, self.nms_thresh, len(taken))[: self.post_nms_top_n()]
            final_boxes.append(b[kept])
            final_scores.append(s[kept])
        return final_boxes, final_scores


class LowWaitRoIHeads(RoIHeads):
    """torchvision's :class:`~torchvision.models.detection.roi_heads.RoIHeads` (same arguments,
    submodules and state-dict keys) with fewer host waits in training and prediction: see the module
    docstring. Its mask loss takes the targets of :attr:`aligned_mask_targets` and
    :attr:`binary_mask_targets` (:func:`~vtdense.models.mask_targets.mask_loss`)."""

    #: Mask targets cropped by RoIAlign with ``aligned=True`` / thresholded at 0.5, as mmdet and
    #: detectron2. Class defaults ``False``: torchvision's targets for heads given this class in place
    #: of torchvision's; ``build_detector`` sets both (its ``roi_aligned``, ``binary_mask_targets``).
    aligned_mask_targets: bool = False
    binary_mask_targets: bool = False

    def assign_targets_to_proposals(self, proposals: list[Tensor], gt_boxes: list[Tensor],
                                    gt_labels: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        if tracing():
            return super().assign_targets_to_proposals(proposals, gt_boxes, gt_labels)
        matched, labels = [], []
        for props, boxes, classes in zip(proposals, gt_boxes, gt_labels):
            if boxes.numel() == 0:  # a background image
                matched.append(torch.zeros((props.shape[0],), dtype=torch.int64, device=props.device))
                labels.append(torch.zeros((props.shape[0],), dtype=torch.int64, device=props.device))
                continue
            matched_idxs = self.proposal_matcher(box_ops.box_iou(boxes, props))
            clamped = matched_idxs.clamp(min=0)
            matched.append(clamped)
            labels.append(_label_targets(classes[clamped].to(torch.int64), matched_idxs, self.proposal_matcher))
        return matched, labels

    def postprocess_detections(self, class_logits: Tensor, box_regression: Tensor, proposals: list[Tensor],
                               image_shapes: list[tuple[int, int]]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """``(R, classes)`` logits and ``(R, 4 * classes)`` deltas of every image's proposals -> per
        image up to ``detections_per_img`` boxes ``(D_i, 4)``, scores ``(D_i,)`` and labels ``(D_i,)``,
        as torchvision's, with one read of every image's candidate count where torchvision waits
        twice per image (NMS still waits once per image)."""
        if tracing():
            return super().postprocess_detections(class_logits, box_regression, proposals, image_shapes)
        num_classes = class_logits.shape[-1]
        counts = [p.shape[0] for p in proposals]
        all_boxes = self.box_coder.decode(box_regression, proposals).split(counts, 0)
        all_scores = torch.nn.functional.softmax(class_logits, -1).split(counts, 0)
        labels_row = torch.arange(num_classes, device=class_logits.device)
        candidates = []
        for boxes, scores, shape in zip(all_boxes, all_scores, image_shapes):
            boxes = box_ops.clip_boxes_to_image(boxes, shape)[:, 1:].reshape(-1, 4)  # class 0 is the background
            scores = scores[:, 1:].reshape(-1)
            labels = labels_row[1:].expand(scores.shape[0] // (num_classes - 1), -1).reshape(-1)
            widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
            keep = (scores > self.score_thresh) & (widths >= 1e-2) & (heights >= 1e-2)
            candidates.append((boxes, scores, labels, keep))
        kept_counts = torch.stack([c[3].sum() for c in candidates]).tolist() if candidates else []
        out_boxes, out_scores, out_labels = [], [], []
        for (boxes, scores, labels, keep), n in zip(candidates, kept_counts):
            idx = _nonzero(keep, n)
            boxes, scores, labels = boxes[idx], scores[idx], labels[idx]
            kept = batched_nms(boxes, scores, labels, self.nms_thresh, num_classes)[: self.detections_per_img]
            out_boxes.append(boxes[kept])
            out_scores.append(scores[kept])
            out_labels.append(labels[kept])
        return out_boxes, out_scores, out_labels

    def subsample(self, labels: list[Tensor]) -> list[Tensor]:
        if not _counting(self.fg_bg_sampler):
            return super().subsample(labels)
        pos_masks, neg_masks, num_pos, num_neg = self.fg_bg_sampler.sample(labels)
        self._sampled_positives = num_pos  # read by forward (a replica of DataParallel has its own)
        return [_nonzero(p | n, a + b) for p, n, a, b in zip(pos_masks, neg_masks, num_pos, num_neg)]

    def forward(self, features: dict[str, Tensor], proposals: list[Tensor], image_shapes: list[tuple[int, int]],
                targets: list[dict[str, Tensor]] | None = None) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        """torchvision's forward; in training (boxes and masks, no keypoints) the positive RoIs of the
        box loss and of the mask branch are found from the sampler's counts, where torchvision waits
        for a ``torch.where(labels > 0)`` once for the loss and once per image for the masks. The box
        loss is smooth L1 with :attr:`box_loss_beta` (0: L1; torchvision's is 1/9), also while a graph
        is built (then the positives are found by ``torch.where``, as torchvision finds them)."""
        beta = box_loss_beta(self)
        counting = _counting(self.fg_bg_sampler)
        aligned, binary = bool(self.aligned_mask_targets), bool(self.binary_mask_targets)
        as_torchvision = beta == TORCHVISION_BOX_LOSS_BETA and not (self.has_mask() and (aligned or binary))
        if not self.training or self.has_keypoint() or targets is None or (not counting and as_torchvision):
            return super().forward(features, proposals, image_shapes, targets)
        for t in targets:  # torchvision's checks (dtypes: no wait)
            if t["boxes"].dtype not in (torch.float, torch.double, torch.half):
                raise TypeError(f"target boxes must of float type, instead got {t['boxes'].dtype}")
            if t["labels"].dtype != torch.int64:
                raise TypeError(f"target labels must of int64 type, instead got {t['labels'].dtype}")
        if counting:
            self._sampled_positives = None
        proposals, matched_idxs, labels, regression_targets = self.select_training_samples(proposals, targets)
        positives = self._sampled_positives if counting else None
        if counting and positives is None:  # a subclass replaced subsample: its counts are unknown here
            raise RuntimeError("LowWaitRoIHeads.forward needs LowWaitRoIHeads.subsample to run (it counts the positives)")
        class_logits, box_regression = self.box_predictor(self.box_head(self.box_roi_pool(features, proposals, image_shapes)))
        losses = dict(zip(("loss_classifier", "loss_box_reg"),
                          _fastrcnn_loss(class_logits, box_regression, labels, regression_targets,
                                         None if positives is None else sum(positives), beta)))
        if self.has_mask():
            if positives is None:
                pos = [torch.where(lab > 0)[0] for lab in labels]
            else:
                pos = [_nonzero(lab > 0, n) for lab, n in zip(labels, positives)]  # the sampled positives: labels >= 1
            mask_proposals = [p[i] for p, i in zip(proposals, pos)]
            pos_matched_idxs = [m[i] for m, i in zip(matched_idxs, pos)]
            mask_logits = self.mask_predictor(self.mask_head(self.mask_roi_pool(features, mask_proposals, image_shapes)))
            losses["loss_mask"] = mask_loss(mask_logits, mask_proposals, [t["masks"] for t in targets],
                                            [t["labels"] for t in targets], pos_matched_idxs, aligned, binary)
        return [], losses


_SWAPS: tuple[tuple[type, type], ...] = (
    (RegionProposalNetwork, LowWaitRPN),
    (RoIHeads, LowWaitRoIHeads),
    (Matcher, WaitFreeMatcher),
    (BalancedPositiveNegativeSampler, CountingSampler),
    (MultiScaleRoIAlign, LevelSortedRoIAlign),
    (BoxCoder, CachedWeightsBoxCoder),
    (RetinaNetClassificationHead, LowWaitClassificationHead),
    (RetinaNetRegressionHead, LowWaitRegressionHead),
)


def _objects(model: nn.Module) -> list[object]:
    """The R-CNN's RPN and RoI heads, and the matchers, samplers, box coders and RoI pools of those
    and of a RetinaNet (``model`` itself and its regression head)."""
    head = getattr(model, "head", None)
    parts = [model, getattr(model, "rpn", None), getattr(model, "roi_heads", None), getattr(head, "regression_head", None),
             getattr(head, "classification_head", None)]
    found: list[object] = []
    for part in parts:
        if part is not None:
            found += [getattr(part, name, None) for name in ("proposal_matcher", "fg_bg_sampler", "box_coder", "box_roi_pool", "mask_roi_pool")]
            if part is not model:
                found.append(part)
    return [o for o in found if o is not None]


def reduce_host_waits(model: nn.Module) -> nn.Module:
    """Gives a torchvision Faster / Mask R-CNN (``model.rpn``, ``model.roi_heads``) the classes of
    this module and :class:`~vtdense.models.roi_pool.LevelSortedRoIAlign` for its RoI pooling (a
    RetinaNet its matcher, box coders and the heads of :mod:`vtdense.models.retinanet_waits`), in place. Only objects whose class is exactly
    torchvision's are changed (none of these classes adds state), so a user's own subclass is left
    alone. Returns ``model``."""
    for obj in _objects(model):
        for base, ours in _SWAPS:
            if type(obj) is base:
                obj.__class__ = ours
    return model


def restore_torchvision_heads(model: nn.Module) -> nn.Module:
    """Undoes :func:`reduce_host_waits`: torchvision's own classes, for comparison or debugging. They
    know none of vtdense's options: their box losses are smooth L1 with beta 1/9, their RoIAlign and
    mask targets torchvision's, their RPN matches anchors as torchvision's (``build_detector(box_loss_beta=1/9,
    roi_aligned=False, binary_mask_targets=False, rpn_min_pos_iou=None)`` computes the same)."""
    for obj in _objects(model):
        for base, ours in _SWAPS:
            if type(obj) is ours:
                obj.__class__ = base
    return model
