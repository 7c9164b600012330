"""``compile_backbone`` makes one graph for every batch size: the batch is traced as an unbacked size,
and the convs of the traced part (patch embeddings, the detector's FPN) run as one opaque op each
(:mod:`vtdense.layers.opaque_conv`), since a traced ``F.conv2d`` guards on the batch (``2 <= B <= 15`` on
the CPU). Before, a model compiled at batch 2 compiled again for a batch of 1 and for 16 or more."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import vtdense
from vtdense.layers.opaque_conv import OpaqueConv2d, opaque_convs
from vtdense.models.compile import compile_backbone

SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
# Stage 3's first and third blocks match: in inference graphs the third reuses the first's region
# (torch 2.14), which AOT autograd traces once more on its own; training graphs inline both.
SWIN_REUSED = {**SWIN, "depths": (1, 1, 3, 1)}
MVIT = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8, drop_path_rate=0.0)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _compiled_and_twin(name: str, kwargs: dict, train: bool, random_weights: bool = False,
                       backend: str = "aot_eager") -> tuple[torch.nn.Module, torch.nn.Module]:
    """A backbone compiled by ``compile_backbone`` (``aot_eager``, the graph Inductor receives, or
    ``backend``) and its eager twin with the same weights (``random_weights``: every parameter drawn
    at random, so that no branch starts at zero); Dynamo's caches and counters cleared."""
    from tests.test_swin import randomize_

    torch.manual_seed(0)
    twin = vtdense.create_backbone(name, **kwargs).train(train)
    if random_weights:
        randomize_(twin)
    model = copy.deepcopy(twin)
    torch._dynamo.reset()
    counters.clear()
    compile_backbone(model, backend, fullgraph=True)
    return model, twin


def _check_step(model: torch.nn.Module, twin: torch.nn.Module, x: torch.Tensor, train: bool, seed: int | None = None) -> None:
    """One step of the compiled ``model`` and of its eager ``twin``: equal outputs and gradients
    (``seed``: the random stream seeded alike before each, for the same drop-path draws)."""
    outs = []
    for m in (model, twin):
        m.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.set_grad_enabled(train):
            out = m(x)
            if train:
                sum((v * torch.linspace(0.5, 1.5, v.numel()).view_as(v)).sum() for v in out.values()).backward()
        outs.append(out)
    for k in outs[0]:
        assert torch.allclose(outs[0][k], outs[1][k], atol=1e-5), (tuple(x.shape), k)
    if train:
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.grad is not None and q.grad is not None, name
            if name.endswith("norm_k.bias"):
                continue  # shifts every logit of a query alike: its true gradient is zero, both are rounding
            scale = q.grad.abs().max().item()  # (float rounding of sums over many rows: relative to the largest)
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5 * max(scale, 1.0)), (tuple(x.shape), name)


@pytest.mark.parametrize("name,kwargs", [("swin_tiny", SWIN), ("mvitv2_tiny", MVIT)], ids=["swin", "mvitv2"])
def test_one_training_graph_serves_batches_of_2_1_and_16(name: str, kwargs: dict) -> None:
    """Also MViTv2's decomposed relative positions in training graphs (its hybrid layout attends
    globally from stage 2): the graph keeps the plain bias path and SDPA (the fold's backward does
    not trace at dynamic sizes; the CPU inference op ``decomposed_attention_cpu`` has no backward)
    and gives eager's gradients with random weights. Dynamo traces the backbone once: with the
    model's floats (norms' ``eps``) made graph inputs, as ``torch.compile(dynamic=True)`` alone does,
    lowering the graph specialised them and Dynamo traced everything a second time.

    Swin V1 with stochastic depth at rates that differ per block, drawn alike in both: one graph
    for the whole backbone, and eager's outputs and gradients. (A graph break inside the blocks made
    Dynamo share one resume function between all blocks and guard on each block's rate: it
    recompiled per block, hit its recompile limit and ran the rest eagerly.) MViTv2 with stochastic
    depth is ``tests/test_compile.py``'s, with its default weights: with these random ones a sample
    whose branches are dropped passes a max-pooled map on unchanged to the next max-pool, whose
    overlapping windows then hold exact ties, and compiled and eager code send those gradients to
    different (equally valid) maxima: up to 2e-3 apart, 1e-6 once the ties are broken."""
    import torch._dynamo.utils as dynamo_utils

    from recorded_graphs import GRAPHS, RECORD_AOT

    GRAPHS.clear()
    model, twin = _compiled_and_twin(name, {**kwargs, "drop_path_rate": 0.3 if name == "swin_tiny" else 0.0}, train=True,
                                     random_weights=name.startswith("mvitv2"), backend=RECORD_AOT)
    dynamo_utils.compilation_time_metrics.clear()
    _check_step(model, twin, torch.randn(2, 3, 192, 256), train=True, seed=0)
    assert [k for k in dynamo_utils.compilation_time_metrics if k.startswith("compile_attempt_")] == ["compile_attempt_0"]
    first = _graphs()
    assert first == 1
    for i, (batch, size) in enumerate([(1, (192, 256)), (1, (224, 160)), (16, (160, 192)), (3, (256, 192))]):
        _check_step(model, twin, torch.randn(batch, 3, *size), train=True, seed=i + 1)
    assert _graphs() == first, f"recompiled for a new batch size: {first} -> {_graphs()} graphs"
    text = "\n".join(str(gm.graph) for gm in GRAPHS)
    assert ("bernoulli" in text) == (name == "swin_tiny")  # the drop-path draws are in the graph
    assert "decomposed_attention_cpu" not in text
    if name.startswith("mvitv2"):
        assert "scaled_dot_product_attention" in text


