"""Backbones: the contract, the registry and the registered families."""

from vtdense.backbones.base import Backbone
from vtdense.backbones.registry import create_backbone, list_backbones, register_backbone
from vtdense.backbones import swin  # noqa: F401  (registers swin_* / swinv2_*)
from vtdense.backbones import mvitv2  # noqa: F401  (registers mvitv2_*)
from vtdense.backbones.swin import SwinTransformer

__all__ = ["Backbone", "SwinTransformer", "create_backbone", "list_backbones", "register_backbone"]
