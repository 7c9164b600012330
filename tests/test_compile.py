"""``torch.compile(backbone, dynamic=True, fullgraph=True)`` at changing input sizes: one graph with
no break; after the first two sizes, five more sizes (two with maps that do not tile) compile nothing
new, and compiled outputs equal eager, for Swin V1, Swin V2 and MViTv2 (global and windowed attention).

The size-dependent Python (window masks and roll/partition indices, cached per size) runs inside
custom ops that take the symbolic sizes, so Dynamo neither specialises on the sizes nor traces into
the caches, and the graph does not break. Most tests here use Dynamo's own graph capture
(``backend="eager"``); the first one goes through AOT autograd too (``backend="aot_eager"``, the graph
Inductor receives, without its code generation), since its trace adds guards of its own. Both keep
the tests within seconds on 2 CPU cores, where Inductor's C++ build of every graph would take minutes.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import vtdense
from probe import probe_loss

# A shifted block in stage 3; window 4 so that every stage map (>= 160 px input) is larger than
# the window and stage maps both tile exactly and need padding across these sizes.
TINY = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
FIRST = [(160, 192), (192, 256)]
# 200x232 gives odd maps from stage 2 on (Swin's patch merging pads them) and 163x171 is no multiple
# of the patch: neither may be a new graph (a parity guard in patch merging, a divisibility guard in
# the patch embedding and a contiguity guard on MViTv2's window crop each recompiled there).
MORE = [(224, 160), (200, 232), (288, 224), (163, 171), (320, 192)]


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


def _assert_windows_are_constants(name: str, graphs: list[torch.fx.GraphModule]) -> None:
    """With symbolic map sizes, the window of a map larger than it stays a constant in the graph: the
    mask and index ops take symbolic ``H, W`` but literal window sizes, so the kernels built on the
    ``(N, N)`` terms have static shapes (a ``min`` made them symbolic, and Inductor then generated scalar
    loops with an integer division per element: 108 of 400 ms of a compiled Swin-T at 512x768).

    And a padded size is one expression, ``ceil(H / w) * w`` (the window ops' fake sizes), with no
    ``Mod``: MViTv2's padding written as ``H + (-H % w)`` gave 24 of its graph's tensors a second form of
    the same size, which every later view had to prove equal (its Dynamo trace took 1.6-2x longer:
    ``benchmarks/RESULTS.md``, "Compile: one form for a padded size")."""
    nodes = [node for gm in graphs for node in gm.graph.nodes]
    calls = [node.args for node in nodes if node.op == "call_function" and str(node.target).startswith("vtdense.window_")]
    shapes = [str(node.meta["example_value"].shape) for node in nodes if isinstance(node.meta.get("example_value"), torch.Tensor)]
    assert len(shapes) > 100 and any("s" in s for s in shapes), shapes[:5]  # symbolic shapes were recorded
    assert not [s for s in shapes if "Mod(" in s]
    if name == "mvitv2_tiny":
        return  # global attention: no windows
    ops = [args for args in calls if len(args) == 7]  # (H, W, wh, ww, sh, sw, device)
    assert ops, calls
    for H, W, *window_and_shift, _ in ops:
        assert isinstance(H, torch.fx.Node) and isinstance(W, torch.fx.Node)  # the sizes are symbolic
        assert all(type(n) is int for n in window_and_shift), window_and_shift
    if name.startswith("swin"):
        assert {tuple(args[2:4]) for args in ops} == {(4, 4)}


# (A 16-25 s trace each on 2 CPU cores.) MViTv2 with global attention only is left out: the hybrid
# model attends globally from stage 2 with the same resampled tables; whole in an SMP model it compiles
# to one graph with eager's logits in tests/test_checkpoints_smp.py. Swin V1 is left out too: V2's
# blocks are V1's with cosine attention and Log-CPB added, and V1 compiles to one graph at six of these
# sizes on the GPU path below and at any size through compile_backbone (tests/test_compile_batch.py).
@pytest.mark.parametrize("name", ["swinv2_tiny", "mvitv2_tiny-windows"])
def test_dynamic_compile_does_not_recompile_at_new_sizes(name: str) -> None:
    """Through AOT autograd (``aot_eager``): its trace records every view's contiguity, a guard of its
    own. MViTv2's windowed attention cropped its padded output by a view, whose contiguity is whether
    the map tiles: one graph more at 200x232 (stage maps that need padding) that Dynamo's capture
    alone did not show. The crop is a negative pad under compile now.

    MViTv2's float32 CPU inference graph runs its attention with the decomposed term as the opaque op
    ``vtdense::decomposed_attention_cpu`` (the eager, query-chunked kernel). Inductor, left to build
    the whole term itself at symbolic sizes, spent 2.2 s of a 2.9 s MViTv2-T forward at 512x768
    (eager: 0.86 s). (Its training graph keeps the plain term:
    ``test_compiled_training_is_one_graph_with_stochastic_depth``.)

    The graph Dynamo hands to AOT autograd also keeps the window a constant
    (:func:`_assert_windows_are_constants`)."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = vtdense.create_backbone(name.split("-")[0], **FAMILIES[name]).eval()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=record)  # a graph break is an error
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
    assert ("vtdense.decomposed_attention_cpu" in "".join(str(gm.graph) for gm in graphs)) == name.startswith("mvitv2")
    _assert_windows_are_constants(name, graphs)


def _assert_compiled_training_is_one_graph_like_eager(name: str, sizes: list, **overrides: object) -> str:
    """Train-mode ``torch.compile(dynamic=True, fullgraph=True)`` of ``FAMILIES[name]`` (with
    ``overrides``): one Dynamo graph over all ``sizes``, and at each size the parameter gradients
    of eager from the same random draws. Returns the graph's text."""
    graphs: list[str] = []

    def record(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = vtdense.create_backbone(name.split("-")[0], **{**FAMILIES[name], **overrides}).train()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=record)
    for i, size in enumerate(sizes):
        x = torch.randn(2, 3, *size)
        grads = []
        for m in (compiled, model):
            model.zero_grad()
            torch.manual_seed(i)  # the same drop-path draws in both
            probe_loss(m(x)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):  # probe-loss gradients are of order 1e-3 to 1
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]
    return "\n".join(graphs)


