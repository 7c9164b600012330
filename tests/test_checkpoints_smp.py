"""vtdense SMP encoders declare what they support in SMP's own terms, and behave accordingly.

SMP's encoder tests read ``_is_torch_scriptable`` / ``_is_torch_exportable`` /
``_is_torch_compilable``: a False flag must give an error (``RuntimeError`` for TorchScript), a True
flag a working, equal result.
"""

from __future__ import annotations

import pytest
import torch

from vtdense.models.segmentation import VtdenseEncoder

TINY = {
    "swin_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_torchscript_is_refused_with_a_clear_runtime_error(name: str) -> None:
    encoder = VtdenseEncoder(name, **TINY[name]).eval()
    assert encoder._is_torch_scriptable is False
    with pytest.raises(RuntimeError, match=f"'vtdense-{name}' is not TorchScript-able"):
        torch.jit.script(encoder)


def _compiled_and_eager(module: torch.nn.Module, sizes: tuple) -> list:
    """SMP's compile check, ``torch.compile(fullgraph=True, dynamic=True)`` (a graph break is an
    error), run at each ``(H, W)`` of ``sizes``: ``(size, compiled output, eager output)``."""
    torch.compiler.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="eager")
    with torch.no_grad():
        return [(size, compiled(x), module(x)) for size in sizes for x in [torch.randn(1, 3, *size)]]


def test_declared_flags() -> None:
    """Strict ``torch.export`` equals eager for Swin V1, V2 and MViTv2 (measured outside the suite,
    20-90 s each on 2 CPU cores; the slow test below runs one). SMP's own compile check,
    ``torch.compile(fullgraph=True, dynamic=True)``, holds for every family: the encoder inside a
    whole SMP model (MViTv2) by the test below, and the Swin V1 and V2 backbones under the same
    compile at six or seven sizes by ``tests/test_compile.py``."""
    assert all(VtdenseEncoder(n, **TINY[n])._is_torch_exportable for n in TINY)
    assert all(VtdenseEncoder(n, **TINY[n])._is_torch_compilable is True for n in TINY)


@pytest.mark.parametrize("arch,backbone", [("upernet", "mvitv2_tiny")])
def test_whole_smp_segmentor_compiles_to_one_graph(arch: str, backbone: str) -> None:
    """Not only the encoder: an SMP model around a vtdense encoder compiles whole, with
    ``fullgraph=True`` and ``dynamic=True``, and gives eager's logits at sizes of both aspects.
    (Swin V1 and V2 alone under the same compile, at six or seven sizes: ``tests/test_compile.py``; each
    whole-model trace takes 17-27 s on 2 CPU cores, so one family runs here.)"""
    from vtdense.models.segmentation import build_segmentor

    torch.manual_seed(0)
    model = build_segmentor(arch, backbone, 3, backbone_kwargs=TINY[backbone]).eval()
    for size, got, expected in _compiled_and_eager(model, ((128, 160), (160, 96))):
        assert got.shape == (1, 3, *size) and torch.allclose(got, expected, atol=1e-5), size


@pytest.mark.slow
def test_swinv2_small_window_path_exports() -> None:
    """Strict export of the Swin V2 encoder where windows shrink (the Log-CPB coordinates of the
    shrunk window are built in the traced path): equal to eager."""
    encoder = VtdenseEncoder("swinv2_tiny", embed_dim=8, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4).eval()
    x = torch.randn(1, 3, 32, 64)  # stage maps 8x16 ... 1x2: windows shrink at stages 3 and 4
    exported = torch.export.export(encoder, args=(x,), strict=True)
    with torch.no_grad():
        for a, b in zip(exported.module()(x), encoder(x)):
            assert torch.allclose(a, b, atol=1e-5)
