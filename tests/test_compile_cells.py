"""``compile_backbone``'s two graphs: images in whole 32-pixel cells (what detectors and segmentors
feed it: their batches are padded to 32) and images of any other size.

In the cells graph the symbolic sizes are the cell counts, so every stage map is an exact multiple
of them, with no floor division left to trace, guard on or generate code for
(``benchmarks/RESULTS.md``, "Compile: sizes in whole cells")."""

from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.utils import counters

import vtdense
from probe import probe_loss
from recorded_graphs import GRAPHS as _GRAPHS
from recorded_graphs import RECORD as _RECORD
from vtdense.models.compile import compile_backbone

SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
MVIT = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8, drop_path_rate=0.0)


def _map_sizes(gm: torch.fx.GraphModule) -> tuple[list[sympy.Expr], list[tuple[sympy.Expr, sympy.Expr]]]:
    """The graph's image input's symbolic sizes and the ``(H, W)`` expressions of its 4-D outputs."""
    (image,) = [n.meta["example_value"] for n in gm.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
                and any(isinstance(s, torch.SymInt) for s in n.meta["example_value"].shape)]
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    maps = [n.meta["example_value"] for n in out.args[0] if isinstance(n, torch.fx.Node)]
    maps = [m for m in maps if isinstance(m, torch.Tensor) and m.dim() == 4]
    as_expr = (lambda s: s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(s))  # noqa: E731
    return [as_expr(s) for s in image.shape], [(as_expr(m.shape[2]), as_expr(m.shape[3])) for m in maps]