# Swin V1 with stochastic depth: tests/test_compile_batch.py::test_one_training_graph_serves_batches_of_2_1_and_16.
@pytest.mark.parametrize("name", ["mvitv2_tiny-windows"])
def test_compiled_training_is_one_graph_with_stochastic_depth(name: str) -> None:
    """Training-mode compile (what ``compile_backbone`` does for a run) with drop-path rates that
    differ per block: one graph for the whole backbone at every size, and the losses and gradients
    of eager. (A graph break inside the blocks made Dynamo share one resume function between all
    blocks and guard on each block's rate: it recompiled per block, hit its recompile limit and
    ran the rest eagerly.)

    MViTv2's training graph keeps the plain decomposed term and SDPA (its CPU inference op has no
    backward)."""
    text = _assert_compiled_training_is_one_graph_like_eager(name, FIRST + MORE[:2], drop_path_rate=0.3)
    assert "decomposed_attention_cpu" not in text
    if name.startswith("mvitv2"):
        assert "scaled_dot_product_attention" in text


# Swin V2 for both Swin versions: its blocks read both floats that broke this (V1's blocks read the mask
# value only), and each training trace takes 10-20 s on 2 CPU cores.
@pytest.mark.parametrize("name", ["swinv2_tiny", "mvitv2_tiny-windows"])
def test_compiled_training_with_grad_checkpointing_is_one_graph(name: str) -> None:
    """``grad_checkpointing=True`` under ``torch.compile(dynamic=True, fullgraph=True)``: Dynamo traces
    every checkpointed block as its own region. A module-level float read inside them (the mask
    value, Swin V2's logit-scale cap) became a graph input that Dynamo could not lift into the
    second region ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer").
    One graph, eager's gradients, no recompilation over three sizes."""
    _assert_compiled_training_is_one_graph_like_eager(name, FIRST + MORE[:1], grad_checkpointing=True)


