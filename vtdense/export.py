"""Export vtdense models to ONNX (and backbones to ``torch.export``) for deployment.

.. code-block:: python

    import vtdense
    vtdense.export("runs/coco_swin/.../checkpoints/best.ckpt", "detector.onnx", input_size=(800, 1344))
    vtdense.export(backbone, "backbone.onnx", input_size=(512, 512))

or from a shell: ``python -m vtdense.export CHECKPOINT_OR_BACKBONE OUT.onnx --what fpn --input-size 512 512``.

What is exported (``what``), its ONNX inputs and outputs:

============  ===============================  ==============================================
``what``      input                            outputs
============  ===============================  ==============================================
backbone      ``image`` (N, C, H, W)           one map per stage, named like the backbone's
                                               ``out_names`` (``stage1`` ... ``stage4``)
fpn           ``image`` (N, C, H, W)           pyramid levels ``p2`` ... ``p5`` + ``pool``
                                               (R-CNN) or ``p3`` ... ``p7`` (RetinaNet, FCOS)
segmenter     ``image`` (N, C, H, W) in [0, 1] ``logits`` (N, classes, H, W)
detector      ``image`` (C, H, W) in [0, 1]    ``boxes`` (D, 4) XYXY in input pixels,
                                               ``labels`` (D,), ``scores`` (D,), and
                                               ``masks`` (D, 1, H, W) for Mask R-CNN
============  ===============================  ==============================================

Backbone and FPN inputs are what the backbone itself takes (normalised images). The segmenter
graph takes ``[0, 1]`` images and normalises inside (mean / std of the checkpoint's task, ImageNet
for a bare SMP model), pads to the model's multiple (none for mmseg's head layout) and brings the logits to
the input's size, exactly like ``SegmentationTask.forward`` with whole-image inference. The detector graph takes ``[0, 1]``
images too: torchvision's transform inside it normalises and pads.

Sizes: the batch dimension ``N`` is dynamic; height and width are fixed at export time
(``input_size``), because the backbones turn feature-map sizes into Python numbers (window
padding and shift masks, relative-position tables, cached per size), which both of PyTorch's
exporters record as constants. onnxruntime rejects another size with a shape error instead of
returning wrong numbers. The detector takes one image per call (torchvision's detectors take a
list of images, whose length the trace fixes); the number of detections ``D`` is dynamic.

Exporter: the TorchScript-based ``torch.onnx.export(..., dynamo=False)``, the path torchvision
documents for its detectors. The ``torch.export``-based exporter (``dynamo=True``) cannot trace
torchvision's NMS (a data-dependent number of boxes), and for the other models it gave the same
numbers but took 10-20 times longer. ``torch.export`` itself is offered for backbones and FPNs
by :func:`export_program`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import inspect
import json
import re
import sys
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.checkpoints.io import SAFETENSORS_CONFIG_KEY, read_task_checkpoint, safetensors_metadata

__all__ = [
    "KINDS",
    "export",
    "export_program",
    "load_checkpoint",
    "model_from_checkpoint",
    "main",
]

#: Things that can be exported, in the order a model contains them.
KINDS: tuple[str, ...] = ("backbone", "fpn", "segmenter", "detector")
#: Opsets the TorchScript-based exporter supports for these models (SDPA needs 14).
MIN_OPSET, MAX_OPSET = 14, 20
DEFAULT_OPSET = 17
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


# ---------------------------------------------------------------------------- checkpoints
def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` (no code from the file runs):
    :func:`vtdense.checkpoints.io.read_task_checkpoint`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file holds other Python objects, or is not a checkpoint (names the file).
    """
    return read_task_checkpoint(path)


def _task_class(ckpt: Mapping[str, Any], path: Path) -> type[nn.Module]:
    hp = ckpt.get("hyper_parameters")
    if not isinstance(hp, Mapping) or "state_dict" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint of a vtdense task (no hyper_parameters / state_dict)")
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    class_path = str(hp.get("_class_path", ""))  # set when LightningCLI built the task
    if class_path.endswith("DetectionTask") or "head" in hp:
        return DetectionTask
    if class_path.endswith("SegmentationTask") or "arch" in hp:
        return SegmentationTask
    raise ValueError(
        f"{str(path)!r}: cannot tell the task from its hyper_parameters ({sorted(hp)[:8]}...); "
        "expected a DetectionTask or SegmentationTask checkpoint"
    )


