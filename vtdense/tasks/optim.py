"""Optimiser parameter groups and learning-rate schedules shared by the tasks."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from vtdense.options import check_int, check_number

__all__ = [
    "NO_DECAY_KEYWORDS",
    "NO_DECAY_RULES",
    "OPTIMIZERS",
    "StepLambdaLR",
    "adamw",
    "apply_layer_decay",
    "check_no_decay",
    "check_optimizer",
    "check_schedule_numbers",
    "fused_adamw_blocker",
    "layer_ids",
    "make_optimizer",
    "param_groups",
    "sgd",
    "warmup_schedule",
]

#: Parameter-name fragments that never get weight decay (position tables, logit scales, ...).
NO_DECAY_KEYWORDS: tuple[str, ...] = (
    "relative_position_bias_table",
    "cpb_mlp",
    "logit_scale",
    "rel_pos_h",
    "rel_pos_w",
    "pos_embed",
    "absolute_pos_embed",
)


#: Which parameters get no weight decay, besides :data:`NO_DECAY_KEYWORDS`:
#:
#: - ``"names"``: those named as a norm's (``norm`` in the name: ``norm1``, ``attn.norm_q``,
#:   ``out_norms.*``, ``patch_embed.norm``). Biases and other 1-D tensors decay. The rule of the
#:   detection and segmentation references: mmdet / mmseg's Swin configs (``paramwise_cfg``
#:   ``custom_keys``: ``absolute_pos_embed``, ``relative_position_bias_table``, ``norm``; biases
#:   at the full decay) and detectron2's MViTv2 (``weight_decay_norm=0``, position tables 0);
#: - ``"1d"``: every 1-D tensor and every bias, the classification recipes' rule (timm, the
#:   official Swin / Swin V2 code);
#: - ``"none"``: every parameter decays, :data:`NO_DECAY_KEYWORDS` included: an optimizer
#:   config without ``paramwise_cfg``, as mmdetection's SGD recipes (RetinaNet, the ResNet
#:   detectors) have it.
NO_DECAY_RULES: tuple[str, ...] = ("names", "1d", "none")


def _no_decay(name: str, param: torch.Tensor, extra: Iterable[str], rule: str = "1d") -> bool:
    if rule == "none":
        return any(k in name for k in extra)
    if rule == "1d" and (param.ndim <= 1 or name.endswith(".bias")):  # norms' weights / biases, all biases
        return True
    if rule == "names" and "norm" in name:
        return True
    return any(k in name for k in (*NO_DECAY_KEYWORDS, *extra))


def check_no_decay(rule: str) -> str:
    """``rule`` if it is one of :data:`NO_DECAY_RULES`, else one ``ValueError`` naming the option."""
    if rule not in NO_DECAY_RULES:
        raise ValueError(f"unknown no_decay {rule!r} (option 'no_decay'); choose one of {', '.join(NO_DECAY_RULES)}")
    return rule


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay_keywords: Sequence[str] = (),
    backbone_prefix: str | None = None,
    backbone_lr_mult: float = 1.0,
    rule: str = "1d",
) -> list[dict]:
    """Split trainable parameters into decay / no-decay groups (optionally a backbone lr multiplier).

    ``no_decay_keywords`` get no weight decay; nor, unless ``rule="none"``, do position tables
    and logit scales; nor do norms (``rule="names"``) or every 1-D tensor and bias
    (``rule="1d"``); see :data:`NO_DECAY_RULES`.
    Each group carries ``lr_mult`` so schedules can scale it.
    """
    check_no_decay(rule)
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    names: dict[tuple[bool, bool], list[str]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (_no_decay(name, p, no_decay_keywords, rule), bool(backbone_prefix and name.startswith(backbone_prefix)))
        groups.setdefault(key, []).append(p)
        names.setdefault(key, []).append(name)
    out = []
    for (nd, bb), params in sorted(groups.items()):
        out.append(
            {
                "params": params,
                "weight_decay": 0.0 if nd else weight_decay,
                "lr_mult": backbone_lr_mult if bb else 1.0,
                "param_names": names[(nd, bb)],
            }
        )
    return out


class StepLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` over the optimizer's groups when it was made; a group added later keeps the rate
    it is given. Lightning's ``BackboneFinetuning`` adds the unfrozen backbone's group and sets its
    rate itself at every epoch; on torch 2.14 a plain ``LambdaLR`` stops at the next step there
    ("zip() argument 2 is shorter than argument 1")."""

    def get_lr(self) -> list[float]:
        scheduled = list(super().get_lr())
        return scheduled + [g["lr"] for g in self.optimizer.param_groups[len(scheduled):]]


