"""Kernel-launching ATen calls and host waits of one Mask R-CNN training step, counted on the CPU.

On a GPU the published detector's step is bound by the host (``benchmarks/RESULTS.md``: 44 ms of
kernels in a 71 ms step, the step waiting on the device about fifty times). Two things cost host time
there: every ATen call that launches a kernel, and every *host wait*, where the host must read a
value the device computes before it can go on (an output whose size depends on the data, as
``nonzero`` or ``torch.where(mask)``; ``.item()``, ``.tolist()``; ``nms``, which finishes on the host;
a blocking copy from host memory to the device). A wait drains the device's queue, so the host's
work after it no longer overlaps the kernels before it.

Both are properties of the code, not of the device, so this script counts them on the CPU with real
tensors (the heads need real values): a ``TorchDispatchMode`` sees every ATen call, by region of the
model (backbone + FPN, RPN, RoI heads, backward, optimizer), and counts the data-dependent ones;
``Tensor.tolist`` and ``Tensor.item`` are counted where they are called; so are tensors made from
Python data for a device (``torch.tensor`` / ``torch.as_tensor`` with ``device=``) and Python numbers
assigned through an index tensor, since on a GPU each is a blocking copy from host memory. Not seen:
copies of CPU tensors to the device (none in the heads), and waits inside a CUDA kernel's own code
(``bincount``, which vtdense's RoI pooling does not use). ``--cuda`` counts on a GPU with torch's
sync-debug mode, which sees everything. torchvision's
``batched_nms`` picks its implementation by device (one NMS over offset boxes up to 25,000 boxes on
CUDA, one NMS per level above 1,000 on the CPU); the count takes the CUDA branch, so what is counted is
what a GPU step runs. The backbone runs its CPU paths here (its GPU calls are counted by
``launches.py``); the heads' code is the same on both devices.

    python benchmarks/host_syncs.py [--size 320x480] [--predict] [--waits]
    python benchmarks/host_syncs.py --task     # DetectionTask's steps under Lightning's Trainer
    python benchmarks/host_syncs.py --cuda     # on a GPU: the synchronising calls torch reports, per step

Contenders: ``vtdense`` (the default heads), ``vtdense torchvision-heads`` (the same model with
torchvision's own RoI pooling and proposal filtering put back) and torchvision's
``maskrcnn_resnet50_fpn_v2``, on the published heads' sizes (``contenders.PUBLISHED_DETECTOR``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from launches import _NO_KERNEL  # noqa: E402

__all__ = ["HostWaits", "count_step", "cuda_nms_branch", "torchvision_heads", "markdown", "main"]

#: ATen ops whose output size (or value on the host) depends on the data: a host wait on a GPU
_WAITS = frozenset({"nonzero", "_local_scalar_dense", "masked_select", "_unique2", "unique_dim",
                    "unique_consecutive", "nms", "is_nonzero", "equal", "allclose"})
REGIONS = ("backbone", "rpn", "roi_heads", "other forward", "backward", "optimizer")


class HostWaits(TorchDispatchMode):
    """Counts, per region, the ATen calls that launch a kernel and the host waits.

    ``region`` is set by the caller (:func:`count_step` uses module hooks). An ``index`` or
    ``index_put_`` with a boolean index counts as a wait (it runs ``nonzero`` inside). ``tolist`` and
    ``item`` are counted by :meth:`host_reads`, which wraps them while the mode is active (a CPU
    ``tolist`` reaches no ATen op)."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "other forward"
        self.calls: collections.Counter[str] = collections.Counter()
        self.waits: collections.Counter[str] = collections.Counter()
        self.wait_ops: collections.Counter[str] = collections.Counter()
        self._fresh: Any = None

    def _wait(self, what: str) -> None:
        self.waits[self.region] += 1
        self.wait_ops[f"{self.region}: {what}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.calls[self.region] += 1
        if name in _WAITS:
            self._wait(name)
        elif name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._wait(f"{name} (boolean)")
            elif name != "index" and len(args) > 2 and args[2] is self._fresh:
                self._wait("number assigned through an index")  # its value is copied to the device
        out = func(*args, **kwargs)
        self._fresh = out if name == "lift_fresh" else None  # a tensor just made from Python data
        return out

    @contextlib.contextmanager
    def host_reads(self) -> Iterator[None]:
        """Counts ``Tensor.tolist`` / ``Tensor.item`` calls (the latter also reaches
        ``_local_scalar_dense``, so only ``tolist`` is added here), and ``torch.tensor`` /
        ``torch.as_tensor`` of Python data with a ``device`` given (a copy to the GPU there; without
        one the tensor stays on the host, as torchvision's RoI level mapper's ``eps``, no copy)."""
        original = torch.Tensor.tolist, torch.tensor, torch.as_tensor
        mode = self

        def tolist(t: torch.Tensor) -> Any:
            mode._wait("tolist")
            return original[0](t)

        def made(make: Any) -> Any:
            def wrapper(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
                if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                    mode._wait("tensor from host data")
                return make(data, *args, **kwargs)
            return wrapper

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        torch.tensor, torch.as_tensor = made(original[1]), made(original[2])
        try:
            yield
        finally:
            torch.Tensor.tolist, torch.tensor, torch.as_tensor = original  # type: ignore[method-assign]


@contextlib.contextmanager
def cuda_nms_branch() -> Iterator[None]:
    """torchvision's ``batched_nms`` as it runs on CUDA tensors (the coordinate trick up to
    100,000 coordinates, one NMS per category above), whatever the device; vtdense's heads, which
    make the same choice, too."""
    from torchvision.ops import boxes as box_ops

    original = box_ops.batched_nms

    def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou: float) -> torch.Tensor:
        if boxes.numel() > 100_000:
            return box_ops._batched_nms_vanilla(boxes, scores, idxs, iou)
        return box_ops._batched_nms_coordinate_trick(boxes, scores, idxs, iou)

    from vtdense.models import nms

    limit = nms._one_nms_limit
    box_ops.batched_nms = batched_nms
    nms._one_nms_limit = lambda device: 100_000  # vtdense's heads follow torchvision's choice
    try:
        yield
    finally:
        box_ops.batched_nms = original
        nms._one_nms_limit = limit


def torchvision_heads(model: torch.nn.Module) -> torch.nn.Module:
    """vtdense's detector with torchvision's own heads' classes put back (RoI pooling, matching,
    sampling, proposal filtering), torchvision's post-processing (mask pasting) and no anchors kept
    across steps: the heads before vtdense's host-wait changes."""
    import types

    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    from vtdense.models.rcnn_waits import restore_torchvision_heads

    model.rpn.anchor_generator.cache_size = 0
    model.transform.postprocess = types.MethodType(GeneralizedRCNNTransform.postprocess, model.transform)
    return restore_torchvision_heads(model)


def _build(contender: str, size: tuple[int, int]) -> torch.nn.Module:
    from contenders import build_model

    case = dict(family="maskrcnn", size=list(size), mode="train", batch=2)
    return build_model(contender, case)  # "vtdense torchvision-heads" calls torchvision_heads


def count_step(contender: str, size: tuple[int, int] = (320, 480), model: torch.nn.Module | None = None,
               train: bool = True) -> dict[str, Any]:
    """Counts one training step (forward, backward, AdamW) of ``contender`` at batch 2, or with
    ``train=False`` one prediction (every detection kept: 100 per image, masks pasted), after one
    uncounted step. Returns ``{"calls": {region: n}, "waits": {region: n}, "wait_ops": {...}}``."""
    from contenders import _detection_batch
    from vtdense.tasks.optim import adamw

    torch.manual_seed(0)
    model = model if model is not None else _build(contender, size)
    model.train()
    case = dict(family="maskrcnn", size=list(size), mode="train", batch=2)
    images, targets = _detection_batch(case, "cpu", 80)
    opt = adamw([{"params": [p for p in model.parameters() if p.requires_grad]}], lr=1e-4, weight_decay=0.05)
    mode = HostWaits()
    regions = {"backbone": model.backbone, "rpn": model.rpn, "roi_heads": model.roi_heads}
    handles = []
    for name, module in regions.items():
        def pre(m: Any, a: Any, name: str = name) -> None:
            mode.region = name

        def post(m: Any, a: Any, o: Any) -> None:
            mode.region = "other forward"

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    if not train:
        model.eval()
        model.roi_heads.score_thresh = 0.0  # random weights: keep every detection, as a trained model would keep its 100

    def step(counted: bool) -> None:
        with (mode if counted else contextlib.nullcontext()), (mode.host_reads() if counted else contextlib.nullcontext()):
            mode.region = "other forward"
            if not train:
                with torch.no_grad():
                    model(images)
                return
            losses = model(images, targets)
            mode.region = "backward"
            sum(losses.values()).backward()
            mode.region = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        with cuda_nms_branch():
            step(False)
            step(True)
    finally:
        for h in handles:
            h.remove()
    return {"calls": {r: mode.calls[r] for r in REGIONS}, "waits": {r: mode.waits[r] for r in REGIONS},
            "wait_ops": dict(sorted(mode.wait_ops.items()))}


def count_cuda_syncs(contender: str, size: tuple[int, int] = (800, 1333), bf16: bool = True) -> dict[str, Any]:
    """On a GPU: the synchronising CUDA calls of one training step of ``contender`` (the published
    heads, batch 2), as ``torch.cuda.set_sync_debug_mode("warn")`` reports them (every wait, blocking
    copies to the device included), after one uncounted step. Returns ``{"syncs": n, "where": {...}}``."""
    import warnings

    from contenders import make_step

    if not torch.cuda.is_available():
        raise RuntimeError("count_cuda_syncs needs a CUDA device")
    case = dict(family="maskrcnn", size=list(size), mode="train", batch=2, dtype="bf16" if bf16 else "fp32")
    step = make_step(contender, case, "cuda")
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"syncs": len(syncs), "where": dict(where.most_common())}


