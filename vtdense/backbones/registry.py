"""Name -> builder registry for backbones (plain dicts, like SMP's encoder tables)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

from torch import nn

__all__ = ["register_backbone", "register_config", "create_backbone", "list_backbones", "DEFAULT_WEIGHTS"]

_BACKBONES: dict[str, Callable[..., nn.Module]] = {}

#: What ``create_backbone(name, pretrained=True)`` loads: timm's default ImageNet weights (its
#: default tag) for the same network at the backbone's default window, on the Hugging Face Hub.
#: ``swinv2_large`` has none at window 8 (timm's are at window 12 and up): pass an id.
DEFAULT_WEIGHTS: dict[str, str] = {
    "swin_tiny": "timm/swin_tiny_patch4_window7_224.ms_in1k",
    "swin_small": "timm/swin_small_patch4_window7_224.ms_in22k_ft_in1k",
    "swin_base": "timm/swin_base_patch4_window7_224.ms_in22k_ft_in1k",
    "swin_large": "timm/swin_large_patch4_window7_224.ms_in22k_ft_in1k",
    "swinv2_tiny": "timm/swinv2_tiny_window8_256.ms_in1k",
    "swinv2_small": "timm/swinv2_small_window8_256.ms_in1k",
    "swinv2_base": "timm/swinv2_base_window8_256.ms_in1k",
    "mvitv2_tiny": "timm/mvitv2_tiny.fb_in1k",
    "mvitv2_small": "timm/mvitv2_small.fb_in1k",
    "mvitv2_base": "timm/mvitv2_base.fb_in1k",
    "mvitv2_large": "timm/mvitv2_large.fb_in1k",
}


def register_backbone(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering ``fn(**overrides) -> Backbone`` under ``name``."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _BACKBONES:
            raise ValueError(f"backbone {name!r} is already registered")
        _BACKBONES[name] = fn
        return fn

    return wrap


def register_config(
    name: str, cls: Callable[..., nn.Module], defaults: dict[str, Any], *, fixed: Iterable[str] = (), doc: str = ""
) -> None:
    """Register ``name`` as ``cls(**defaults)``; overrides are checked against ``cls``'s arguments.

    Args:
        fixed: arguments of ``cls`` that overrides may not change (e.g. Swin's ``version``).
    """
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", *fixed}

    def build(**overrides: Any) -> nn.Module:
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for backbone {name!r}; valid options: {', '.join(sorted(allowed))}")
        return cls(**{**defaults, **overrides})

    build.__doc__ = doc
    register_backbone(name)(build)


def list_backbones() -> list[str]:
    """Names accepted by :func:`create_backbone`, sorted."""
    return sorted(_BACKBONES)


def create_backbone(name: str, pretrained: Any = None, **overrides: Any) -> nn.Module:
    """Build a registered backbone, with random weights or from a checkpoint.

    Args:
        name: one of :func:`list_backbones`.
        pretrained: optional weights, anything :func:`vtdense.load_pretrained` takes: a Hugging
            Face Hub id (``"timm/swin_tiny_patch4_window7_224.ms_in1k"``), a local file of any
            supported format, or a state dict; ``True``: :data:`DEFAULT_WEIGHTS` (timm's default
            ImageNet weights for the network). The load's report is ``model.load_report``. A
            Swin V2 given no ``pretrained_window_size`` gets the checkpoint's where it is known
            and 0 would change what its position coordinates mean (see the report's notes).
        **overrides: config fields to change (``window_size``, ``drop_path_rate``, ``out_indices``, ...).

    Raises:
        ValueError: unknown name (the message lists the known ones) or unknown override, or
            ``pretrained=True`` for a backbone with no default weights.
        vtdense.CheckpointError: ``pretrained`` not found, unreadable, or not fitting the model.
    """
    if name not in _BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; known backbones: {', '.join(list_backbones())}")
    if pretrained is False:
        pretrained = None
    if pretrained is True:
        if name not in DEFAULT_WEIGHTS:
            raise ValueError(
                f"create_backbone({name!r}, pretrained=True): there are no default weights for {name!r}; pass a Hub id "
                "(e.g. 'timm/swinv2_large_window12_192.ms_in22k' with window_size=12), a local checkpoint path or a state dict"
            )
        pretrained = DEFAULT_WEIGHTS[name]
    if pretrained is not None:
        from vtdense.checkpoints.convert import build_pretrained  # lazy: checkpoints import the backbones

        return build_pretrained(name, pretrained, _BACKBONES[name], overrides)
    model = _BACKBONES[name](**overrides)
    model.config = {"name": name, **overrides}  # what save_backbone needs to rebuild it
    return model