def warmup_schedule(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_factor: float = 1e-3,
    kind: str = "step",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    power: float = 1.0,
    min_factor: float = 0.0,
) -> float:
    """Learning-rate multiplier at ``step`` (0-based): linear warmup then step, cosine or poly.

    Args:
        kind: ``"step"`` (multiply by ``gamma`` at each of ``milestones``), ``"cosine"`` or ``"poly"``
            (``(1 - t) ** power``), ``"constant"``.
    """
    if kind == "step":
        factor = gamma ** sum(step >= m for m in milestones)
    elif kind == "cosine":
        t = min(step / max(total_steps, 1), 1.0)
        factor = min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * t))
    elif kind == "poly":
        t = min(step / max(total_steps, 1), 1.0)
        factor = min_factor + (1 - min_factor) * (1 - t) ** power
    elif kind == "constant":
        factor = 1.0
    else:
        raise ValueError(f"unknown lr schedule {kind!r}; choose one of step, cosine, poly, constant")
    if warmup_steps > 0 and step < warmup_steps:
        alpha = step / warmup_steps
        factor *= warmup_factor * (1 - alpha) + alpha
    return factor


def layer_ids(backbone: nn.Module) -> tuple[dict[str, int], int]:
    """Layer index of each backbone parameter for layer-wise lr decay.

    Transformer blocks (modules whose class name ends in ``Block``) are numbered 1..N in
    definition order; parameters before the first block (patch embedding, position tables)
    get 0, parameters between blocks (patch merging) take the next block's index, and
    parameters after the last block (output norms) get N + 1, like the head.

    Returns:
        ``({param_name: layer_id}, N + 1)`` with names relative to ``backbone``.
    """
    blocks: list[str] = []
    for name, module in backbone.named_modules():
        if name and type(module).__name__.endswith("Block") and not any(name.startswith(b + ".") for b in blocks):
            blocks.append(name)
    n = len(blocks)
    ids: dict[str, int] = {}
    pending: list[str] = []
    seen_block = 0
    for pname, _ in backbone.named_parameters():
        owner = next((i for i, b in enumerate(blocks) if pname.startswith(b + ".")), None)
        if owner is None:
            if seen_block == 0:
                ids[pname] = 0
            else:
                pending.append(pname)
            continue
        for p in pending:
            ids[p] = owner + 1
        pending = []
        ids[pname] = owner + 1
        seen_block = owner + 1
    for p in pending:
        ids[p] = n + 1
    return ids, n + 1


def apply_layer_decay(groups: list[dict], backbone: nn.Module, prefix: str, decay: float) -> list[dict]:
    """Split :func:`param_groups` output by backbone layer and scale each part's ``lr_mult``.

    Parameters named ``prefix + <backbone parameter>`` take their layer from :func:`layer_ids`;
    every other parameter (neck, heads) counts as the top layer. Layer ``i`` of top ``N`` gets
    ``lr_mult * decay ** (N - i)``, as in the Swin V2 / MViTv2 / BEiT fine-tuning recipes. (The
    references differ on one point: Swin V2's official fine-tuning gives a patch merging the index
    of the block before it; vtdense, like timm's grouping, the block after it.)

    Args:
        groups: groups with ``params``, ``param_names`` and ``lr_mult`` (see :func:`param_groups`).
        backbone: the backbone module whose parameters appear under ``prefix``.
        prefix: name prefix of the backbone parameters in ``groups`` (e.g. ``"backbone.body."``).
        decay: factor in ``(0, 1]``.
    """
    ids, top = layer_ids(backbone)
    out: list[dict] = []
    for g in groups:
        split: dict[int, dict] = {}
        for p, name in zip(g["params"], g["param_names"]):
            lid = ids.get(name[len(prefix):], top) if name.startswith(prefix) else top
            sub = split.setdefault(
                lid, {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [], "param_names": []}
            )
            sub["params"].append(p)
            sub["param_names"].append(name)
        for lid, sub in sorted(split.items()):
            sub["lr_mult"] = g.get("lr_mult", 1.0) * decay ** (top - lid)
            out.append(sub)
    return out


