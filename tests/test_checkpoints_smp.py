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


def test_declared_flags() -> None:
    """Exportable (measured: strict ``torch.export`` equals eager for Swin and MViTv2, ~30 s each on
    2 CPU cores, too slow for this suite); not declared compilable (SMP's fullgraph + dynamic
    compile did not finish in 400 s for Swin)."""
    assert VtdenseEncoder._is_torch_exportable is True
    assert VtdenseEncoder._is_torch_compilable is False