# MViTv2 on the GPU path in its hybrid-window form only, whose blocks from stage 2 on attend globally
# (each trace of these graphs takes 10-25 s on 2 CPU cores); the global form is compiled on the CPU path
# by the tests above and below. Swin V1 in eval only: its training graph's ops are all in V2's (V1's
# attention is V2's without the cosine and Log-CPB terms), and V1's GPU-path training graph is traced
# at changing batch sizes by tests/test_compile_batch.py.
@pytest.mark.parametrize("name,train", [
    pytest.param("swin_tiny", False, id="swin_tiny-eval"),
    pytest.param("swinv2_tiny", False, id="swinv2_tiny-eval"),
    pytest.param("swinv2_tiny", True, id="swinv2_tiny-train"),
    pytest.param("mvitv2_tiny-windows", False, id="mvitv2_tiny-windows-eval"),
    pytest.param("mvitv2_tiny-windows", True, id="mvitv2_tiny-windows-train"),
])
def test_gpu_code_path_under_autocast_compiles_to_one_graph_at_changing_sizes(
    name: str, train: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU compiles: attention's inputs laid out as on a GPU (row-padded terms, Swin V2's q
    and k written heads-first in bf16, SDPA rather than the CPU's opaque window op) under bf16
    autocast. ``dynamic=True, fullgraph=True``: one graph at the first size, none more over five
    other sizes, in eval and in training. Compiled outputs are eager's, and so is every parameter's
    gradient: to float32 rounding on the same path without autocast, parameter by parameter; under
    autocast, all gradients together within bf16's rounding of sums taken in another order (a few
    percent, up to 18% for single small parameters). Weights are random and of order one, so that no branch is too small to see. Only
    Inductor's code generation is left to a GPU (``benchmarks/gpu_check.py``)."""
    import vtdense.layers.attention as attention_mod
    from tests.test_swin import randomize_

    monkeypatch.setattr(attention_mod, "_GPU_LAYOUT_ON_CPU", True)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = randomize_(vtdense.create_backbone(name.split("-")[0], **FAMILIES[name]), std=0.1).train(train)
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="eager")

    def run(m: torch.nn.Module, x: torch.Tensor, bf16: bool = True) -> dict[str, torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16), torch.set_grad_enabled(train):
            out = m(x)
        assert all(o.dtype == (torch.bfloat16 if bf16 else torch.float32) for o in out.values())
        if not train:
            return {k: o.float() for k, o in out.items()}
        probe_loss(out).backward()
        # the keys' norm bias shifts every logit of a query alike: its true gradient is zero
        return {n: p.grad.clone() for n, p in model.named_parameters() if not n.endswith("norm_k.bias")}

    for size in [FIRST[0], *MORE]:
        x = torch.randn(1, 3, *size)
        got, eager = run(compiled, x), run(model, x)
        assert got.keys() == eager.keys()
        if not train:
            for k in eager:
                assert (got[k] - eager[k]).norm() <= 1e-2 * eager[k].norm(), (size, k)
            continue
        flat = [torch.cat([g[k].flatten() for k in eager]) for g in (got, eager)]
        assert (flat[0] - flat[1]).norm() <= 0.1 * flat[1].norm(), size  # MViTv2: 6%
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]
    if not train:
        return
    # per parameter, on the same path in float32 (autocast off is a new graph, compiled once here)
    for size in MORE[:2]:
        x = torch.randn(1, 3, *size)
        got, eager = run(compiled, x, bf16=False), run(model, x, bf16=False)
        for k in eager:
            assert eager[k].norm() > 0, k
            assert (got[k] - eager[k]).norm() <= 1e-5 * eager[k].norm(), (size, k)


def test_window_cache_ops_match_their_fake_shapes_and_hand_out_copies() -> None:
    """The custom ops that fetch the cached mask / indices inside graphs: their fake (symbolic-size)
    implementations agree with the real ones (``torch.library.opcheck``), their values are the
    eager functions', and each call returns fresh memory, so a graph reusing a dead buffer cannot
    write into the cache."""
    from vtdense.layers import windows

    assert windows.mask_value() == windows.MASK_VALUE  # the graph-safe literal and the public constant agree
    cpu = torch.device("cpu")
    for H, W, window, shift in ((14, 14, (7, 7), (3, 3)), (10, 13, (4, 4), (0, 0)), (8, 8, (4, 4), (0, 0))):
        args = (H, W, *window, *shift, cpu)
        torch.library.opcheck(windows._index_op, args)
        torch.library.opcheck(windows._mask_op, args)
        gather, scatter = windows._index_op(*args)
        g2, s2 = windows.window_token_index(H, W, window, shift)
        assert torch.equal(gather, g2) and torch.equal(scatter, s2)
        assert gather.data_ptr() != g2.data_ptr() and gather.data_ptr() != windows._index_op(*args)[0].data_ptr()
        mask = windows._mask_op(*args)
        eager = windows.window_attention_mask(H, W, window, shift)
        assert torch.equal(mask, eager if eager is not None else torch.zeros_like(mask))
        assert not mask.any() if eager is None else mask.data_ptr() != eager.data_ptr()