def model_from_checkpoint(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the trained model of a ``DetectionTask`` / ``SegmentationTask`` checkpoint.

    The task is rebuilt from the checkpoint's ``hyper_parameters`` (without loading
    ``backbone_weights``, which the checkpoint's weights replace) and its ``model.*`` weights are
    loaded strictly.

    Returns:
        ``(model, info)``: the torchvision detector or SMP segmentation model in eval mode, and
        ``info`` with ``kind`` (``"detector"`` / ``"segmenter"``), ``mean`` / ``std`` (segmenter
        normalisation) and ``hyper_parameters``.
    """
    path = Path(path)
    return _rebuild(load_checkpoint(path), path)


def _rebuild(ckpt: Mapping[str, Any], path: Path) -> tuple[nn.Module, dict[str, Any]]:
    cls = _task_class(ckpt, path)
    hp = dict(ckpt["hyper_parameters"])
    if hp.get("num_classes") is None:
        raise ValueError(f"{str(path)!r}: hyper_parameters have no num_classes; the model was never built")
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in hp.items() if k in params and k != "self"}
    kwargs["backbone_weights"] = None  # the checkpoint's weights replace them; the file may be elsewhere
    if "metric_backend" in kwargs:
        kwargs["metric_backend"] = "pycocotools"  # metrics are not exported; do not need the optional one
    task = cls(**kwargs)
    # what a checkpoint of an earlier release needs (e.g. a segmenter saved before ``head_layout``
    # holds SMP's own model), as Lightning's loading and ``from_checkpoint`` apply it
    task.on_load_checkpoint(dict(ckpt))
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{str(path)!r}: state_dict has no 'model.*' weights")
    try:
        task.model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{str(path)!r}: weights do not fit the model rebuilt from its hyper_parameters: {err}") from err
    kind = "detector" if cls.__name__ == "DetectionTask" else "segmenter"
    info = {"kind": kind, "hyper_parameters": hp, "mean": hp.get("mean", _IMAGENET_MEAN), "std": hp.get("std", _IMAGENET_STD)}
    return task.model.eval(), info


# ---------------------------------------------------------------------------- wrappers
class _Features(nn.Module):
    """Backbone or FPN with its output dict flattened to a tuple (ONNX outputs are positional)."""

    def __init__(self, module: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.module, self.names = module, list(names)

    def forward(self, image: Tensor) -> tuple[Tensor, ...]:
        out = self.module(image)
        return tuple(_pin_spatial(out[n]) for n in self.names)


class _Segmenter(nn.Module):
    """``[0, 1]`` images -> normalise -> pad to the model's multiple -> SMP model -> logits at the input's size.

    Runs the SMP model's encoder, decoder and segmentation head like its ``forward`` does
    (and ``SegmentationTask``), with the feature sizes pinned for the exporter.
    """

    def __init__(self, model: nn.Module, mean: Sequence[float] | None, std: Sequence[float] | None, multiple: int) -> None:
        super().__init__()
        self.model, self.multiple, self.normalize = model, multiple, mean is not None
        if mean is not None:
            self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1))
            self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, image: Tensor) -> Tensor:
        x = (image - self.mean) / self.std if self.normalize else image
        h, w = x.shape[-2:]
        ph, pw = -h % self.multiple, -w % self.multiple
        if ph or pw:
            x = F.pad(x, (0, pw, 0, ph))
        feats = [_pin_spatial(f) for f in self.model.encoder(x)]
        from vtdense.models.segmentation import logits_at

        return logits_at(self.model.segmentation_head(self.model.decoder(feats)), h, w)


def _pin_spatial(f: Tensor) -> Tensor:
    """Record ``f``'s channel and spatial sizes as constants in the trace (batch stays dynamic).

    The exporter loses track of sizes computed inside the backbone, and SMP decoders need them
    (UPerNet's adaptive pooling cannot be exported without a known input size).
    """
    if f.numel() == 0:
        return f
    return f.reshape(f.shape[0], *(int(s) for s in f.shape[1:]))


class _MatmulAdaptiveAvgPool(nn.Module):
    """``nn.AdaptiveAvgPool2d`` as two matrix products, exportable for any fixed input size.

    ONNX has no adaptive pooling; the exporter maps it to a plain pooling only when the output
    size divides the input size (UPerNet's 1/2/3/6 bins on a 16 x 16 map do not). With the
    input size fixed at export, the bin averages are constant ``(out, in)`` matrices:
    ``out = P_h @ x @ P_w^T`` with PyTorch's bins ``[floor(i*in/out), ceil((i+1)*in/out))``.
    """

    def __init__(self, output_size: int | tuple[int | None, int | None]) -> None:
        super().__init__()
        self.output_size = output_size if isinstance(output_size, tuple) else (output_size, output_size)

    @staticmethod
    def _bins(n_in: int, n_out: int, like: Tensor) -> Tensor:
        m = torch.zeros(n_out, n_in, dtype=like.dtype, device=like.device)
        for i in range(n_out):
            lo, hi = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
            m[i, lo:hi] = 1.0 / (hi - lo)
        return m

    def forward(self, x: Tensor) -> Tensor:
        h, w = int(x.shape[-2]), int(x.shape[-1])
        oh, ow = (o if o is not None else s for o, s in zip(self.output_size, (h, w)))
        return self._bins(h, oh, x) @ x @ self._bins(w, ow, x).t()


def _exportable_pooling(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``AdaptiveAvgPool2d`` layers are :class:`_MatmulAdaptiveAvgPool`."""
    pools = [n for n, m in model.named_modules() if isinstance(m, nn.AdaptiveAvgPool2d)]
    if not pools:
        return model
    model = copy.deepcopy(model)
    for name in pools:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _MatmulAdaptiveAvgPool(parent.get_submodule(child).output_size))
    return model


class _Detector(nn.Module):
    """One ``[0, 1]`` image -> the torchvision detector's boxes, labels, scores (, masks)."""

    def __init__(self, model: nn.Module, keys: Sequence[str]) -> None:
        super().__init__()
        self.model, self.keys = model, list(keys)

    def forward(self, image: Tensor) -> tuple[Tensor, ...]:
        det = self.model([image])[0]
        return tuple(det[k] for k in self.keys)


# ---------------------------------------------------------------------------- resolving
def _is_detector(m: nn.Module) -> bool:
    from torchvision.models.detection import FCOS, RetinaNet
    from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN

    return isinstance(m, (GeneralizedRCNN, RetinaNet, FCOS))


def _is_segmenter(m: nn.Module) -> bool:
    from segmentation_models_pytorch.base import SegmentationModel

    return isinstance(m, SegmentationModel)


def _resolve(source: Any, backbone_kwargs: Mapping[str, Any] | None) -> tuple[nn.Module, dict[str, Any]]:
    """Any accepted source -> (module, info with ``kind`` and segmenter normalisation)."""
    from vtdense.backbones.base import Backbone
    from vtdense.models.detection import BackboneWithFPN

    info: dict[str, Any] = {"mean": _IMAGENET_MEAN, "std": _IMAGENET_STD}
    if isinstance(source, (str, Path)):
        from vtdense.backbones.registry import list_backbones

        if isinstance(source, str) and source in list_backbones():
            from vtdense.backbones.registry import create_backbone

            return create_backbone(source, **dict(backbone_kwargs or {})).eval(), {**info, "kind": "backbone"}
        path = Path(source)
        if path.is_dir():
            from vtdense.checkpoints.io import read_task_checkpoint

            read_task_checkpoint(path)  # raises: a folder (a sharded checkpoint?) is no checkpoint file
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(source)!r} is neither a file nor a backbone name; backbone names: {', '.join(list_backbones())}"
            )
        metadata = safetensors_metadata(path)
        if metadata is not None and SAFETENSORS_CONFIG_KEY not in metadata:
            raise ValueError(f"{str(path)!r} is a safetensors file without vtdense's backbone config "
                             "(not written by vtdense.save_backbone): build the backbone and load it with vtdense.load_pretrained")
        if metadata is not None:  # a file written by vtdense.save_backbone
            from vtdense.checkpoints.convert import load_backbone

            return load_backbone(path, **dict(backbone_kwargs or {})).eval(), {**info, "kind": "backbone"}
        ckpt = load_checkpoint(path)
        if "vtdense_backbone" in ckpt:  # a .pth file of vtdense < 0.1's save_backbone
            from vtdense.checkpoints.convert import load_backbone

            return load_backbone(path, **dict(backbone_kwargs or {})).eval(), {**info, "kind": "backbone"}
        return _rebuild(ckpt, path)
    if not isinstance(source, nn.Module):
        raise TypeError(f"export takes a model, a checkpoint path or a backbone name, got {type(source).__name__}")
    task_model = getattr(source, "model", None)
    if task_model is not None and hasattr(source, "hparams") and isinstance(task_model, nn.Module):  # a vtdense task
        hp = dict(source.hparams)
        info.update(mean=hp.get("mean", _IMAGENET_MEAN), std=hp.get("std", _IMAGENET_STD))
        source = task_model
    if isinstance(source, Backbone):
        return source, {**info, "kind": "backbone"}
    if isinstance(source, BackboneWithFPN):
        return source, {**info, "kind": "fpn"}
    if _is_detector(source):
        return source, {**info, "kind": "detector"}
    if _is_segmenter(source):
        return source, {**info, "kind": "segmenter"}
    raise TypeError(
        f"cannot export a {type(source).__name__}: expected a vtdense Backbone, BackboneWithFPN, a detector from "
        "build_detector, an SMP model from build_segmentor, or a DetectionTask / SegmentationTask"
    )


