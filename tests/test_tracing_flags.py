"""``vtdense.layers.tracing.exporting`` tells ``torch.export`` from ``torch.compile`` on every torch.

Dynamo in torch 2.11 (the GPU image's torch) folds ``torch.compiler.is_exporting()`` to ``True``
inside every ``torch.compile``; vtdense's compiled graphs then took the export paths (size tables
built from tensor ops in the graph instead of the custom ops, plain kernels instead of the compiled
CPU ones). The tests here make ``is_exporting`` lie the same way on this torch.
"""

from __future__ import annotations

import pytest
import torch

import vtdense
from vtdense.layers.tracing import exporting


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x + (1.0 if exporting() else 2.0)


class _Probe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _probe(x)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_exporting_is_true_in_export_only(strict: bool) -> None:
    x = torch.zeros(1)
    assert not exporting()
    assert _probe(x).item() == 2.0
    assert torch.export.export(_Probe(), (x,), strict=strict).module()(x).item() == 1.0
    torch._dynamo.reset()
    assert torch.compile(_probe, backend="eager", fullgraph=True)(x).item() == 2.0


def test_compiled_graphs_keep_the_custom_ops_when_is_exporting_lies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``is_exporting`` replaced by a function that says True under compile, as torch 2.11's Dynamo
    makes it: the compiled Swin still fetches its window tables by the custom ops."""
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    targets: list[str] = []

    def record(gm, example_inputs):  # noqa: ANN001, ANN202
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    model = vtdense.create_backbone("swin_tiny", embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                    window_size=4).eval()
    with torch.no_grad():
        torch.compile(model, dynamic=True, fullgraph=True, backend=record)(torch.randn(1, 3, 64, 96))
    torch._dynamo.reset()
    assert any(t.startswith("vtdense.window_token_index") for t in targets), sorted(set(targets))
    assert any(t.startswith("vtdense.window_attention_mask") for t in targets)