def test_while_a_cuda_graph_records_masks_and_indices_are_built_not_read_from_the_cache(monkeypatch) -> None:  # noqa: ANN001
    """A CUDA graph replays reads of the addresses it recorded, and a cache entry can be evicted (and
    its memory reused) before a replay: while recording, the eager functions and the compile ops
    build fresh tensors of the cached values and leave the caches alone. (Recording itself needs a
    GPU: ``benchmarks/gpu_check.py`` replays ``mode="reduce-overhead"`` graphs after the caches
    are emptied; here the recording state is simulated.)"""
    from vtdense.layers import tracing as tracing_state
    from vtdense.layers import windows

    cpu = torch.device("cpu")
    cases = ((14, 14, (7, 7), (3, 3)), (10, 13, (4, 4), (0, 0)), (8, 8, (4, 4), (0, 0)))
    cached = {c: (windows.window_attention_mask(*c), windows.window_token_index(*c)) for c in cases}
    sizes = (windows._window_mask_cached.cache_info().currsize, windows._token_index_cached.cache_info().currsize)
    monkeypatch.setattr(tracing_state, "cuda_graph_capturing", lambda device: True)
    for c, (mask, (gather, scatter)) in cached.items():
        H, W, window, shift = c
        fresh_mask, (g, s) = windows.window_attention_mask(*c), windows.window_token_index(*c)
        op_mask, (og, os_) = windows._mask_op(H, W, *window, *shift, cpu), windows._index_op(H, W, *window, *shift, cpu)
        assert (fresh_mask is None) == (mask is None)
        expected_op_mask = mask if mask is not None else torch.zeros_like(op_mask)
        assert torch.equal(op_mask, expected_op_mask)
        for new, old in ((fresh_mask, mask), (g, gather), (s, scatter), (og, gather), (os_, scatter)):
            if old is not None:
                assert torch.equal(new, old) and new.data_ptr() != old.data_ptr()
    sizes_after = (windows._window_mask_cached.cache_info().currsize, windows._token_index_cached.cache_info().currsize)
    assert sizes_after == sizes


def test_on_a_cuda_side_stream_the_compile_ops_build_their_tables_uncached(monkeypatch) -> None:  # noqa: ANN001
    """``torch.compile(mode="reduce-overhead")`` warms up on a stream of its own whose allocations
    come from the CUDA graphs' private pool; a table cached there outlives the graph in the pool
    (on an H200: "tensors in the cudagraph pool not tracked as outputs"). Off the device's default
    stream the ops inside compiled graphs build their tables per call. (The streams are simulated:
    the pool itself needs a GPU.)"""
    from vtdense.layers import windows

    default, side = object(), object()
    current = [default]
    monkeypatch.setattr(windows, "fresh_tables", lambda device: False)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    cuda = torch.device("cuda")
    assert not windows._op_fresh(cuda)
    current[0] = side
    assert windows._op_fresh(cuda)
    assert not windows._op_fresh(torch.device("cpu"))  # streams are a CUDA matter

    monkeypatch.setattr(windows, "_op_fresh", lambda device: True)
    cpu = torch.device("cpu")
    H, W, window, shift = 15, 17, (4, 4), (2, 2)  # sizes no other test caches
    sizes = (windows._window_mask_cached.cache_info().currsize, windows._token_index_cached.cache_info().currsize)
    mask = windows._mask_op(H, W, *window, *shift, cpu)
    gather, scatter = windows._index_op(H, W, *window, *shift, cpu)
    assert sizes == (windows._window_mask_cached.cache_info().currsize, windows._token_index_cached.cache_info().currsize)
    assert torch.equal(mask, windows._window_mask_cached.__wrapped__(H, W, window, shift, cpu))
    g2, s2 = windows._token_index_cached.__wrapped__(H, W, window, shift, cpu)
    assert torch.equal(gather, g2) and torch.equal(scatter, s2)


