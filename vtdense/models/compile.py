"""``torch.compile`` of the backbone part of a dense model, for any input size.

A detector's heads (torchvision's RPN, RoI sampling, NMS) and a segmentor's loss run
data-dependent Python that compiles poorly; the backbone (with the detector's FPN) is where the
kernels are many and small. :func:`compile_backbone` compiles that part alone, in place
(``nn.Module.compile``, so parameter names and checkpoints are unchanged) and with
``dynamic=True``: vtdense fetches its size-dependent tables (window masks, index tables) through
custom ops that take the symbolic sizes, so the part is one graph with no break and multi-scale
training compiles once for every size instead of once per shape.

Images whose height and width are multiples of the backbone's deepest stride (32; detectors and
segmentors pad their batches to it) go to a second graph traced on the image cut into ``32 x 32``
cells: its symbolic sizes are the cell counts ``h, w``, so every stage map is exactly ``8h x 8w``,
``4h x 4w``, ... where the any-size graph carries nested floor divisions
(``((H - 1) // 4 - 1) // 2 + 1``). Shorter size arithmetic is shorter to trace, to prove guards on
and to generate code for. Other sizes run the any-size graph, so a run compiles at most the two.

Both graphs trace the batch size as an unbacked size (:func:`_any_batch`): one graph serves every
batch, 1 included, where Dynamo would otherwise give a batch of 1 a graph of its own and the traced
convs guard on the batch (the convs of the compiled part run as one opaque op each,
:mod:`vtdense.layers.opaque_conv`).

Both graphs trace with Python floats constant (see :func:`_traced_with`), and so take each backbone
block as a nested compile region where no gradient is recorded: the matching blocks of a stage are
compiled once (:func:`vtdense.backbones.base.set_compile_regions`). Training graphs inline every block.

On a GPU this fuses the many elementwise kernels (casts, adds, norms) of each block, which is
what a host-bound bf16 detector step spends its time launching. On a CPU the backbone is
matmul-bound and compiling gains little.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import operator
from typing import Any, Callable

import torch
from torch import nn

from vtdense.layers.drop import DropPath
from vtdense.layers.opaque_conv import OpaqueConv2d

__all__ = ["check_compile_option", "compile_backbone", "backbone_module", "is_compiled"]


def _backends(everything: bool = True) -> list[str]:
    """Registered ``torch.compile`` backends; ``everything=False``: those torch lists by default
    (no debugging or testing backends) plus the two that capture without code generation."""
    import torch._dynamo

    if everything:
        return sorted(torch._dynamo.list_backends(exclude_tags=()))
    return sorted({*torch._dynamo.list_backends(), "aot_eager", "eager"})


def check_compile_option(value: Any, option: str = "compile_backbone") -> str | None:
    """The ``torch.compile`` backend ``value`` asks for: ``None`` / ``False`` -> ``None`` (eager),
    ``True`` -> ``"inductor"``, a string -> that backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...).

    Raises:
        ValueError: ``value`` is neither a bool nor a registered backend name (the message names
            ``option`` and lists the backends).
    """
    if value is None or value is False:
        return None
    if value is True:
        return "inductor"
    if isinstance(value, str):
        name = value.strip()
        if name.lower() in ("false", "none", "off", ""):
            return None
        if name.lower() in ("true", "on"):
            return "inductor"
        if name in _backends():
            return name
        raise ValueError(
            f"{option}={value!r} is not a torch.compile backend; use true (inductor), false, or a backend "
            f"such as {', '.join(_backends(everything=False))}"
        )
    raise ValueError(f"{option} must be a bool or a torch.compile backend name, got {type(value).__name__} {value!r}")


def backbone_module(model: nn.Module) -> nn.Module:
    """The part of a dense model that :func:`compile_backbone` compiles.

    - a torchvision detector from :func:`vtdense.models.detection.build_detector`: ``model.backbone``
      (the vtdense backbone and its FPN);
    - an SMP model from :func:`vtdense.models.segmentation.build_segmentor`: ``model.encoder``;
    - a bare vtdense backbone: the model itself.
    """
    for name in ("backbone", "encoder"):
        part = getattr(model, name, None)
        if isinstance(part, nn.Module):
            return part
    if hasattr(model, "out_strides"):
        return model
    raise ValueError(f"{type(model).__name__} has no 'backbone' or 'encoder' module to compile")


def compile_backbone(model: nn.Module, backend: str | bool | None = "inductor", *, size_divisible: int | None = None,
                     **kwargs: Any) -> nn.Module:
    """Compile the backbone part of ``model`` (see :func:`backbone_module`) in place, for all sizes.

    Args:
        model: a detector, a segmentor or a backbone; its ``state_dict`` keys do not change.
        backend: a ``torch.compile`` backend, or a value of :func:`check_compile_option`
            (``True``: inductor; ``None`` / ``False``: leave eager).
        size_divisible: a ``(B, C, H, W)`` input with ``H`` and ``W`` multiples of this runs a graph
            traced with its size in these units (module docstring); other inputs run the any-size
            graph. ``None``: the backbone's deepest stride (32), ``1``: one graph for every size.
            Ignored with ``dynamic=False``.
        **kwargs: more ``torch.compile`` options (``mode``, ``fullgraph``, ...); ``dynamic``
            defaults to ``True``.

    Returns:
        The compiled module (the same object, now running compiled). Its inputs are ``(B, 3, H, W)``
        images of any size its backbone accepts; outputs are the backbone's (FPN's) maps.

    Example:
        >>> import vtdense
        >>> from vtdense.models.detection import build_detector
        >>> det = build_detector("swin_tiny", "faster_rcnn", 3, backbone_kwargs=dict(embed_dim=16, depths=[1, 1, 1, 1],
        ...                      num_heads=[1, 1, 1, 1]), fpn_channels=16, slim_heads=True)
        >>> part = compile_backbone(det, "eager")
        >>> part is det.backbone
        True
    """
    name = check_compile_option(backend, "backend")
    part = backbone_module(model)
    unit = _size_unit(part, size_divisible)
    if name is None:
        return part
    if name == "eager" and _random_in_checkpointed_blocks(part):
        raise ValueError(
            "backend 'eager' cannot compile a backbone that recomputes random blocks (grad_checkpointing with "
            "drop_path_rate or dropout > 0): torch's eager backend redraws their randomness in the backward "
            "recompute, so gradients would be wrong; use 'aot_eager' or 'inductor' (both measured equal to eager), "
            "or turn grad_checkpointing off"
        )
    kwargs.setdefault("dynamic", True)
    if name == "inductor" and kwargs["dynamic"] is not False:
        kwargs = _without_size_thresholds(kwargs)
        _install_size_free_cpu_sums()
    part.compile(backend=name, **kwargs)
    config = dict(specialize_float=True)
    if name == "eager":
        config["optimize_ddp"] = False
    any_size = _traced_with(part._compiled_call_impl, **config)
    any_batch = kwargs["dynamic"] is not False and _batch_free(part)
    if any_batch:
        any_size = _any_batch(any_size)
    if unit > 1 and kwargs["dynamic"] is not False:
        in_cells = _traced_with(torch.compile(_cells_forward(part), backend=name, **kwargs), **config)
        part._compiled_call_impl = _by_size(any_size, in_cells, unit, any_batch)
    else:
        part._compiled_call_impl = any_size
    part._vtdense_compiled = name  # what is_compiled reports
    return part


#: Inductor settings whose size thresholds would add guards to a dynamic graph: its GPU code generator
#: fuses a LayerNorm backward's two reductions (rows and columns, "mix-order reduction") only above
#: 5 Mi elements and 4096 rows, and each such check guards the graph on the size; a size across the
#: threshold then compiles the whole training step again (seen on an H200: Swin-T at batch 2,
#: 512x768 then 640x800, 159 and 162 s). Without those checks it fuses at every size.
_SIZE_FREE_INDUCTOR = {"triton.mix_order_reduction_non_strict_mode": True}


def _without_size_thresholds(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keyword arguments with :data:`_SIZE_FREE_INDUCTOR` added to Inductor's
    ``options`` (where this torch has them; a ``mode`` is folded into the options, as torch.compile
    takes one or the other). Settings the caller gave win."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()  # (the dotted names torch.compile's options take)
    ours = {k: v for k, v in _SIZE_FREE_INDUCTOR.items() if k in known}
    mode = kwargs.get("mode")
    if not ours or (mode is not None and (kwargs.get("options") or mode not in torch._inductor.list_mode_options())):
        return kwargs  # (both, or a mode torch does not know: torch.compile's own error says so)
    kwargs = dict(kwargs)
    kwargs.pop("mode", None)
    kwargs["options"] = {**ours, **torch._inductor.list_mode_options(mode or "default", kwargs["dynamic"]),
                         **(kwargs.get("options") or {})}
    return kwargs


#: Set while one of :func:`compile_backbone`'s graphs is traced and compiled (the backward too: with
#: symbolic sizes AOT autograd compiles it in the forward's first call).
_IN_BACKBONE_COMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar("vtdense_backbone_compile", default=False)


def _install_size_free_cpu_sums() -> bool:
    """Make Inductor's C++ code generator keep a float ``sum`` over a symbolic length free of a size
    guard, in :func:`compile_backbone`'s graphs only. Returns whether it is in place.

    The generator sums more than 4096 floats with a chunked (cascade) accumulator and fewer with a
    plain one, and asks ``length > 4096`` of the graph's sizes to choose: a guard, so a size on the
    other side of 4096 rows compiles the whole graph again (Swin-T's training step at batch 2 on
    the CPU: 512x768, then 640x800). Inside these graphs a symbolic length always gets the chunked
    accumulator, the code every length over 4096 runs anyway; it sums any length, and a short one
    as exactly as the plain form. Constant lengths, other reductions and every other compile keep
    torch's choice. A torch without this method is left as it is.
    """
    try:
        from torch._inductor.codegen.cpp import CppKernel
    except ImportError:  # pragma: no cover - a torch without Inductor's C++ backend
        return False
    original = getattr(CppKernel, "need_use_acc_helper", None)
    if original is None:
        return False
    if getattr(original, "_vtdense_size_free", False):
        return True

    @functools.wraps(original)
    def need_use_acc_helper(self: Any, reduction_type: str, dtype: torch.dtype, use_scalar: bool) -> bool:
        ranges, depth = getattr(self, "call_ranges", None), getattr(self, "reduction_depth", None)
        if (_IN_BACKBONE_COMPILE.get() and reduction_type == "sum" and dtype == torch.float
                and ranges is not None and depth is not None):
            length = functools.reduce(operator.mul, ranges[depth:], 1)
            if getattr(length, "free_symbols", None):
                return True
        return original(self, reduction_type, dtype, use_scalar)

    need_use_acc_helper._vtdense_size_free = True  # type: ignore[attr-defined]
    CppKernel.need_use_acc_helper = need_use_acc_helper
    return True


def _size_unit(part: nn.Module, size_divisible: int | None) -> int:
    """``size_divisible``, checked; ``None``: the deepest ``out_strides`` of a backbone in ``part`` (1 if none)."""
    if size_divisible is None:
        strides = [int(s) for m in part.modules() for s in getattr(m, "out_strides", ())]
        return max(strides, default=1)
    if isinstance(size_divisible, bool) or not isinstance(size_divisible, int) or size_divisible < 1:
        raise ValueError(f"size_divisible must be a positive int (1: one graph for every size), got {size_divisible!r}")
    return size_divisible


def _cells_forward(part: nn.Module) -> Callable[[torch.Tensor], Any]:
    """``part``'s forward on an image given as ``(B, C, h, unit, w, unit)`` cells."""

    def forward(cells: torch.Tensor) -> Any:
        return part._call_impl(cells.flatten(4, 5).flatten(2, 3))

    return forward