#: Devices whose parameters torch's fused AdamW kernel is used for (one kernel per chunk of tensors).
FUSED_ADAMW_DEVICES: tuple[str, ...] = ("cpu", "cuda")


def _is_dtensor(p: torch.Tensor) -> bool:
    # FSDP2 (fully_shard) shards parameters as DTensors, which the fused kernel steps shard by shard.
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(p, DTensor)


def fused_adamw_blocker(params: Iterable[torch.Tensor], trainer: Any = None, *, auto: bool = True) -> str | None:
    """Why torch's fused AdamW cannot (or, when ``auto``, should not) step ``params`` under
    ``trainer``; ``None`` when it can.

    - every parameter must be a floating-point tensor on one device in :data:`FUSED_ADAMW_DEVICES`:
      a plain tensor, or a DTensor shard of FSDP2 (no other tensor subclasses);
    - Lightning refuses gradient clipping with a fused optimizer under its ``MixedPrecision``
      plugin (``bf16-mixed``, ``16-mixed``);
    - with ``auto``, fp16 loss scaling also keeps the default optimizer: a fused step unscales the
      gradients itself, so callbacks before the step would see scaled gradients.
    """
    devices = set()
    for p in params:
        if type(p) not in (torch.Tensor, nn.Parameter) and not _is_dtensor(p):
            return f"parameters of type {type(p).__name__} (a tensor subclass)"
        if not p.is_floating_point():
            return f"a parameter of dtype {p.dtype}"
        devices.add(p.device)
    if len(devices) > 1:
        return f"parameters on several devices ({', '.join(sorted(map(str, devices)))})"
    if devices and next(iter(devices)).type not in FUSED_ADAMW_DEVICES:
        return f"parameters on {next(iter(devices))} (fused AdamW is used on {', '.join(FUSED_ADAMW_DEVICES)})"
    if trainer is None:
        return None
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = getattr(trainer, "precision_plugin", None)
    if isinstance(plugin, MixedPrecision) and trainer.gradient_clip_val:
        return (
            f"gradient clipping (trainer.gradient_clip_val={trainer.gradient_clip_val}) under "
            f"precision={plugin.precision!r}: Lightning does not clip with a fused optimizer"
        )
    if auto and getattr(plugin, "scaler", None) is not None:
        return "fp16 loss scaling"
    return None


def _fused(params: list[torch.Tensor], fused: bool | None, trainer: Any) -> bool:
    """Whether to step ``params`` with torch's fused kernel (see :func:`adamw`'s ``fused``)."""
    reason = fused_adamw_blocker(params, trainer, auto=fused is None)
    if fused and reason is not None:
        raise ValueError(f"fused_optimizer=True cannot be used with {reason}; set fused_optimizer to null (auto) or false")
    if fused is None:
        return reason is None and bool(params)
    return bool(fused)