def test_while_a_cuda_graph_records_position_tables_and_biases_are_built_not_read_from_a_cache(monkeypatch) -> None:  # noqa: ANN001
    """The same for the other size-dependent tables that eager code (a ``torch.cuda.graph`` of an
    eager model) reads from caches: Swin's relative-position index, Swin V2's Log-CPB coordinates,
    the per-module position bias, MViTv2's decomposed index and its one-hot key columns."""
    from vtdense.layers import position
    from vtdense.layers import tracing as tracing_state

    table = torch.randn(13, 4)
    q, k = torch.randn(1, 2, 12, 4), torch.randn(1, 2, 6, 4)
    calls = {
        "relative_position_index": (position._rel_index_cached, lambda: position.relative_position_index((4, 4), (4, 4))),
        "log_cpb_coords": (position._log_cpb_coords, lambda: position.log_cpb_coords((4, 4), (8, 8))),
        "decomposed index": (position._decomposed_index, lambda: position.rel_pos_lookup(7, 4, table)),
        "key one-hot": (position._key_one_hot,
                        lambda: position.decomposed_rel_pos_fold(q, k, table, table, (3, 4), (2, 3), 0.5)[1]),
    }
    blocks = [vtdense.create_backbone(v, **TINY).eval().layers[0].blocks[0].attn for v in ("swin_tiny", "swinv2_tiny")]
    with torch.no_grad():
        cached = {name: fn() for name, (_, fn) in calls.items()}
        biases = [b.cached_position_bias((4, 4), torch.float32) for b in blocks]
        stats = {name: cache.cache_info() for name, (cache, _) in calls.items()}
        monkeypatch.setattr(tracing_state, "cuda_graph_capturing", lambda device: True)
        for name, (cache, fn) in calls.items():
            fresh = fn()
            assert torch.equal(fresh, cached[name]), name
            if name != "key one-hot":  # (that one is expanded and concatenated into k')
                assert fresh.data_ptr() != cached[name].data_ptr(), name
            assert cache.cache_info() == stats[name], f"{name}: the cache was read while recording"
        for block, bias in zip(blocks, biases):
            fresh = block.cached_position_bias((4, 4), torch.float32)
            assert torch.equal(fresh, bias) and fresh.data_ptr() != bias.data_ptr()


@pytest.mark.parametrize("version", ["swin_tiny", "swinv2_tiny"])
def test_compiled_cpu_inference_calls_the_eager_kernels(version: str) -> None:
    """Compiled float32 CPU inference calls the kernels eager inference runs (oneDNN linear layers,
    window attention image by image, the MLP over row chunks) as opaque ops, and gives eager's maps;
    with gradients it keeps SDPA and the plain layers (the ops have no backward)."""
    from vtdense.layers.cpu_linear import use_cpu_matmul

    torch.manual_seed(0)
    model = vtdense.create_backbone(version, **TINY).eval()
    x = torch.randn(2, 3, 72, 88)
    with use_cpu_matmul("onednn"):
        text, got = _graph_text(model, x)
        with torch.no_grad():
            expected = model(x)
        assert "vtdense.window_attention_cpu" in text and "vtdense.onednn_linear" in text
        # every block's MLP as one op, over eager's row chunks (no hidden activation of the whole batch)
        assert text.count("vtdense.cpu_mlp") == sum(TINY["depths"])
        assert "scaled_dot_product_attention" not in text and "gelu" not in text
        for k in got:
            torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-5)
        text, _ = _graph_text(model, x, train=True)
        assert "scaled_dot_product_attention" in text and "window_attention_cpu" not in text and "cpu_mlp" not in text


def _graph_text(model: torch.nn.Module, x: torch.Tensor, train: bool = False, **options: object) -> tuple[str, dict]:
    """Compile ``model`` afresh with a backend that records Dynamo's graphs and run it on ``x``, without
    gradients or (``train``) with a backward pass: (the graphs' text, the outputs)."""
    graphs: list[str] = []

    def record(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=record, **options)
    if train:
        out = compiled(x)
        sum(f.sum() for f in out.values()).backward()
    else:
        with torch.no_grad():
            out = compiled(x)
    return "\n".join(graphs), out