TASK_REGIONS = ("model", "training_step", "between steps")


def count_task_steps(steps: int = 3) -> dict[str, Any]:
    """Counts ``steps`` training steps of a tiny Mask R-CNN ``DetectionTask`` run by Lightning's
    ``Trainer`` (synthetic COCO data, progress bar on, as a user runs it), after one uncounted step,
    by region: the model's forward (``model``), the rest of ``training_step`` with the backward and
    the optimizer (``training_step``), and Lightning between steps (``between steps``: logging, the
    progress bar). Data loading and ``transfer_batch_to_device`` work on CPU tensors, which on a GPU
    wait for nothing, and are left out. Returns waits and calls per step by region, and the waits by op."""
    import tempfile

    import lightning as L

    from vtdense.data.coco import COCODataModule, COCODetection
    from vtdense.data.synthetic import make_synthetic_coco
    from vtdense.tasks.detection import DetectionTask

    mode = HostWaits()
    tiny = dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), window_size=4)
    patched = {"forward": DetectionTask.forward, "transfer": DetectionTask.transfer_batch_to_device,
               "getitem": COCODetection.__getitem__}

    def region(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before, mode.region = mode.region, name
            try:
                return fn(*args, **kwargs)
            finally:
                mode.region = before
        return wrapped

    class Window(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            # Steps 1 to `steps` whole, each with what Lightning does after it (before the next).
            if idx == 1:
                mode.__enter__()
                self.reads = mode.host_reads()
                self.reads.__enter__()
            elif idx == steps + 1:
                self.reads.__exit__(None, None, None)
                mode.__exit__(None, None, None)
            mode.region = "training_step"

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            mode.region = "between steps"

    window = Window()
    DetectionTask.forward = region("model", patched["forward"])
    DetectionTask.transfer_batch_to_device = region("CPU tensors", patched["transfer"])
    COCODetection.__getitem__ = region("CPU tensors", patched["getitem"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = make_synthetic_coco(f"{tmp}/coco", num_train=2 * (steps + 3), num_val=2, size_range=(64, 96), num_classes=2)
            torch.manual_seed(0)
            task = DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, head="mask_rcnn", num_classes=None,
                                 fpn_channels=32, slim_heads=True)
            dm = COCODataModule(root=str(root), batch_size=2, num_workers=0, train_scales=(80,), max_size=160, test_scale=100)
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + 2, limit_val_batches=0, num_sanity_val_steps=0,
                                callbacks=[window], logger=False, enable_checkpointing=False, default_root_dir=tmp,
                                enable_model_summary=False)
            with cuda_nms_branch():
                trainer.fit(task, datamodule=dm)
    finally:
        DetectionTask.forward = patched["forward"]
        DetectionTask.transfer_batch_to_device = patched["transfer"]
        COCODetection.__getitem__ = patched["getitem"]
    return {"waits": {r: mode.waits[r] / steps for r in TASK_REGIONS},
            "calls": {r: mode.calls[r] / steps for r in TASK_REGIONS},
            "wait_ops": {k: v / steps for k, v in sorted(mode.wait_ops.items()) if not k.startswith("CPU tensors")}}


def markdown(results: dict[str, dict[str, Any]], size: tuple[int, int], train: bool = True) -> str:
    """The counts as a Markdown table: one row per contender, calls / waits per region."""
    head = "| contender | " + " | ".join(REGIONS) + " | total |"
    what = "training step" if train else "prediction (100 detections per image, masks pasted)"
    lines = [f"Mask R-CNN {what} (published heads, 80 classes), batch 2 at {size[0]}x{size[1]}, float32, "
             f"torch {torch.__version__}, torchvision {torchvision.__version__}. Each cell: ATen calls that launch a "
             "kernel / host waits.", "", head, "|" + "---|" * (len(REGIONS) + 2)]
    for name, r in results.items():
        cells = [f"{r['calls'][g]} / {r['waits'][g]}" for g in REGIONS]
        total = f"{sum(r['calls'].values())} / {sum(r['waits'].values())}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {total} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="320x480", help="HxW of both images")
    p.add_argument("--contenders", default="vtdense,vtdense torchvision-heads,torchvision")
    p.add_argument("--waits", action="store_true", help="also list the waits by op")
    p.add_argument("--predict", action="store_true", help="count a prediction instead of a training step")
    p.add_argument("--task", action="store_true", help="count DetectionTask's training steps under Lightning instead")
    p.add_argument("--cuda", action="store_true", help="on a GPU: count the synchronising CUDA calls of a bf16 step")
    args = p.parse_args(argv)
    if args.cuda:
        found = {}
        for c in ("vtdense", "vtdense torchvision-heads", "torchvision"):
            found[c] = count_cuda_syncs(c)
            print(f"{c}: {found[c]['syncs']} synchronising calls per bf16 training step at 800x1333, batch 2; "
                  + ", ".join(f"{k} x{v}" for k, v in list(found[c]["where"].items())[:12]))
        return found
    if args.task:
        r = count_task_steps()
        print("DetectionTask training step (tiny Mask R-CNN, Lightning, progress bar on), per step: waits / calls")
        print("| " + " | ".join(TASK_REGIONS) + " |\n|" + "---|" * len(TASK_REGIONS))
        print("| " + " | ".join(f"{r['waits'][g]:g} / {r['calls'][g]:g}" for g in TASK_REGIONS) + " |")
        print(", ".join(f"{k} x{v:g}" for k, v in r["wait_ops"].items()))
        return {"task": r}
    size = tuple(int(v) for v in args.size.split("x"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {c: count_step(c, size, train=not args.predict) for c in args.contenders.split(",")}  # type: ignore[arg-type]
    print(markdown(results, size, train=not args.predict))  # type: ignore[arg-type]
    if args.waits:
        for c, r in results.items():
            print(f"\n{c}: " + ", ".join(f"{k} x{v}" for k, v in r["wait_ops"].items()))
    return results


if __name__ == "__main__":
    main()
