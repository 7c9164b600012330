"""Register the backbones as segmentation-models-pytorch encoders when SMP is imported.

``import vtdense`` makes every backbone an SMP encoder ``vtdense-<name>``
(:mod:`vtdense.models.segmentation`). Importing SMP takes about a second (it imports timm and
torchvision's models), which a detection run or a backbone used on its own does not need. So
``import vtdense`` registers the encoders at once only where SMP is already imported; otherwise it
leaves a one-time finder on ``sys.meta_path`` that, once SMP's own module has run, registers them
(:func:`vtdense.models.segmentation.register_smp_encoders`). Either way SMP's encoder table holds
the ``vtdense-*`` names before any SMP model can be built.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Sequence

__all__ = ["register_when_smp_imported"]

SMP = "segmentation_models_pytorch"


def _register() -> None:
    module = sys.modules.get("vtdense.models.segmentation")
    if module is not None and not hasattr(module, "register_smp_encoders"):
        return  # SMP imported by that module's own first lines: it registers the encoders when it has run
    from vtdense.models.segmentation import register_smp_encoders

    register_smp_encoders()  # idempotent: the module also calls it once when it first runs


class _RegisteringLoader(importlib.abc.Loader):
    """SMP's own loader, which registers the encoders after SMP's module ran."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader  # SMP's module keeps its own loader from here on
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _register()

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: SMP's loader's own
        return getattr(self._loader, name)


class _SmpFinder(importlib.abc.MetaPathFinder):
    """Finds SMP as the other finders do, once, and hands it :class:`_RegisteringLoader`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != SMP:
            return None
        _remove_finder()
        spec = importlib.util.find_spec(fullname)  # the other finders' answer (an editable install's too)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _SmpFinder)]


def register_when_smp_imported() -> None:
    """Register the encoders now if SMP is imported, else as soon as it is (once)."""
    if SMP in sys.modules:
        _register()
    elif not any(isinstance(f, _SmpFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SmpFinder())
