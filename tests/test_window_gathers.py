"""The gathers that partition a Swin map into (shifted, padded) windows and back: inside
``torch.compile`` their backward passes are gathers with the other index table instead of
autograd's scatter-add. The gradients must be autograd's, bit for bit, which for the partition
rests on one fact of the blocks: the padded slots (copies of token 0) get no gradient."""

from __future__ import annotations

import pytest
import torch

from vtdense.backbones.swin import SwinBlock
from vtdense.layers import windows
from vtdense.layers.windows import window_token_index

# (H, W, window, shift): padding on both axes, with and without the shift; no padding
CASES = [(5, 7, (4, 4), (2, 2)), (5, 7, (4, 4), (0, 0)), (8, 8, (4, 4), (2, 2)), (9, 6, (7, 7), (3, 3))]


def _real_slots(gather: torch.Tensor, scatter: torch.Tensor) -> torch.Tensor:
    return scatter[gather] == torch.arange(gather.numel())


@pytest.mark.parametrize("H,W,window,shift", CASES)
def test_backward_gathers_equal_autograds_scatter_adds(H: int, W: int, window: tuple, shift: tuple) -> None:
    gather, scatter = window_token_index(H, W, window, shift)
    real = _real_slots(gather, scatter)
    assert (not real.all()) == bool(H % window[0] or W % window[1])  # the cases do pad where they should
    torch.manual_seed(0)
    # windows -> tokens: any upstream gradient; padded slots get exactly zero
    w = torch.randn(2, gather.numel(), 3, requires_grad=True)
    g = torch.randn(2, H * W, 3)
    ref = torch.autograd.grad(w.index_select(1, scatter), w, g)[0]
    got = torch.autograd.grad(windows._WindowsToTokens.apply(w, gather, scatter), w, g)[0]
    assert torch.equal(got, ref)
    # tokens -> windows: an upstream gradient that is zero on the padded slots, as the blocks give
    x = torch.randn(2, H * W, 3, requires_grad=True)
    gw = torch.randn(2, gather.numel(), 3) * real[:, None]
    ref = torch.autograd.grad(x.index_select(1, gather), x, gw)[0]
    got = torch.autograd.grad(windows._TokensToWindows.apply(x, gather, scatter), x, gw)[0]
    assert torch.equal(got, ref)
    # the same straight into (B, nW, N, C) windows, as Swin's blocks ask for them (not a view)
    n = window[0] * window[1]
    out = windows._TokensToWindows.apply(x, gather, scatter, n)
    assert out.shape == (2, gather.numel() // n, n, 3) and out._base is None
    assert torch.equal(out.flatten(1, 2), x.index_select(1, gather))
    assert torch.equal(torch.autograd.grad(out, x, gw.view(out.shape))[0], ref)


@pytest.mark.parametrize("post_norm", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("H,W,window,shift", CASES[:2] + CASES[3:])
def test_padded_slots_of_a_swin_block_get_no_gradient(post_norm: bool, H: int, W: int, window: tuple, shift: tuple) -> None:
    """The fact the partition's backward relies on, for V1 (pre-norm fused with qkv) and V2 (cosine
    attention, post-norm): a padded slot is masked as a key and dropped as a query."""
    torch.manual_seed(0)
    block = SwinBlock(8, 2, window, shifted=any(shift), post_norm=post_norm).train()
    x = torch.randn(2, H, W, 8, requires_grad=True)
    wins, win, mask, (gather, scatter) = block._partition(x)
    wins.retain_grad()
    out = block.attn(wins, win, mask, norm=None if post_norm else block.norm1)
    y = windows.select_tokens(out.reshape(2, -1, 8), scatter)
    (y * torch.randn_like(y)).sum().backward()
    pad = ~_real_slots(gather, scatter).view(wins.shape[1], wins.shape[2])
    assert pad.any()
    assert torch.count_nonzero(wins.grad[:, pad]) == 0
    assert torch.count_nonzero(wins.grad[:, ~pad]) > 0


def test_eager_steps_keep_autograds_gathers() -> None:
    """Outside ``torch.compile`` (eager GPU steps are bound by the host, where a Python autograd
    function per gather only adds time; on the CPU it measured no faster) autograd's own nodes run."""
    gather, scatter = window_token_index(5, 7, (4, 4), (2, 2))
    x = torch.randn(2, 35, 2, requires_grad=True)
    y = windows.tokens_to_windows(x, gather, scatter)
    z = windows.windows_to_tokens(y, gather, scatter)
    assert "Windows" not in type(y.grad_fn).__name__ + type(z.grad_fn).__name__
    assert torch.equal(z, x)  # partition then reverse is the identity on the tokens


def _aot_ops(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict[str, list[str]], list[str]]:
    """One compiled training step of ``model`` through AOT autograd: the ATen ops of the forward and
    backward graphs (``{"fw": [...], "bw": [...]}``), and the forward's outputs (what the backward
    reads) that are views of a gather."""
    from torch._functorch.aot_autograd import aot_module_simplified

    ops: dict[str, list[str]] = {}
    saved_views: list[str] = []

    def backend(gm, inputs):  # noqa: ANN001, ANN202
        def keep(name: str):  # noqa: ANN202
            def compiler(g, _):  # noqa: ANN001, ANN202
                ops[name] = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
                if name == "fw":  # outputs (saved for the backward) that are views of a gather
                    (out,) = [n for n in g.graph.nodes if n.op == "output"]
                    saved_views.extend(str(n) for n in out.args[0] if isinstance(n, torch.fx.Node)
                                       and "view" in str(n.target) and isinstance(n.args[0], torch.fx.Node)
                                       and "index" in str(n.args[0].target))
                return g.forward
            return compiler
        return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"))

    sum(f.square().mean() for f in torch.compile(model, backend=backend)(x).values()).backward()
    return ops, saved_views


def test_compiled_swin_training_backward_has_no_token_scatter_adds() -> None:
    """Under ``torch.compile`` the backward graph keeps one ``index_add`` per block (the position
    table's gradient) and none for the window gathers (two per block before)."""
    import vtdense

    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                                    window_size=4, drop_path_rate=0.0).train()
    x = torch.randn(2, 3, 80, 112)  # stage maps 20x28 .. 3x4: padded and unpadded windows
    ops, saved_views = _aot_ops(model, x)
    blocks = 8
    assert ops["bw"].count("aten.index_add.default") == blocks, ops["bw"].count("aten.index_add.default")
    # Inductor sorts a saved view's symbolic strides with sympy alone, which failed on Swin's windows
    # at batch 2 in compile_backbone's cells graph: the partition writes the windows itself
    assert not saved_views, saved_views
    # per block: the partition (one gather straight into windows), the reverse, the position table
    assert ops["fw"].count("aten.index.Tensor") >= blocks
    assert ops["fw"].count("aten.index_select.default") + ops["fw"].count("aten.index.Tensor") >= 3 * blocks


def test_compiled_mvitv2_training_gathers_its_windows_and_pools_with_one_op() -> None:
    """Compiled MViTv2 training with hybrid windows: each windowed block cuts q, k and v into windows
    with gathers (three, and one back to the tokens), whose backward passes are gathers too (no
    scatter-add); it pools with ``vtdense::depthwise_conv_nhwc`` and its backward op, and its patch
    embedding runs as ``vtdense::conv2d``; and no saved tensor is a view of a gather."""
    import vtdense

    torch.manual_seed(0)
    model = vtdense.create_backbone("mvitv2_tiny", embed_dim=16, depths=(1, 2, 1, 1), num_heads=1, window_size=8,
                                    drop_path_rate=0.0).train()
    x = torch.randn(2, 3, 80, 112)  # stage maps 20x28 .. 3x4: windows of 8, 4, 2, 1 (padded and not)
    ops, saved_views = _aot_ops(model, x)
    windowed = sum(blk.attn.window != 0 for stage in model.stages for blk in stage.blocks)
    blocks = sum(len(stage.blocks) for stage in model.stages)
    assert 0 < windowed < blocks
    fw, bw = ops["fw"], ops["bw"]
    assert fw.count("vtdense.depthwise_conv_nhwc.default") == 3 * blocks
    assert bw.count("vtdense.depthwise_conv_nhwc_backward.default") == 3 * blocks
    # and the patch embedding's conv is an op of its own too (vtdense.layers.opaque_conv): no aten conv is left
    assert "aten.convolution.default" not in fw and "aten.convolution_backward.default" not in bw
    assert fw.count("vtdense.conv2d.default") == 1 and bw.count("vtdense.conv2d_backward.default") == 1
    assert fw.count("vtdense.window_token_index.default") == 2 * windowed
    assert fw.count("aten.index.Tensor") >= 3 * windowed  # q, k, v into windows
    # backward: gathers for the windows (3 in, 1 out per windowed block), no scatter-add; the only
    # index_put are the two position tables' of each block
    assert bw.count("aten.index_select.default") >= 4 * windowed
    assert "aten.index_add.default" not in bw and bw.count("aten.index_put.default") == 2 * blocks
    assert not saved_views, saved_views