def _select(model: nn.Module, kind: str, what: str) -> nn.Module:
    """The part ``what`` of a ``kind`` model (e.g. the backbone of a detector)."""
    if what == kind:
        return model
    if kind == "detector" and what == "fpn":
        return model.backbone
    if kind == "detector" and what == "backbone":
        return model.backbone.body
    if kind == "fpn" and what == "backbone":
        return model.body
    if kind == "segmenter" and what == "backbone":
        return model.encoder.backbone
    raise ValueError(f"cannot export what={what!r} from a {kind}; a {kind} contains: {', '.join(_contains(kind))}")


def _contains(kind: str) -> list[str]:
    return {"backbone": ["backbone"], "fpn": ["backbone", "fpn"], "segmenter": ["backbone", "segmenter"]}.get(
        kind, ["backbone", "fpn", "detector"]
    )


# ---------------------------------------------------------------------------- tracing hygiene
def _clear_size_caches() -> None:
    """Empty vtdense's per-size caches (window masks, position indices).

    Tracing fills them with entries made from traced values (``torch.export`` stores
    FakeTensors there, which later eager calls would silently return), so they are emptied
    around every export; the next eager call rebuilds what it needs.
    """
    lru = type(functools.lru_cache(maxsize=1)(lambda: None))
    for name, mod in list(sys.modules.items()):
        if name.startswith("vtdense.") and mod is not None:
            for value in list(vars(mod).values()):
                if isinstance(value, lru):
                    value.cache_clear()