def test_the_decomposed_attention_ops_fake_implementation_agrees_with_the_real_one() -> None:
    """``vtdense::decomposed_attention_cpu``, the op MViTv2's compiled CPU inference calls
    (``test_dynamic_compile_does_not_recompile_at_new_sizes``): its fake (symbolic-size)
    implementation agrees with the real one, with and without key terms."""
    from vtdense.layers import decomposed_attention

    g = torch.Generator().manual_seed(0)
    qs, ks, vs = (torch.randn(1, 2, 2, n, 8, generator=g) for n in (12, 6, 6))
    tables = (torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g))
    keys = (torch.zeros(2, 1, 1, 1, 2), torch.zeros(2, 1, 1, 1, 3))
    for key_h, key_w in ((None, None), keys):
        torch.library.opcheck(decomposed_attention._op, (qs, ks, vs, *tables, [3, 4], [2, 3], [4, 4, 2, 3], key_h, key_w))


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


# ----------------------------------------------------------------------------- compile_backbone
# Dynamo's own capture (``backend="eager"``) runs the traced ops eagerly: what these tests check is
# the wiring (which part compiles, in place, for all sizes), not Inductor's code generation, which
# ``benchmarks/gpu_check.py`` times on a GPU.
DET_BACKBONE = dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=4, drop_path_rate=0.0)
DET_SLIM = dict(fpn_channels=32, slim_heads=True, mask_head_channels=16, mask_head_layers=1, box_head_width=64)


def _detector() -> torch.nn.Module:
    from vtdense.models.detection import build_detector

    torch.manual_seed(0)
    return build_detector("swin_tiny", "mask_rcnn", 2, backbone_kwargs=DET_BACKBONE, **DET_SLIM).train()


def _segmentor() -> torch.nn.Module:
    from vtdense.models.segmentation import build_segmentor

    torch.manual_seed(0)
    return build_segmentor("fpn", "swinv2_tiny", 3, backbone_kwargs=TINY, decoder_segmentation_channels=32,
                           decoder_pyramid_channels=32).train()


def test_compile_backbone_compiles_the_backbone_part_in_place_and_trains_like_eager() -> None:
    """The detector's backbone + FPN (and a segmentor's encoder) run compiled with the same
    parameter names, outputs, losses and gradients as eager."""
    import copy

    from vtdense.models.compile import backbone_module, compile_backbone, is_compiled

    torch._dynamo.reset()
    counters.clear()
    det = _detector()
    twin = copy.deepcopy(det)
    part = compile_backbone(twin, "eager", dynamic=False)  # dynamic sizes: the tests above
    assert part is twin.backbone and is_compiled(twin) == "eager" and is_compiled(det) is None
    assert list(twin.state_dict()) == list(det.state_dict())  # checkpoints are unchanged
    images = [torch.rand(3, 128, 160), torch.rand(3, 150, 120)]
    targets = [
        {"boxes": torch.tensor([[10.0, 12.0, 70.0, 90.0]]), "labels": torch.tensor([1]),
         "masks": torch.zeros(1, 128, 160, dtype=torch.uint8)},
        {"boxes": torch.tensor([[5.0, 20.0, 100.0, 60.0]]), "labels": torch.tensor([2]),
         "masks": torch.ones(1, 150, 120, dtype=torch.uint8)},
    ]
    losses = []
    for model in (det, twin):
        torch.manual_seed(1)  # the RPN / RoI samplers draw from the global generator
        out = model(images, targets)
        sum(out.values()).backward()
        losses.append(out)
    assert counters["stats"]["unique_graphs"] > 0  # the compiled copy went through Dynamo
    for k in losses[0]:
        assert torch.allclose(losses[0][k], losses[1][k], rtol=1e-5, atol=1e-6), k
    for (name, p), q in zip(backbone_module(det).named_parameters(), backbone_module(twin).parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name

    # an SMP segmentor compiles its encoder (the same vtdense backbone the detector part ran above)
    seg = _segmentor()
    assert compile_backbone(seg, None) is seg.encoder and is_compiled(seg) is None
    assert compile_backbone(seg, "eager") is seg.encoder and is_compiled(seg) == "eager"
    assert is_compiled(seg.segmentation_head) is None


def test_compile_backbone_refuses_the_eager_backend_for_random_checkpointed_blocks() -> None:
    """With the ``eager`` backend, torch recomputes checkpointed blocks with new random draws (drop
    path), so gradients differ from eager (measured: relative error about 1); ``aot_eager`` and
    Inductor restore the random state (1.6e-7). ``compile_backbone`` refuses that combination
    before anything runs, and accepts it with the other backends or without checkpointing."""
    from vtdense.models.compile import compile_backbone, is_compiled

    kwargs = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.2)
    risky = vtdense.create_backbone("swin_tiny", grad_checkpointing=True, **kwargs)
    with pytest.raises(ValueError, match="backend 'eager' cannot compile a backbone that recomputes random blocks"):
        compile_backbone(risky, "eager")
    assert is_compiled(risky) is None
    assert compile_backbone(risky, "aot_eager") is risky and is_compiled(risky) == "aot_eager"
    plain = vtdense.create_backbone("swin_tiny", **kwargs)  # no checkpointing: nothing is recomputed
    assert compile_backbone(plain, "eager") is plain and is_compiled(plain) == "eager"


