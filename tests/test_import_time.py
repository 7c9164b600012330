"""``import vtdense`` stays light: no Dynamo, sympy, segmentation-models-pytorch or timm (about 2.5 s of
imports on the 2-core CPU, more than torch itself), while every backbone is still an SMP encoder by the
time SMP is imported, in either order. Not timed: what is imported is checked, in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vtdense._smp_hook import register_when_smp_imported
from vtdense.layers import triton_window_attention

HEAVY = ["torch._dynamo", "sympy", "segmentation_models_pytorch", "timm"]


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["vtdense", "vtdense.models.segmentation"])
def test_import_vtdense_leaves_heavy_modules_out_and_smp_still_finds_the_encoders(first: str) -> None:
    """``first`` imported first: ``vtdense`` itself imports none of the heavy modules; the segmentation
    module imports SMP from its own first lines, while it is only partly run."""
    out = _run(f"""
import json, sys
import {first}
import vtdense
heavy = [m for m in {HEAVY!r} if m in sys.modules]
import segmentation_models_pytorch as smp
from segmentation_models_pytorch.encoders import encoders
model = smp.FPN(encoder_name="vtdense-swin_tiny", encoder_weights=None, classes=3, encoder_depth=5)
finders = [type(f).__name__ for f in sys.meta_path]
print(json.dumps(dict(heavy=heavy, registered=sorted(k for k in encoders if k.startswith("vtdense-")),
                      encoder=type(model.encoder).__name__, loader=type(smp.__spec__.loader).__name__,
                      finders=finders, backbones=sorted(vtdense.list_backbones()))))
""")
    if first == "vtdense":  # (SMP imports timm, and through torchvision's ops Dynamo and sympy)
        assert out["heavy"] == []
    assert out["registered"] == ["vtdense-" + n for n in out["backbones"]] and out["encoder"] == "VtdenseEncoder"
    assert "_SmpFinder" not in out["finders"] and out["loader"] != "_RegisteringLoader"  # the hook is gone after use


def test_with_smp_already_imported_the_encoders_are_registered_at_once() -> None:
    import segmentation_models_pytorch  # noqa: F401  (imported first: no finder, registered now)
    from segmentation_models_pytorch.encoders import encoders

    saved = encoders.pop("vtdense-swinv2_tiny")
    try:
        register_when_smp_imported()
        assert encoders["vtdense-swinv2_tiny"]["params"] == saved["params"]
        assert not any(type(f).__name__ == "_SmpFinder" for f in sys.meta_path)
    finally:
        encoders["vtdense-swinv2_tiny"] = saved


def test_the_constant_result_mark_is_the_one_torch_sets() -> None:
    """vtdense marks its probe as ``torch.compiler.assume_constant_result`` does, without importing
    Dynamo; if torch changes how that decorator marks a function, this fails."""

    def probe() -> bool:
        return True

    def ours() -> bool:
        return True

    torch.compiler.assume_constant_result(probe)
    triton_window_attention._assume_constant_result(ours)
    assert vars(probe) == vars(ours) == {"_dynamo_marked_constant": True}
    assert vars(triton_window_attention._usable_in_graphs).get("_dynamo_marked_constant") is True