def _by_size(any_size: Callable[..., Any], in_cells: Callable[[torch.Tensor], Any], unit: int,
             any_batch: bool = False) -> Callable[..., Any]:
    """Send a ``(B, C, H, W)`` tensor whose ``H`` and ``W`` are multiples of ``unit`` to ``in_cells``
    as ``(B, C, H / unit, unit, W / unit, unit)``, and every other call to ``any_size``.

    The cells are a copy, not a view: Dynamo traces a view input together with its base, whose
    sizes become symbols of their own, and the graph then has to relate ``H`` to ``h`` again (one
    copy of the input, small beside the backbone's own traffic). The two ``unit`` dimensions are marked
    static so that ``dynamic=True`` keeps them literal; with ``any_batch``, the batch is traced
    unbacked (:func:`_any_batch`)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if (isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[2] % unit == 0 and x.shape[3] % unit == 0
                and not torch.compiler.is_compiling()):
            cells = x.unflatten(3, (x.shape[3] // unit, unit)).unflatten(2, (x.shape[2] // unit, unit)).clone()
            torch._dynamo.mark_static(cells, 3)
            torch._dynamo.mark_static(cells, 5)
            if any_batch:
                _mark_batch_unbacked(cells)
            return in_cells(cells)
        return any_size(*args, **kwargs)

    return call


def _any_batch(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, called on a ``(B, C, H, W)`` tensor with its batch size ``B`` traced as an
    unbacked symbol, so that one graph serves every batch size, 1 included.

    With ``dynamic=True`` Dynamo still gives a size of 0 or 1 a graph of its own, and a traced
    ``F.conv2d`` guards on the batch while it picks a conv backend (``2 <= B <= 15`` on the CPU). A
    graph traced at a batch of 2 (training) then compiled again for a batch of 1 (prediction on
    single images) and for 16 or more: minutes each with Inductor. An unbacked batch has no value
    to guard on, so neither happens (the compiled part's convs are
    :class:`~vtdense.layers.opaque_conv.OpaqueConv2d`, whose fake kernel needs no value either). The
    call's batch is still Inductor's size hint (``hint_override``, which makes no new graph). The
    mark is put on the caller's tensor for the call and taken off again (Dynamo keeps it in the
    tensor's ``__dict__``), so the tensor reaches no other compiled code marked."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        before = {k: v.copy() if isinstance(v, (dict, set)) else v for k, v in x.__dict__.items()}
        _mark_batch_unbacked(x)
        try:
            return compiled(x)
        finally:
            for key in set(x.__dict__) - set(before):
                delattr(x, key)
            for key, value in before.items():
                setattr(x, key, value)

    return call


def _mark_batch_unbacked(x: torch.Tensor) -> None:
    """Mark ``x``'s dim 0 unbacked for Dynamo, with its size as Inductor's hint where this torch takes one."""
    mark = torch._dynamo.decorators.mark_unbacked
    if _takes_hint():
        mark(x, 0, hint_override=x.shape[0])
    else:  # pragma: no cover - torch without hint_override
        mark(x, 0)


@functools.lru_cache(maxsize=1)
def _takes_hint() -> bool:
    return "hint_override" in inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters


def _batch_free(part: nn.Module) -> bool:
    """Whether ``part`` may trace its batch unbacked (:func:`_any_batch`): no conv or batch norm in it
    but :class:`~vtdense.layers.opaque_conv.OpaqueConv2d`, which runs as an opaque op in compiled graphs
    (the patch embeddings, the FPN, MViTv2's pooling convs). A traced ``F.conv2d``
    on an unbacked batch states a memory format that the real conv may not return (Inductor then
    stops at its layout check), and a batch norm checks the batch's size, so a part with other convs
    (a backbone of a user's own, a replaced layer) keeps a batch of 1 as a graph of its own."""
    for m in part.modules():
        if isinstance(m, (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)) and not isinstance(m, OpaqueConv2d):
            return False
    return True


def _random_in_checkpointed_blocks(part: nn.Module) -> bool:
    """Whether ``part`` recomputes blocks in the backward (``grad_checkpointing``) that draw random
    numbers (drop path or dropout with ``p > 0``). FSDP2-sharded blocks are not counted: the
    2-process FSDP test (activation checkpointing, drop path, ``eager`` backend) trains to eager
    DDP's weights, while an unsharded backbone measured wrong gradients."""
    modules = list(part.modules())
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support: nothing can be sharded
        FSDPModule = ()  # noqa: N806
    if any(isinstance(m, FSDPModule) for m in modules):
        return False
    checkpointed = any(getattr(m, "grad_checkpointing", False) is True for m in modules)
    return checkpointed and any(isinstance(m, (DropPath, nn.Dropout)) and m.p > 0 for m in modules)


def _traced_with(compiled: Callable[..., Any], **config: Any) -> Callable[..., Any]:
    """``compiled``, traced under Dynamo's ``config`` (scoped to this module's calls; 20-40 us a call on the CPU).

    - ``specialize_float=True``: with ``dynamic=True`` Dynamo makes every Python float it reads a
      graph input (a LayerNorm's ``eps``, an attention scale). The ops that take such a float as a
      number (``layer_norm``'s ``eps``) specialise it while the graph is lowered, and torch then
      restarts the whole trace with those floats constant: every first compile traced the backbone
      twice (``benchmarks/RESULTS.md``, "Compile: floats"). They are constants of the model, so they
      are traced as constants from the start.
    - ``optimize_ddp=False`` (the ``eager`` backend only): under DDP, Dynamo splits a graph at the
      gradient-bucket boundaries so that a compiled backward can all-reduce bucket by bucket. With
      the ``eager`` backend the backward is plain autograd, whose per-parameter hooks already let
      DDP overlap its all-reduce, so the split buys nothing; and its shape propagation, which runs
      the pieces on fake tensors without the Python dispatcher, fails on ``F.interpolate`` with
      symbolic sizes (the FPN's top-down path): "SymIntArrayRef expected to contain only concrete
      integers".

    Both graphs are also traced without duck shaping (``use_duck_shape=False``): Dynamo otherwise
    gives sizes of equal value one symbol and guards on the equality. A square first image then
    made a graph for square images only, and the next image compiled again; in the cells graph,
    whose cell counts are small numbers that often equal the batch or the 3 channels, the backbone's
    channel check fixed a width of 3 cells at 3.
    """
    from torch.fx.experimental import _config as shape_config

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        # (under an outer torch.compile, which traces this call, the flag is left alone)
        token = None if torch.compiler.is_compiling() else _IN_BACKBONE_COMPILE.set(True)
        try:
            with torch._dynamo.config.patch(**config), shape_config.patch(use_duck_shape=False):
                return compiled(*args, **kwargs)
        finally:
            if token is not None:
                _IN_BACKBONE_COMPILE.reset(token)

    return call


def is_compiled(module: nn.Module) -> str | None:
    """The backend :func:`compile_backbone` compiled ``module``'s backbone part with, or ``None``."""
    try:
        part = backbone_module(module)
    except ValueError:
        return None
    if getattr(part, "_compiled_call_impl", None) is None:  # never compiled, or compiled then reset
        return None
    return getattr(part, "_vtdense_compiled", None)