def adamw(groups: list[dict], *, fused: bool | None = None, trainer: Any = None, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``groups``, with torch's fused kernel where it applies.

    The fused step updates every parameter in a few kernels instead of several per parameter:
    3.1-3.4x faster than the default for the published Swin-T Mask R-CNN's 219 tensors on the CPU
    (``benchmarks/optimizer_step.py``), and it spares a GPU step hundreds of kernel launches.
    Its results equal the default's to float rounding.

    Args:
        groups: parameter groups (dicts with ``params``; other keys as ``torch.optim.AdamW`` takes).
        fused: ``None`` (auto): fused when :func:`fused_adamw_blocker` finds nothing against it;
            ``True``: fused, or a ``ValueError`` naming the reason it cannot be; ``False``: torch's
            default implementation (``foreach`` on GPUs, a loop over tensors on the CPU).
        trainer: the Lightning trainer the optimiser steps under (precision plugin, clipping).
        kwargs: ``lr``, ``betas``, ``weight_decay``, ... for ``torch.optim.AdamW``.
    """
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(groups, fused=_fused(params, fused, trainer), **kwargs)


def sgd(groups: list[dict], *, fused: bool | None = None, trainer: Any = None, **kwargs: Any) -> torch.optim.SGD:
    """``torch.optim.SGD`` over ``groups``, with torch's fused kernel where it applies (as :func:`adamw`).

    Args:
        groups: parameter groups (dicts with ``params``; other keys as ``torch.optim.SGD`` takes).
        fused: as :func:`adamw`'s.
        trainer: the Lightning trainer the optimiser steps under (precision plugin, clipping).
        kwargs: ``lr``, ``momentum``, ``weight_decay``, ... for ``torch.optim.SGD``.
    """
    params = [p for g in groups for p in g["params"]]
    return torch.optim.SGD(groups, fused=_fused(params, fused, trainer), **kwargs)


#: The tasks' optimizers: ``"adamw"`` (the Swin, Swin V2 and MViTv2 recipes) or ``"sgd"`` with
#: momentum (mmdetection's RetinaNet and ResNet detector recipes).
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")


def check_optimizer(name: str, momentum: float = 0.9) -> str:
    """``name`` if it is one of :data:`OPTIMIZERS` and ``momentum`` is in [0, 1), else one ``ValueError`` naming the option."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (option 'optimizer'); choose one of {', '.join(OPTIMIZERS)}")
    if not 0.0 <= float(momentum) < 1.0:
        raise ValueError(f"momentum must be in [0, 1) (option 'momentum'), got {momentum}")
    return name


#: Option -> keyword arguments of :func:`vtdense.options.check_number` for :func:`check_schedule_numbers`.
_NUMBER_RANGES: dict[str, dict[str, Any]] = {
    "lr": dict(low=0.0, low_open=True),
    "weight_decay": dict(low=0.0),
    "backbone_lr_mult": dict(low=0.0),
    "warmup_factor": dict(low=0.0, high=1.0),
    "lr_gamma": dict(low=0.0, low_open=True),
    "poly_power": dict(low=0.0),
    "min_lr_factor": dict(low=0.0, high=1.0),
}


def check_schedule_numbers(*, warmup_steps: int | None = None, betas: Sequence[float] | None = None,
                           **numbers: float | None) -> None:
    """One ``ValueError`` naming the option and the value when an optimiser or schedule number is
    out of range, before the run starts (torch's optimisers refuse some only when built, after the
    trainer has started; others, such as a negative weight decay, would train wrongly): ``lr`` and
    ``lr_gamma`` finite and > 0; ``weight_decay``, ``backbone_lr_mult``, ``poly_power`` finite and
    >= 0; ``warmup_factor`` and ``min_lr_factor`` in [0, 1]; ``warmup_steps`` a whole number >= 0;
    ``betas`` two numbers in [0, 1). ``None`` values are not checked."""
    for name, value in numbers.items():
        if value is not None:
            check_number(name, value, **_NUMBER_RANGES[name])
    if warmup_steps is not None:
        check_int("warmup_steps", warmup_steps, low=0)
    if betas is not None:
        pair = list(betas) if isinstance(betas, (list, tuple)) else None
        if pair is None or len(pair) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                                     and 0.0 <= b < 1.0 for b in pair):
            raise ValueError(f"betas must be two numbers in [0, 1) (option 'betas'), got {betas!r}")


def make_optimizer(
    name: str,
    groups: list[dict],
    *,
    lr: float,
    weight_decay: float,
    momentum: float = 0.9,
    betas: Sequence[float] = (0.9, 0.999),
    fused: bool | None = None,
    trainer: Any = None,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (:data:`OPTIMIZERS`) over ``groups``: :func:`adamw` with ``betas``, or
    :func:`sgd` with ``momentum`` (no dampening, no Nesterov: mmdetection's and detectron2's SGD)."""
    check_optimizer(name, momentum)
    if name == "sgd":
        return sgd(groups, fused=fused, trainer=trainer, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return adamw(groups, fused=fused, trainer=trainer, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
