"""``torch.compile(backbone, dynamic=True)`` at changing input sizes: after the first two sizes,
five more detection-like sizes compile nothing new, and compiled outputs equal eager, for Swin V1,
Swin V2 and MViTv2 (global and windowed attention).

The size-dependent Python (window masks, roll/partition indices, position-table indices, all
cached per size) runs outside the traced graph, so Dynamo neither specialises on the sizes nor
traces into the caches. Dynamo's own graph capture (``backend="eager"``) is what decides
recompilation; it keeps the test within seconds on 2 CPU cores, where Inductor's C++ build of
every graph would take minutes.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import vtdense

# A shifted block in stage 3; window 4 so that every stage map (>= 160 px input) is larger than
# the window and stage maps both tile exactly and need padding across these sizes.
TINY = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
FIRST = [(160, 192), (192, 256)]
MORE = [(224, 160), (256, 320), (288, 224), (160, 288), (320, 192)]


def _graphs() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


# Every family: Swin V1, Swin V2 (Log-CPB, cosine attention) and MViTv2 with global attention
# (decomposed position tables resampled per size) and with hybrid windows.
FAMILIES = {
    "swin_tiny": TINY,
    "swinv2_tiny": TINY,
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, drop_path_rate=0.0),
    "mvitv2_tiny-windows": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8, drop_path_rate=0.0),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dynamic_compile_does_not_recompile_at_new_sizes(name: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = vtdense.create_backbone(name.split("-")[0], **FAMILIES[name]).eval()
    compiled = torch.compile(model, dynamic=True, backend="eager")
    with torch.no_grad():
        for size in FIRST:
            compiled(torch.randn(1, 3, *size))
        after_two = _graphs()
        assert after_two[0] > 0  # something was compiled
        for size in MORE:
            x = torch.randn(1, 3, *size)
            got, expected = compiled(x), model(x)
            assert list(got) == list(expected)
            for k in got:
                assert got[k].shape == expected[k].shape, (size, k)
                assert torch.allclose(got[k], expected[k], atol=1e-5), (size, k)
    assert _graphs() == after_two, f"recompiled: graphs/frames {after_two} -> {_graphs()}"


def test_torch_export_leaves_no_traced_tensors_in_the_size_caches() -> None:
    """Exporting at a size never seen in eager must not fill the mask/index caches with fake tensors."""
    import vtdense

    torch.manual_seed(0)
    for name, kw in (("swin_tiny", {"window_size": 4}), ("mvitv2_tiny", {"window_size": 8})):
        m = vtdense.create_backbone(name, embed_dim=16, depths=[1, 1, 1, 1], num_heads=1 if "mvit" in name else [1, 1, 1, 1],
                                    **kw).eval()
        x = torch.randn(1, 3, 72, 104)  # padded, shifted windows at a fresh size
        torch.export.export(m, (x,), strict=False)
        with torch.no_grad():
            out = m(x)  # eager after export: the caches must hold real tensors
        assert all(type(v) is torch.Tensor and torch.isfinite(v).all() for v in out.values())