def test_the_gpu_code_path_under_bf16_autocast_serves_every_batch_in_one_training_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU traces, as far as the CPU can show it: attention's inputs laid out for SDPA's fused
    kernels (row-padded terms, SDPA rather than the CPU's window op), the recomputation through
    saved-tensor hooks, bf16 autocast. The unbacked batch still makes one training graph for batches
    of 2, 1 and 16, with eager's outputs (bf16) and gradients. Left to a GPU: Inductor's CUDA code,
    the CUDA kernels' own size checks, and the Triton window attention that bf16 training takes
    there (its compiled ops are checked in Triton's interpreter by ``test_triton_window_attention``)."""
    import vtdense.layers.attention as attention_mod
    import vtdense.layers.mlp as mlp_mod

    monkeypatch.setattr(attention_mod, "_GPU_LAYOUT_ON_CPU", True)
    monkeypatch.setattr(mlp_mod, "_form", "hooks")  # the recomputation's GPU form
    model, twin = _compiled_and_twin("swin_tiny", {**SWIN, "window_size": 7}, train=True)  # 49 tokens: row-padded terms
    for batch in (2, 1, 16):
        x = torch.randn(batch, 3, 160, 192)
        grads, outs = [], []
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.bfloat16):
                out = m(x)
            assert all(v.dtype == torch.bfloat16 for v in out.values())
            sum((v.float() * torch.linspace(0.5, 1.5, v.numel()).view_as(v)).sum() for v in out.values()).backward()
            outs.append(torch.cat([v.float().flatten() for v in out.values()]))
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        assert (outs[0] - outs[1]).norm() <= 1e-2 * outs[1].norm(), batch
        assert (grads[0] - grads[1]).norm() <= 3e-2 * grads[1].norm(), batch
    assert _graphs() == 1, f"recompiled for a new batch size: {_graphs()} graphs"


def test_the_any_size_graph_serves_every_batch_too_and_leaves_the_input_unmarked() -> None:
    model, twin = _compiled_and_twin("swin_tiny", SWIN, train=False)
    x = torch.randn(2, 3, 163, 171)  # no multiple of 32: the any-size graph
    torch._dynamo.mark_dynamic(x, 2)  # a caller's own marking stays as it was
    _check_step(model, twin, x, train=False)
    assert _graphs() == 1
    assert not hasattr(x, "_dynamo_unbacked_indices") and x._dynamo_dynamic_indices == {2}
    for batch in (1, 5):
        _check_step(model, twin, torch.randn(batch, 3, 171, 163), train=False)
    assert _graphs() == 1


def test_a_part_with_a_conv_of_its_own_keeps_a_batch_of_1_apart() -> None:
    """A conv that vtdense does not run as an op (here the patch embedding's, made a plain
    ``nn.Conv2d``) would state a wrong layout on an unbacked batch: such a part traces its batch as
    before, and a batch of 1 is a second graph, with the same outputs."""
    torch.manual_seed(0)
    twin = vtdense.create_backbone("swin_tiny", **SWIN).eval()
    model = copy.deepcopy(twin)
    model.patch_embed.proj.__class__ = torch.nn.Conv2d
    torch._dynamo.reset()
    counters.clear()
    compile_backbone(model, "aot_eager", fullgraph=True)
    for batch in (2, 3, 1):
        _check_step(model, twin, torch.randn(batch, 3, 160, 192), train=False)
    assert _graphs() == 2


def test_the_detector_backbone_and_fpn_serve_every_batch() -> None:
    from vtdense.models.detection import build_detector

    torch.manual_seed(0)
    det = build_detector("swin_tiny", "faster_rcnn", 3, backbone_kwargs=SWIN, fpn_channels=16, slim_heads=True)
    assert all(type(m) is OpaqueConv2d for m in det.backbone.fpn.modules() if isinstance(m, torch.nn.Conv2d))
    twin = copy.deepcopy(det.backbone).eval()
    torch._dynamo.reset()
    counters.clear()
    compile_backbone(det, "aot_eager", fullgraph=True)
    det.eval()
    for batch in (2, 1, 16):
        _check_step(det.backbone, twin, torch.randn(batch, 3, 160, 192), train=False)
    assert _graphs() == 1


@pytest.mark.parametrize("k,stride,padding,groups,bias", [
    (4, 4, 0, 1, True), (7, 4, 3, 1, True), (3, 1, 1, 1, True), (3, 2, 1, 2, False), (1, 1, 0, 1, True)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_the_conv_op_computes_the_conv_and_its_gradients(k: int, stride: int, padding: int, groups: int, bias: bool,
                                                         channels_last: bool) -> None:
    """Compiled (``aot_eager``, dynamic sizes, the batch unbacked) against ``nn.Conv2d`` in eager on an
    input of the same memory format: the same outputs, in that format, and the same gradients of
    input, weight and bias; and torch's own checks of the op (fake kernel, autograd, schema)."""
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(4, 6, k, stride=stride, padding=padding, groups=groups, bias=bias)
    conv = opaque_convs(copy.deepcopy(ref))
    conv.cpu_channels_last = channels_last
    assert type(conv) is OpaqueConv2d and list(conv.state_dict()) == list(ref.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    torch._dynamo.reset()  # (each case is a new module of the same forward's code)
    compiled = torch.compile(conv, backend="aot_eager", dynamic=True, fullgraph=True)
    for batch, h, w in [(2, 13, 17), (1, 20, 12)]:
        x = torch.randn(batch, 4, h, w).contiguous(memory_format=fmt)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        outs = [compiled(xs[0]), ref(xs[1])]
        assert outs[0].shape == outs[1].shape and outs[0].is_contiguous(memory_format=fmt)
        assert torch.allclose(outs[0], outs[1], atol=1e-6)
        g = torch.randn_like(outs[1])
        for o in outs:
            o.backward(g)
        assert torch.allclose(xs[0].grad, xs[1].grad, atol=1e-5)
        for p, q in zip(conv.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-4), (p.shape, batch)
            p.grad = q.grad = None
    x = torch.randn(2, 4, 9, 11).contiguous(memory_format=fmt).requires_grad_()
    args = (x, ref.weight.detach().requires_grad_(), None if ref.bias is None else ref.bias.detach().requires_grad_(),
            [stride, stride], [padding, padding], groups, channels_last)
    torch.library.opcheck(torch.ops.vtdense.conv2d, args)


def test_inference_under_bf16_autocast_with_a_reused_region_serves_every_batch() -> None:
    """Eval under bf16 autocast, where stage 3's third block reuses the first's region: SDPA's
    decomposition broadcast the window term shared by the batch over the unbacked batch, a guard
    on ``Eq(1, u0)`` that stopped the compile. One graph for batches of 2, 1 and 3, eager's outputs."""
    model, twin = _compiled_and_twin("swin_tiny", SWIN_REUSED, train=False)
    for batch in (2, 1, 3):
        x = torch.randn(batch, 3, 160, 192)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            got, want = model(x), twin(x)
        for k in want:
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]), (batch, k)
    assert _graphs() == 1, f"recompiled for a new batch size: {_graphs()} graphs"