def test_compile_backbone_option_is_checked_before_the_run() -> None:
    from vtdense.models.compile import backbone_module, check_compile_option, is_compiled
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    assert check_compile_option(True) == "inductor" and check_compile_option("false") is None
    assert check_compile_option(False) is None and check_compile_option("aot_eager") == "aot_eager"
    with pytest.raises(ValueError, match=r"compile_backbone='inductr' is not a torch.compile backend.*inductor"):
        DetectionTask(backbone="swin_tiny", num_classes=2, compile_backbone="inductr")
    with pytest.raises(ValueError, match=r"compile_backbone must be a bool or a torch.compile backend name"):
        SegmentationTask(backbone="swin_tiny", num_classes=2, compile_backbone=3)

    # Lightning's configure_model hook compiles the backbone part once, whatever the stage
    tasks = {
        "eager": DetectionTask(backbone="swin_tiny", backbone_kwargs=DET_BACKBONE, num_classes=2, compile_backbone="eager",
                               **DET_SLIM),
        "inductor": SegmentationTask(backbone="swinv2_tiny", backbone_kwargs=TINY, num_classes=3, compile_backbone=True,
                                     arch_kwargs={"decoder_channels": 8}, aux_channels=8),
    }
    for backend, task in tasks.items():
        if task.model is None:
            task.build()
        assert is_compiled(task.model) is None
        keys = list(task.state_dict())
        task.configure_model()
        assert is_compiled(task.model) == backend
        part = backbone_module(task.model)
        assert part is (task.model.backbone if isinstance(task, DetectionTask) else task.model.encoder)
        compiled = part._compiled_call_impl
        task.configure_model()  # idempotent
        assert compiled is not None and part._compiled_call_impl is compiled and list(task.state_dict()) == keys


def test_compiled_cpu_mlp_op_equals_the_layers_and_takes_an_empty_batch() -> None:
    """``vtdense::cpu_mlp`` (compiled float32 CPU inference's MLP, over eager's row chunks): the plain
    layers' values with and without a pre-norm, for more rows than one chunk, and no rows at all."""
    from vtdense.layers.compiled_mlp import compiled_cpu_mlp
    from vtdense.layers.cpu_linear import use_cpu_matmul
    from vtdense.layers.mlp import Mlp

    torch.manual_seed(0)
    mlp, norm = Mlp(24, 96).eval(), torch.nn.LayerNorm(24)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(3, 40000, 24)  # 120000 rows of 96 hidden floats: several 8 MiB chunks
    with use_cpu_matmul("onednn"), torch.no_grad():
        for n in (norm, None):
            ref = mlp.fc2(F.gelu(mlp.fc1(n(x) if n is not None else x)))
            torch.testing.assert_close(compiled_cpu_mlp(x, mlp, n), ref, rtol=1e-5, atol=1e-5)
        assert compiled_cpu_mlp(x[:0], mlp, norm).shape == (0, 40000, 24)