@contextmanager
def _tracing(model: nn.Module) -> Iterator[None]:
    """Eval mode and clean caches while tracing; the modules' train/eval flags are restored after."""
    modes = [(m, m.training) for m in model.modules()]
    _clear_size_caches()
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        _clear_size_caches()
        for m, training in modes:
            m.training = training


def export_program(
    model: nn.Module, example: Tensor, *, dynamic_batch: bool = True
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of a backbone or BackboneWithFPN, returning its output dict.

    Height and width are static (see the module docstring); the batch dimension is dynamic
    when ``dynamic_batch``. vtdense's per-size caches are emptied before and after, so eager
    calls afterwards return real tensors.

    Args:
        model: a vtdense backbone or :class:`~vtdense.models.detection.BackboneWithFPN`.
        example: ``(N, C, H, W)`` example batch (``N >= 2`` when ``dynamic_batch``).
    """
    if dynamic_batch and example.shape[0] < 2:
        example = example.expand(2, *example.shape[1:]).contiguous()  # a batch of 1 would be specialised
    shapes = ({0: torch.export.Dim("batch", min=1, max=4096)},) if dynamic_batch else None
    with _tracing(model):
        return torch.export.export(model, (example,), dynamic_shapes=shapes)


# ---------------------------------------------------------------------------- ONNX
def export(
    model_or_checkpoint: nn.Module | str | Path,
    path: str | Path,
    *,
    what: str | None = None,
    input_size: tuple[int, int] = (512, 512),
    opset: int = DEFAULT_OPSET,
    in_chans: int | None = None,
    normalize: bool = True,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    backbone_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Export a model (or a part of it) to an ONNX file.

    Args:
        model_or_checkpoint: a vtdense backbone, ``BackboneWithFPN``, detector (``build_detector``),
            SMP model (``build_segmentor``), ``DetectionTask`` / ``SegmentationTask``; or a path to
            a Lightning ``.ckpt`` of those tasks or a ``save_backbone`` file; or a backbone name
            (random weights, with ``backbone_kwargs``).
        path: output ``.onnx`` file.
        what: ``backbone``, ``fpn``, ``segmenter`` or ``detector``; default: the whole model given.
        input_size: ``(H, W)`` of the images the graph takes (fixed; the batch is dynamic).
        opset: ONNX opset, 14-20.
        in_chans: image channels (default: the model's).
        normalize: segmenter only: normalise ``[0, 1]`` inputs inside the graph (``False``: the
            graph takes already normalised images).
        mean: segmenter normalisation mean (default: the task's, else ImageNet's).
        std: segmenter normalisation std.
        backbone_kwargs: ``create_backbone`` options when the source is a backbone name.

    Returns:
        The written path.

    Raises:
        ValueError: an unknown ``what``, a part the model lacks, a bad size or opset.
    """
    if what is not None and what not in KINDS:
        raise ValueError(f"unknown what={what!r}; choose one of {', '.join(KINDS)}")
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise ValueError(f"opset={opset}: the TorchScript-based ONNX exporter supports {MIN_OPSET}..{MAX_OPSET} for these models")
    h, w = (int(v) for v in input_size)
    if h < 1 or w < 1:
        raise ValueError(f"input_size must be two positive sizes (H, W), got {tuple(input_size)}")
    if importlib.util.find_spec("onnx") is None:
        raise ModuleNotFoundError("ONNX export needs the onnx package: pip install 'vtdense[export]'")
    model, info = _resolve(model_or_checkpoint, backbone_kwargs)
    kind = info["kind"]
    what = what or kind
    part = _select(model, kind, what)
    chans = int(in_chans or _in_chans(part, what))
    names_out: list[str]
    batch_axes = {0: "batch"}
    if what in ("backbone", "fpn"):
        names_out = list(part.out_names if what == "backbone" else part.level_names)
        wrapper: nn.Module = _Features(part, names_out)
        example = torch.rand(2, chans, h, w)
        axes = {"image": batch_axes, **{n: batch_axes for n in names_out}}
    elif what == "segmenter":
        from vtdense.models.segmentation import input_multiple

        multiple = input_multiple(part)
        if normalize:
            mean, std = (mean or info["mean"]), (std or info["std"])
            if len(mean) != chans or len(std) != chans:
                raise ValueError(f"mean/std have {len(mean)}/{len(std)} values but the images have {chans} channels")
        wrapper = _Segmenter(_exportable_pooling(part), mean if normalize else None, std, multiple)
        names_out = ["logits"]
        example = torch.rand(2, chans, h, w)
        axes = {"image": batch_axes, "logits": batch_axes}
    else:
        from torchvision.models.detection import MaskRCNN

        names_out = ["boxes", "labels", "scores"] + (["masks"] if isinstance(part, MaskRCNN) else [])
        heads = getattr(part, "roi_heads", None)
        aligned = any(getattr(getattr(heads, name, None), "aligned", False) for name in ("box_roi_pool", "mask_roi_pool"))
        if aligned and int(opset) < 16:
            raise ValueError(
                f"opset={opset}: this detector's RoIAlign is aligned (roi_aligned=True), which ONNX's RoiAlign "
                "expresses from opset 16 on (coordinate_transformation_mode 'half_pixel'); export with opset >= 16"
            )
        wrapper = _Detector(part, names_out)
        example = torch.rand(chans, h, w)
        axes = {n: {0: "detections"} for n in names_out}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _tracing(wrapper), warnings.catch_warnings():
        # Size-dependent Python in the backbones is recorded as constants on purpose (static H, W).
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message="The feature will be removed.*")
        # Known, harmless exporter / torchvision notes (the gathers' indices are never negative).
        for note in ("Constant folding - Only steps=1", "To copy construct from a tensor", "`torch.jit.script` is deprecated",
                     "Exporting aten::index operator of advanced indexing"):
            warnings.filterwarnings("ignore", message=re.escape(note) + ".*")
        torch.onnx.export(
            wrapper,
            (example,),
            str(path),
            dynamo=False,
            opset_version=int(opset),
            input_names=["image"],
            output_names=names_out,
            dynamic_axes=axes,
            do_constant_folding=True,
        )
    return path


