"""Blocks as nested compile regions: in ``compile_backbone``'s graphs the blocks of a stage that
match compile once and their code is called again (``vtdense.backbones.base.set_compile_regions``).

Only graphs without gradients take them: torch 2.14 trains reused regions wrongly, so training graphs
inline every block (``benchmarks/RESULTS.md``, "Compile: reused regions trained wrongly")."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import vtdense
from probe import probe_loss
from recorded_graphs import GRAPHS as _GRAPHS
from recorded_graphs import RECORD as _RECORD
from vtdense.backbones import base
from vtdense.layers.drop import DropPath, residual
from vtdense.models.compile import compile_backbone

# Stage 3 has four blocks: two unshifted, two shifted (window 4, so every stage map is larger).
SWIN = dict(embed_dim=16, depths=(1, 1, 4, 1), num_heads=(1, 2, 2, 4), window_size=4)


def _regions(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """``(calls, distinct bodies)`` of the graph's ``invoke_subgraph`` nodes."""
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return len(calls), len({n.args[0].target for n in calls})


def _compiled_and_eager(train: bool, drop_path_rate: float) -> tuple[nn.Module, nn.Module]:
    torch._dynamo.reset()
    _GRAPHS.clear()
    torch.manual_seed(0)
    eager = vtdense.create_backbone("swin_tiny", drop_path_rate=drop_path_rate, **SWIN).train(train)
    return compile_backbone(copy.deepcopy(eager), _RECORD), eager


@pytest.fixture
def regions_on():  # noqa: ANN201
    before = base._COMPILE_REGIONS
    base.set_compile_regions(True)
    yield
    base.set_compile_regions(before)


def test_matching_blocks_compile_once_and_give_eager_values(regions_on: None) -> None:  # noqa: ARG001
    """Eval: stage 3's four blocks are two regions, each called twice; the other stages' single
    blocks are inlined. Outputs are eager's."""
    compiled, eager = _compiled_and_eager(train=False, drop_path_rate=0.3)
    x = torch.randn(2, 3, 160, 192)
    with torch.no_grad():
        got, want = compiled(x), eager(x)
    assert [_regions(g) for g in _GRAPHS] == [(4, 2)]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)

    base.set_compile_regions(False)  # the flat graph, as before regions
    compiled, _ = _compiled_and_eager(train=False, drop_path_rate=0.3)
    with torch.no_grad():
        compiled(x)
    assert [_regions(g) for g in _GRAPHS] == [(0, 0)]


def test_training_graphs_inline_every_block_and_a_hooked_block_stays_inlined(regions_on: None) -> None:  # noqa: ARG001
    """Training: a graph that records gradients inlines every block (torch 2.14 trains a region
    reused by two or more later blocks wrongly: with Inductor, Swin-T's stage-3 ``norm1`` weights
    got relative gradient errors of 1.0 and 0.79; ``benchmarks/RESULTS.md``, "Compile: reused
    regions trained wrongly"), and gives eager's gradients with a drop-path rate per block (the
    same draws from the same seed). Without gradients, a forward hook on a layer inside a block
    keeps that block out of the regions, and the hook runs."""
    compiled, eager = _compiled_and_eager(train=True, drop_path_rate=0.3)
    x = torch.randn(4, 3, 160, 192)
    grads = []
    for m in (compiled, eager):
        torch.manual_seed(1)
        probe_loss(m(x)).backward()
        grads.append([p.grad for p in m.parameters()])
    assert [_regions(g) for g in _GRAPHS] == [(0, 0)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    torch._dynamo.reset()
    _GRAPHS.clear()
    with torch.no_grad():
        compiled(x)
    assert [_regions(g) for g in _GRAPHS] == [(4, 2)]  # stage 3 in train mode, without gradients: two regions
    torch._dynamo.reset()
    _GRAPHS.clear()
    seen = []
    compiled.layers[2].blocks[2].mlp.register_forward_hook(lambda *_: seen.append(1))
    with torch.no_grad():
        compiled(x)
    assert seen and [_regions(g) for g in _GRAPHS] == [(2, 1)]  # the shifted pair is still one region


class _Branch(nn.Module):
    """A block whose residual branch is all ones, dropped per sample with probability ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return residual(x, self.drop, torch.ones_like(x) + 0 * self.lin(x))


def test_reused_regions_draw_their_drop_path_independently(regions_on: None) -> None:  # noqa: ARG001
    """Four equal blocks with drop path 0.5 (train mode, no gradients: regions), one region called
    four times by Inductor's code: each sample keeps 0 to 4 branches, binomially; the same draws in
    every call would keep 0 or 4."""
    from torch._inductor.compile_fx import compile_fx

    def inductor(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        _GRAPHS.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    _GRAPHS.clear()
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Branch(0.5) for _ in range(4)).train()
    step = torch.compile(lambda x: base.run_blocks(blocks, x), backend=inductor, dynamic=True)
    with torch._dynamo.config.patch(specialize_float=True), torch.no_grad():  # (compile_backbone's setting)
        kept = (step(torch.zeros(512, 4))[:, 0] * 0.5).round().long()
    assert [_regions(g)[1] for g in _GRAPHS] == [1] and _regions(_GRAPHS[0])[0] >= 3
    counts = torch.bincount(kept, minlength=5)
    assert counts.sum() == 512 and all(counts[1:4] > 60), counts.tolist()  # binomial(4, 1/2): 128, 192, 128
