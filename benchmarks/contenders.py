"""The models a benchmark case compares, and the one step each of them is timed on.

:func:`make_step` builds one contender for one case and returns a zero-argument callable that
runs one step (an inference forward, or a training step). It is a module-level function so a
fresh worker process can rebuild the same step to measure its peak memory.

Contender names:

- ``vtdense``, ``vtdense compiled`` (``torch.compile``; for a detector only its backbone + FPN, as
  ``compile_backbone`` does), ``vtdense ckpt`` (``grad_checkpointing``), ``vtdense unchunked``
  (CPU inference with :func:`vtdense.layers.chunked.set_cpu_chunking` off, to show what chunks give),
  ``vtdense global`` (MViTv2 with global attention at detection sizes, for the scaling rows),
  ``vtdense bias`` (MViTv2 with its relative positions added as a ``(Nq, Nk)`` bias in training
  too, ``rel_pos_fold=False``, against the default fold), ``vtdense blas`` (float32 CPU linear
  layers through PyTorch's BLAS, as timm's run, instead of the backend
  :mod:`vtdense.layers.cpu_linear` chose), ``vtdense unfused`` (training with
  ``vtdense.layers.mlp.set_activation_recompute(False)``: see :func:`unfused`), ``vtdense triton-norm``
  (CUDA bf16 inference with :func:`vtdense.layers.fused_norm.set_triton_norm` on for every pre-norm),
  ``vtdense aten-norm`` (off: PyTorch's LayerNorm and cast everywhere; the default is ``"auto"``), ``vtdense
  fn-recompute`` (training's recomputation through the autograd functions with a Python backward, the
  CPU's form, instead of the saved-tensor hooks of :mod:`vtdense.layers.recompute` off the CPU), ``vtdense
  triton-train`` (CUDA bf16 training with :func:`vtdense.layers.fused_norm_train.set_triton_norm_training` on),
  ``vtdense triton-attn`` (CUDA training with Swin's attention in the Triton kernels of
  :mod:`vtdense.layers.triton_window_attention` for every dtype, float32 included; the default,
  ``"auto"``, runs them for bf16 and fp16), ``vtdense sdpa-attn`` (off: SDPA's memory-efficient kernel
  with an additive term, the default before 2026-11-27),
  ``vtdense rc-all`` (training's recomputation in every layer, ``min_bytes=0``, where the default
  recomputes only layers whose activation has at least 8 MiB off the CPU), ``vtdense torchvision-heads`` (a detector with torchvision's own R-CNN heads' classes put back and
  no anchors kept across steps, ``host_syncs.torchvision_heads``: what the host-wait changes save, timed);
- ``timm``, ``timm fused`` (timm's Swin V1 with ``fused_attn`` switched on; timm has no fused path
  for Swin V2 or MViTv2), ``timm compiled``;
- ``torchvision``: ``swin_t`` / ``swin_v2_t`` feature extractors, and for the detector rows
  ``maskrcnn_resnet50_fpn_v2``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from common import randomize_
from vtdense.tasks.optim import adamw

__all__ = ["FAMILIES", "make_step", "build_model", "features"]

# family -> (vtdense name, timm name, torchvision name)
FAMILIES: dict[str, tuple[str, str | None, str | None]] = {
    "swin_t": ("swin_tiny", "swin_tiny_patch4_window7_224", "swin_t"),
    "swinv2_t": ("swinv2_tiny", "swinv2_tiny_window8_256", "swin_v2_t"),
    "mvitv2_t": ("mvitv2_tiny", "mvitv2_tiny", None),
}

# The CPU demo's detector (recipes/configs/coco_swin_demo.yaml) and the published Swin-T
# Mask R-CNN heads (recipes/configs/coco_swin_t_maskrcnn_1x.yaml).
DEMO_DETECTOR = dict(
    backbone_kwargs=dict(embed_dim=32, depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8], window_size=4, drop_path_rate=0.0),
    num_classes=4,
    fpn_channels=64,
    slim_heads=True,
    mask_head_channels=64,
    mask_head_layers=2,
    box_head_width=256,
    rois_per_image=64,
    anchor_sizes=[16, 32, 64, 128, 256],
    head_kwargs=dict(
        rpn_pre_nms_top_n_train=600, rpn_post_nms_top_n_train=300, rpn_pre_nms_top_n_test=300, rpn_post_nms_top_n_test=150
    ),
)
PUBLISHED_DETECTOR = dict(
    backbone_kwargs=dict(drop_path_rate=0.2),
    num_classes=80,
    fpn_channels=256,
    mask_head_channels=256,
    mask_head_layers=4,
    box_head_width=1024,
    rois_per_image=512,
)


def features(out: Any) -> list[torch.Tensor]:
    """The feature maps of a backbone's output (dict, list or single tensor)."""
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _timm_backbone(name: str, size: tuple[int, int]) -> torch.nn.Module:
    import timm

    if name.startswith("mvitv2"):
        # timm's MViTv2 position tables do not resize: build it for a square covering the input.
        size = max(size)
    return timm.create_model(name, pretrained=False, features_only=True, img_size=size, drop_path_rate=0.0)