def _in_chans(part: nn.Module, what: str) -> int:
    if what == "backbone":
        return int(getattr(part, "in_chans", 3))
    if what == "fpn":
        return int(getattr(part.body, "in_chans", 3))
    if what == "segmenter":
        return int(getattr(part.encoder, "_in_channels", 3))
    return len(getattr(part.transform, "image_mean", (0, 0, 0)))


# ---------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vtdense.export SOURCE OUTPUT [options]``; returns the exit status.

    Bad input (a missing file, an unknown backbone, a part the model lacks, an unsafe
    checkpoint) prints one ``error:`` line to stderr and returns 2.
    """
    parser = argparse.ArgumentParser(
        prog="python -m vtdense.export",
        description="Export a vtdense model to ONNX. SOURCE: a DetectionTask / SegmentationTask .ckpt, "
        "a file from vtdense.save_backbone, or a backbone name (random weights).",
    )
    parser.add_argument("source", help="checkpoint path or backbone name")
    parser.add_argument("output", help="output .onnx path")
    parser.add_argument("--what", choices=KINDS, default=None, help="part to export (default: the whole model)")
    parser.add_argument("--input-size", nargs=2, type=int, default=(512, 512), metavar=("H", "W"), help="fixed image size")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset ({MIN_OPSET}-{MAX_OPSET})")
    parser.add_argument("--backbone-kwargs", type=json.loads, default=None, metavar="JSON",
                        help='create_backbone options for a backbone name, e.g. \'{"window_size": 12}\'')
    parser.add_argument("--no-normalize", action="store_true", help="segmenter: take normalised images, not [0, 1] ones")
    args = parser.parse_args(argv)
    try:
        out = export(
            args.source,
            args.output,
            what=args.what,
            input_size=tuple(args.input_size),
            opset=args.opset,
            normalize=not args.no_normalize,
            backbone_kwargs=args.backbone_kwargs,
        )
    except (FileNotFoundError, ModuleNotFoundError, ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    for line in graph_signature(out):
        print(line)
    return 0


def graph_signature(path: str | Path) -> list[str]:
    """``["# inputs  image [batch, 3, 512, 512]", "# outputs stage1 [...]  ..."]``: the names and
    shapes (a name for a dynamic dimension) of an ONNX file's inputs and outputs, read from its
    graph (weights stored apart are not loaded)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph

    def shape(value: Any) -> str:
        dims = value.type.tensor_type.shape.dim
        return "[" + ", ".join(d.dim_param or str(d.dim_value) for d in dims) + "]"

    return [f"# inputs  {'  '.join(f'{v.name} {shape(v)}' for v in graph.input)}",
            f"# outputs {'  '.join(f'{v.name} {shape(v)}' for v in graph.output)}"]


class _CallableModule(types.ModuleType):
    """Lets ``vtdense.export(...)`` call :func:`export` although ``vtdense.export`` is this module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Path:
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