@pytest.mark.parametrize("name,kwargs", [("swin_tiny", SWIN), ("mvitv2_tiny", MVIT)], ids=["swin", "mvitv2"])
def test_in_cells_every_stage_map_is_a_multiple_of_the_cell_counts(name: str, kwargs: dict) -> None:
    """The cells graph's maps are ``(32 / s) h x (32 / s) w`` for stride ``s``. (The any-size graph,
    ``size_divisible=1``, what every input ran before, writes them with floor divisions such as
    ``((H - 1) // 4 - 1) // 2 + 1``, and its image input has four dimensions: this test fails there.)"""
    model = vtdense.create_backbone(name, **kwargs).eval()
    torch._dynamo.reset()
    _GRAPHS.clear()
    compile_backbone(model, _RECORD, fullgraph=True)(torch.randn(2, 3, 192, 256))
    assert len(_GRAPHS) == 1
    (_, _, h, cell_h, w, cell_w), maps = _map_sizes(_GRAPHS[0])
    assert (cell_h, cell_w) == (32, 32) and all(isinstance(s, sympy.Symbol) for s in (h, w))
    assert len(maps) == len(model.out_strides)
    for (H, W), stride in zip(maps, model.out_strides):
        assert (sympy.expand(H - 32 // stride * h), sympy.expand(W - 32 // stride * w)) == (0, 0), (stride, H, W)


def test_sizes_in_whole_cells_share_one_graph_and_train_like_eager() -> None:
    """MViTv2 with hybrid windows, training: multiples of 32 run one graph, other sizes one more,
    and nothing recompiles after those two. Outputs are eager's; the gradients, the image's included
    (the cells are a copy inside autograd), are the any-size graph's.

    Gradients are compared between the two graphs, not with eager: they pass MViTv2's max-pooled
    shortcuts, whose gradient goes to each pooling window's largest value. Where two values are
    within float32 rounding of each other, rounding picks the one, and compiled code rounds
    differently from eager (as float32 does from float64): at 224x288, one window moved the
    patch embedding's weight gradient by 30% in places. The two graphs run the same kernels."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = vtdense.create_backbone("mvitv2_tiny", **MVIT).train()
    in_cells, any_size = copy.deepcopy(eager), copy.deepcopy(eager)
    compile_backbone(in_cells, "eager", fullgraph=True)
    compile_backbone(any_size, "eager", fullgraph=True, size_divisible=1)
    sizes = [(192, 256), (224, 288), (200, 232), (256, 160), (232, 264)]
    images = [torch.randn(2, 3, *size) for size in sizes]

    def step(m: torch.nn.Module, x: torch.Tensor) -> tuple[list, list]:
        m.zero_grad()
        xi = x.clone().requires_grad_()
        out = m(xi)
        probe_loss(out).backward()
        return list(out.values()), [xi.grad, *(p.grad for p in m.parameters())]

    graphs, runs = [], []
    for x in images:
        runs.append(step(in_cells, x))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 2, 2, 2]  # multiples of 32, then the other sizes' graph, then nothing new
    for x, (outs, grads) in zip(images, runs):
        for a, b in zip(outs, step(eager, x)[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert grads[0] is not None
        for a, b in zip(grads, step(any_size, x)[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the copies share the any-size graph (parameters are graph inputs): still two
    assert counters["stats"]["unique_graphs"] == 2


def test_size_divisible_is_checked() -> None:
    model = vtdense.create_backbone("swin_tiny", **SWIN)
    for bad in (0, -32, 2.5, True):
        with pytest.raises(ValueError, match="size_divisible"):
            compile_backbone(model, "eager", size_divisible=bad)


@pytest.mark.parametrize("backend,kwargs,options", [
    ("inductor", {}, {"triton.mix_order_reduction_non_strict_mode": True}),
    ("inductor", {"mode": "reduce-overhead"}, {"triton.mix_order_reduction_non_strict_mode": True, "triton.cudagraphs": True}),
    ("inductor", {"options": {"triton.mix_order_reduction_non_strict_mode": False}},
     {"triton.mix_order_reduction_non_strict_mode": False}),
    ("inductor", {"dynamic": False}, None),
    ("aot_eager", {}, None)])
def test_inductor_graphs_leave_out_the_gpu_fusions_size_thresholds(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                                     kwargs: dict, options: dict | None) -> None:
    """Both dynamic Inductor graphs are compiled without the size checks of the GPU's LayerNorm-backward
    fusion, each of which guarded the graph on the size (a second compile on an H200 at the next size);
    a ``mode`` is folded into the options, and the caller's own options win."""
    seen: list[dict] = []
    real = torch.compile

    def record(fn: object = None, **kw: object) -> object:
        seen.append(kw)
        return real(fn, **{**kw, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", record)
    compile_backbone(vtdense.create_backbone("swin_tiny", **SWIN), backend, **kwargs)
    assert len(seen) == (1 if kwargs.get("dynamic") is False else 2)  # the any-size graph, the cells graph
    for kw in seen:
        assert kw.get("options") == options and "mode" not in kw


class _RowsBackbone(torch.nn.Module):
    """A one-linear "backbone" whose training step sums the bias gradient over ``B * H * W`` rows."""

    out_strides = (1,)

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"0": torch.relu(self.proj(x.permute(0, 2, 3, 1)))}


def test_inductor_cpu_sums_over_rows_do_not_guard_the_graph_on_4096_rows() -> None:
    """Inductor's C++ code generator chose a float sum's accumulator by ``rows > 4096``, a guard:
    Swin-T's training step at batch 2 compiled again from 512x768 (3430 rows at stage 3) to 640x800.
    In ``compile_backbone``'s graphs a symbolic length takes the chunked accumulator at every size:
    here 3072 rows, then 6144, then 1536 run one graph (two before), with eager's gradients.
    Inductor's caches are off: a cached graph brings the guards it was compiled with. (The configs'
    own ``patch``: pytest's ``monkeypatch`` left ``enable_autograd_cache`` hidden, and every later
    Inductor compile in the process failed on reading it.)"""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _train_rows_backbone_at_three_sizes()


def _train_rows_backbone_at_three_sizes() -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = _RowsBackbone()
    compiled = compile_backbone(copy.deepcopy(eager), "inductor", size_divisible=1)
    for size in [(32, 48), (64, 48), (16, 48)]:
        x = torch.randn(2, 3, *size)
        grads = []
        for model in (compiled, eager):
            model(x)["0"].square().mean().backward()
            grads.append([p.grad for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_square_first_size_makes_no_graph_for_squares_only() -> None:
    """Both graphs are traced without duck shaping: a square first image (height and width one
    symbol, guarded equal) made the any-size graph square-only, and the next image compiled again."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled = compile_backbone(vtdense.create_backbone("swin_tiny", **dict(SWIN, depths=(1, 1, 1, 1))), "eager")
    graphs = []
    with torch.no_grad():
        for size in [(170, 170), (230, 170), (192, 192), (192, 256)]:
            compiled(torch.randn(2, 3, *size))
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 2, 2]  # the any-size graph, then the cells graph