def build_model(contender: str, case: dict[str, Any]) -> torch.nn.Module:
    """The model of ``contender`` for ``case`` (random weights, on the CPU)."""
    import torchvision

    import vtdense

    family = case["family"]
    base = contender
    for suffix in (" compiled", " ckpt", " unchunked", " bias", " blas", " unfused", " triton-norm", " aten-norm", " fn-recompute",
                   " triton-train", " triton-attn", " sdpa-attn", " torchvision-heads", " rc-all"):
        base = base.replace(suffix, "")
    if family in ("maskrcnn_demo", "maskrcnn"):
        from vtdense.models.detection import build_detector

        if base == "vtdense":
            cfg = DEMO_DETECTOR if family == "maskrcnn_demo" else PUBLISHED_DETECTOR
            cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}
            if contender.endswith("ckpt"):
                cfg["backbone_kwargs"]["grad_checkpointing"] = True
            model = build_detector("swin_tiny", "mask_rcnn", **cfg)
            if contender.endswith(" torchvision-heads"):  # the heads as before the host-wait changes
                from host_syncs import torchvision_heads

                torchvision_heads(model)
            return model
        if base == "torchvision":
            h, w = case["size"]
            return torchvision.models.detection.maskrcnn_resnet50_fpn_v2(
                weights=None, weights_backbone=None, num_classes=91, min_size=min(h, w), max_size=max(h, w)
            )
        raise ValueError(f"no detector contender {contender!r}")

    ours, timm_name, tv_name = FAMILIES[family]
    if base in ("vtdense", "vtdense global"):
        kwargs: dict[str, Any] = dict(out_norm=False, drop_path_rate=0.0)
        if family == "mvitv2_t":
            kwargs["window_size"] = 0 if base == "vtdense global" else case.get("mvit_window", 0)
        if contender.endswith("ckpt"):
            kwargs["grad_checkpointing"] = True
        if contender.endswith(" bias"):
            kwargs["rel_pos_fold"] = False
        model = vtdense.create_backbone(ours, **kwargs)
    elif base in ("timm", "timm fused"):
        model = _timm_backbone(timm_name, tuple(case["size"]))
        if base == "timm fused":
            n = 0
            for m in model.modules():
                if hasattr(m, "fused_attn"):
                    m.fused_attn = True
                    n += 1
            if not n:
                raise ValueError(f"timm's {timm_name} has no fused attention path")
        if contender.endswith("ckpt"):
            model.set_grad_checkpointing(True)
    elif base == "torchvision":
        model = getattr(torchvision.models, tv_name)(weights=None).features  # eval rows only: stochastic depth is off
    else:
        raise ValueError(f"unknown contender {contender!r}")
    return randomize_(model)


def _detection_batch(case: dict[str, Any], device: str, num_classes: int) -> tuple[list[torch.Tensor], list[dict]]:
    g = torch.Generator().manual_seed(0)
    h, w = case["size"]
    images, targets = [], []
    for _ in range(case["batch"]):
        images.append(torch.rand(3, h, w, generator=g).to(device))
        n = 4
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.6, h * 0.6])
        wh = (torch.rand(n, 2, generator=g) * 0.3 + 0.08) * torch.tensor([w, h])
        boxes = torch.cat([xy, xy + wh], 1).round()
        masks = torch.zeros(n, h, w, dtype=torch.uint8)
        for i, (x0, y0, x1, y1) in enumerate(boxes.long().tolist()):
            masks[i, y0:y1, x0:x1] = 1
        labels = torch.randint(1, num_classes + 1, (n,), generator=g)
        targets.append({"boxes": boxes.to(device), "labels": labels.to(device), "masks": masks.to(device)})
    return images, targets


def _autocast(case: dict[str, Any], device: str) -> contextlib.AbstractContextManager:
    if case.get("dtype", "fp32") == "bf16":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_step(contender: str, case: dict[str, Any], device: str) -> Callable[[], object]:
    """Build ``contender`` for ``case`` on ``device`` and return one step of it.

    ``case`` keys: ``family``, ``mode`` (``"infer"`` or ``"train"``), ``batch``, ``size`` (h, w),
    optional ``dtype`` (``"fp32"``/``"bf16"``, autocast) and ``mvit_window``.
    """
    setting = next((make for suffix, make in _SETTINGS.items() if suffix in contender), None)
    step = _make_step(contender, case, device)
    if setting is None:
        return step

    def step_with_setting() -> object:  # switched on for this contender's steps alone
        with setting():
            return step()

    return step_with_setting


