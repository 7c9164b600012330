"""vtdense: hierarchical vision transformers (Swin V1/V2, MViTv2) for dense prediction."""

from vtdense.backbones import Backbone, create_backbone, list_backbones, register_backbone
from vtdense.checkpoints.convert import CheckpointError, LoadReport, load_backbone, load_pretrained, save_backbone

__version__ = "0.1.0.dev0"

# Every backbone becomes a segmentation-models-pytorch encoder "vtdense-<name>": now if SMP is
# imported, else when it is (vtdense._smp_hook), so that code without SMP does not import it.
from vtdense._smp_hook import register_when_smp_imported  # noqa: E402

register_when_smp_imported()

__all__ = [
    "Backbone",
    "export",
    "CheckpointError",
    "LoadReport",
    "__version__",
    "create_backbone",
    "list_backbones",
    "load_backbone",
    "load_pretrained",
    "register_backbone",
    "save_backbone",
]


def __getattr__(name: str):  # PEP 562: keep ``import vtdense`` light
    if name == "export":
        import importlib

        # the module is callable: ``vtdense.export(model, "model.onnx")`` calls vtdense.export.export
        return importlib.import_module("vtdense.export")
    raise AttributeError(f"module 'vtdense' has no attribute {name!r}")