def unfused() -> contextlib.AbstractContextManager:
    """vtdense's training without its two memory-saving autograd functions (the pre-norm recomputed in
    the backward of ``norm -> linear``, the GELU in that of ``GELU -> fc2``): what they cost in time
    against the memory they save (:func:`vtdense.layers.mlp.set_activation_recompute`)."""
    from vtdense.layers.mlp import activation_recompute

    return activation_recompute(False)


def _blas() -> contextlib.AbstractContextManager:
    from vtdense.layers.cpu_linear import use_cpu_matmul

    return use_cpu_matmul("blas")


def _triton_norm() -> contextlib.AbstractContextManager:
    from vtdense.layers.fused_norm import triton_norm

    return triton_norm(True)


def _triton_train() -> contextlib.AbstractContextManager:
    from vtdense.layers.fused_norm_train import triton_norm_training

    return triton_norm_training(True)


def _triton_attn() -> contextlib.AbstractContextManager:
    from vtdense.layers.triton_window_attention import triton_window_attention

    return triton_window_attention(True)


def _sdpa_attn() -> contextlib.AbstractContextManager:
    from vtdense.layers.triton_window_attention import triton_window_attention

    return triton_window_attention(False)


def _aten_norm() -> contextlib.AbstractContextManager:
    from vtdense.layers.fused_norm import triton_norm

    return triton_norm(False)


@contextlib.contextmanager
def _fn_recompute() -> Iterator[None]:
    """The recomputation through the autograd functions with a Python backward (the CPU's form), on
    any device: what the saved-tensor hooks form (the default off the CPU) is measured against."""
    from vtdense.layers import mlp

    mlp._set_recompute_form("function")
    try:
        yield
    finally:
        mlp._set_recompute_form("auto")


def _recompute_all() -> contextlib.AbstractContextManager:
    """Training's recomputation in every layer, however small its activation (``min_bytes=0``)."""
    from vtdense.layers.mlp import activation_recompute

    return activation_recompute(True, min_bytes=0)


#: contender suffix -> the process-wide setting its steps run under
_SETTINGS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    " blas": _blas, " triton-norm": _triton_norm, " aten-norm": _aten_norm, " triton-train": _triton_train,
    " triton-attn": _triton_attn, " sdpa-attn": _sdpa_attn, " unfused": unfused, " fn-recompute": _fn_recompute,
    " rc-all": _recompute_all}


def compiled_if_asked(contender: str, case: dict[str, Any], model: torch.nn.Module) -> torch.nn.Module:
    """``model`` compiled where ``contender`` ends in ``compiled``: a detector's backbone + FPN only,
    as ``DetectionTask(compile_backbone=true)`` does (the heads stay eager), anything else whole."""
    if not contender.endswith("compiled"):
        return model
    if case["family"].startswith("maskrcnn"):
        from vtdense.models.compile import compile_backbone

        compile_backbone(model, "inductor")
        return model
    return torch.compile(model)


def _make_step(contender: str, case: dict[str, Any], device: str) -> Callable[[], object]:
    torch.manual_seed(0)
    model = compiled_if_asked(contender, case, build_model(contender, case).to(device))
    family, mode = case["family"], case["mode"]

    if family.startswith("maskrcnn"):
        images, targets = _detection_batch(case, device, 4 if family == "maskrcnn_demo" else 80)
        if mode == "infer":
            model.eval()

            def infer() -> object:
                with torch.inference_mode(), _autocast(case, device):
                    return model(images)

            return infer
        model.train()
        # vtdense's tasks' AdamW (fused where torch has the kernel), for both contenders alike.
        opt = adamw([{"params": [p for p in model.parameters() if p.requires_grad]}], lr=1e-4, weight_decay=0.05)

        def det_train() -> None:
            with _autocast(case, device):
                losses = model(images, targets)
            sum(losses.values()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # here, not first: a memory baseline taken between steps holds no gradients

        return det_train

    x = torch.randn(case["batch"], 3, *case["size"], generator=torch.Generator().manual_seed(1)).to(device)
    if mode == "infer":
        model.eval()

        from vtdense.layers.chunked import cpu_chunking

        chunking = not contender.endswith("unchunked")

        def infer_backbone() -> object:
            with torch.inference_mode(), _autocast(case, device), cpu_chunking(chunking):
                return model(x)

        return infer_backbone
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def train() -> None:
        with _autocast(case, device):
            feats = features(model(x))
        sum(f.float().mean() for f in feats).backward()
        for p in params:  # here, not first: a memory baseline taken between steps holds no gradients
            p.grad = None

    return train
