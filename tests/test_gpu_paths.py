"""The backbones' GPU code paths, run here without a GPU.

CI has no GPU, so code behind ``device.type != "cpu"`` would otherwise only run in the rare session
that is lent one. On fake CUDA tensors (``FakeTensorMode``: a CUDA device, shapes, dtypes and
strides, no kernel; ``benchmarks/launches.py``) with CUDA autocast switched on directly, every
family runs its GPU paths in eval and training, in fp32 and under bf16 autocast, and these tests
check what that can show: every attention call is one that SDPA's fused kernels take, its additive
term is laid out so that SDPA reads it in place (no pad and copy in every call), and no activation
is cast to the same dtype twice in a forward. The values of the GPU layout are checked on the CPU
with it forced (``gpu_layout``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import vtdense
from vtdense.layers import attention as attention_mod
from vtdense.models.detection import build_detector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import launches  # noqa: E402

from tests.test_swin import randomize_  # noqa: E402

# the Swin bias cache stamps weights with data_ptr(), which fake tensors warn about (and which is unused there)
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")

# Fake CUDA tensors without a GPU work from torch 2.11 (CI runs 2.14). On 2.9 moving a module to a fake
# "cuda" device reaches the CUDA runtime, which fails without a driver; vtdense itself passes the rest
# of the suite there.
fake_cuda = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11),
    reason=f"fake CUDA tensors need torch >= 2.11 on a machine without a GPU (this is {torch.__version__})",
)

TINY = dict(depths=(1, 2, 1, 1), drop_path_rate=0.0)
FAMILIES = {
    "swin": ("swin_tiny", dict(TINY, embed_dim=32, num_heads=(1, 2, 4, 8))),
    "swinv2": ("swinv2_tiny", dict(TINY, embed_dim=32, num_heads=(1, 2, 4, 8))),
    "mvitv2": ("mvitv2_tiny", dict(TINY, embed_dim=32)),
    "mvitv2_windows": ("mvitv2_tiny", dict(TINY, embed_dim=32, window_size=16)),
}
SIZE = (100, 132)  # not a multiple of any window: padding masks in every stage, and shifts


def _tiny(family: str) -> torch.nn.Module:
    name, kw = FAMILIES[family]
    return vtdense.create_backbone(name, **kw)


@fake_cuda
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_paths_run_with_fused_attention_and_no_repeated_cast(family: str, train: bool, dtype) -> None:
    count = launches.count_forward(_tiny(family), lambda: torch.randn(2, 3, *SIZE, device="cuda"), train=train,
                                   dtype=dtype)
    assert count.attention, "no attention call was seen"
    for call in count.attention:
        assert call.fused, f"{family}: attention of q {call.q_shape} ({call.dtypes}) would take the math path: {call.reason}"
        assert not call.mask_copied, f"{family}: SDPA would copy the term of q {call.q_shape} in every call"
        if dtype is not None:
            assert set(call.dtypes) <= {"bfloat16", "none"}, call
    # MViTv2: the outputs of stages 1-3 are read by their out_norm and the next stage's norm1, two
    # LayerNorms, which autocast runs in fp32 (one cast each; Swin's next stage norms a merged copy)
    allowed = 3 if family.startswith("mvitv2") and dtype is not None else 0
    assert count.recasts == allowed, f"{family}: {count.recasts} activations cast again to a dtype they were already cast to"
    assert count.casts == 0 or dtype is not None or family == "mvitv2_windows"  # fp32: only bool masks made float


@fake_cuda
@pytest.mark.parametrize("model", ["mask_rcnn backbone + FPN", "upernet", "fpn"])
def test_gpu_paths_of_the_models_on_the_backbones(model: str) -> None:
    """The detector's backbone + FPN (its heads make data-dependent shapes, which fake tensors
    cannot follow) and SMP's UPerNet / FPN around a vtdense encoder, training under bf16 autocast."""
    from vtdense.models.segmentation import build_segmentor

    name, kw = FAMILIES["swin"]
    if model.startswith("mask_rcnn"):
        net = build_detector(name, "mask_rcnn", backbone_kwargs=kw, num_classes=3, fpn_channels=32).backbone
    else:
        net = build_segmentor(model, name, 5, backbone_kwargs=kw)
    count = launches.count_forward(net, lambda: torch.randn(2, 3, 96, 128, device="cuda"), train=True,
                                   dtype=torch.bfloat16)
    assert count.attention and all(c.fused and not c.mask_copied for c in count.attention)
    assert count.recasts <= (1 if model == "upernet" else 0)  # UPerNet: one in SMP's decoder


@fake_cuda
def test_bias_path_casts_q_once_under_autocast() -> None:
    """MViTv2's decomposed term reads ``q`` in two products and SDPA reads it once more; before,
    autocast cast it for each (and the q/k/v products cast their common input three times)."""
    model = _tiny("mvitv2")
    blocks = sum(1 for m in model.modules() if type(m).__name__ == "MultiScaleAttention")
    count = launches.count_forward(model, lambda: torch.randn(2, 3, *SIZE, device="cuda"), train=False,
                                   dtype=torch.bfloat16)
    assert len(count.attention) == blocks and count.recasts == 3  # 3: the stage outputs, see above


@fake_cuda
def test_weight_casts_are_counted_apart_from_the_activations() -> None:
    """``launches.Count.weight_casts``: a bf16 training forward casts every projection's and conv's
    weight and bias once (autocast's cast, which the backward mirrors with one more kernel each); in
    inference the projections' cast copies are kept across forwards, and only the patch embedding's
    conv is cast again."""
    def swin() -> torch.nn.Module:
        return vtdense.create_backbone("swin_tiny", **dict(TINY, embed_dim=32, num_heads=(1, 2, 4, 8)))

    layers = [m for m in swin().modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    per_forward = sum(1 + (m.bias is not None) for m in layers)
    for train, expected in ((True, per_forward), (False, 2)):
        count = launches.count_forward(swin(), lambda: torch.randn(2, 3, *SIZE, device="cuda"), train=train,
                                       dtype=torch.bfloat16)
        assert count.weight_casts == expected, (train, count.weight_casts, count.casts)
        assert count.casts > count.weight_casts  # the norms' float32 outputs cast for the next projection
    fp32 = launches.count_forward(swin(), lambda: torch.randn(2, 3, *SIZE, device="cuda"), train=True, dtype=None)
    assert fp32.weight_casts == 0


@fake_cuda
def test_eval_terms_of_swin_are_built_in_one_pass() -> None:
    """At a size that needs no image padding, a Swin forward on a GPU pads nothing: the masked
    blocks' terms are written straight into row-padded buffers (they were padded twice, then summed)."""
    count = launches.count_forward(vtdense.create_backbone("swin_tiny", **dict(TINY, embed_dim=32, num_heads=(1, 2, 4, 8))),
                                   lambda: torch.randn(2, 3, 224, 224, device="cuda"), train=False,
                                   dtype=torch.bfloat16)
    assert count.ops["constant_pad_nd"] == 0, count.ops
    # the one shifted block (stage 2, 28x28; maps of 7-multiples need no padding): bias copied, mask filled in
    assert count.ops["masked_fill_"] == 1 and count.ops["where"] == 0


def _terms_seen(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    real = attention_mod.attention

    def spy(q, k, v, mask=None, *args, **kwargs):
        if mask is not None:
            seen.append(mask)
        return real(q, k, v, mask, *args, **kwargs)

    for mod in ("vtdense.backbones.swin", "vtdense.backbones.mvitv2"):
        monkeypatch.setattr(f"{mod}.attention", spy)
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_row_padded_terms_give_the_same_values(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU layout of the additive terms (rows padded to 16 entries), forced on the CPU: the same
    features and gradients as the plain layout, and every term reaching attention is aligned."""
    from vtdense.layers.chunked import cpu_chunking

    torch.manual_seed(0)
    model = randomize_(_tiny(family), 0, std=0.1)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))

    def run(train: bool) -> list[torch.Tensor]:
        model.train(train)
        model.zero_grad()
        for m in model.modules():  # Swin's cached biases: built in the layout in force
            if hasattr(m, "_bias_cache"):
                m._bias_cache.clear()
        with cpu_chunking(False), torch.set_grad_enabled(train):  # the unchunked path GPUs run
            feats = list(model(x).values())
        if not train:
            return [f.detach() for f in feats]
        sum((f * f).mean() for f in feats).backward()
        return [f.detach() for f in feats] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = {t: run(t) for t in (False, True)}
    seen = _terms_seen(monkeypatch)
    monkeypatch.setattr(attention_mod, "_GPU_LAYOUT_ON_CPU", True)
    for train in (False, True):
        seen.clear()
        got = run(train)
        for a, b in zip(got, plain[train]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        unaligned = [t for t in seen if t.shape[-1] % 16 and any(s % 16 for s in t.stride()[:-1])]
        assert not unaligned, [(tuple(t.shape), t.stride()) for t in unaligned]
        # MViTv2 trains with its positions folded into q and k: no term (rel_pos_fold=False keeps
        # a term made by autograd ops, which SDPA pads in each call)
        assert seen or (train and family.startswith("mvitv2"))



@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("per_window", [False, True])
def test_swinv2_scaled_qk_written_in_the_compute_dtype_gives_the_same_bits(
        grad: bool, per_window: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Swin V2's q and k times their float32 cosine factor (a norm, float32 under CUDA autocast),
    written heads-first straight into bf16 (the GPU layout, forced on the CPU): the same bits as
    the float32 product that autocast cast to bf16 for SDPA before, and the same gradients."""
    from vtdense.backbones.swin import _scaled_heads_first

    g = torch.Generator().manual_seed(0)
    B, nW, N, h, d = 2, 3, 16, 2, 8
    term = torch.zeros((nW, h, N, N) if per_window else (h, N, N))
    upstream = torch.randn(2, B, nW, h, N, d, generator=g).bfloat16()

    def run(gpu: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(attention_mod, "_GPU_LAYOUT_ON_CPU", gpu)
        qk = torch.randn(B, nW, N, 2, h, d, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_(grad)
        factor = torch.rand(B, nW, N, 2, h, 1, generator=torch.Generator().manual_seed(2)).add(0.5).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = _scaled_heads_first(qk, factor, term)
            if gpu:
                assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.requires_grad == grad
            else:
                assert out.dtype == torch.float32  # autocast casts it for SDPA
                out = out.to(torch.bfloat16)
        if not grad:
            return [out]
        out.backward(upstream)
        return [out.detach(), qk.grad, factor.grad]

    plain, gpu = run(False), run(True)
    for a, b in zip(gpu, plain):
        assert a.dtype == b.dtype and torch.equal(a, b)


@fake_cuda
def test_launches_report(tmp_path: Path) -> None:
    import timm

    case = ("tiny Swin inference", False, 2, (64, 64), {
        "vtdense": lambda: vtdense.create_backbone("swin_tiny", **dict(TINY, embed_dim=32, num_heads=(1, 2, 4, 8))),
        "timm fused": lambda: launches._fuse(timm.create_model(
            "swin_tiny_patch4_window7_224", features_only=True, img_size=(64, 64), embed_dim=32, depths=(1, 2, 1, 1),
            num_heads=(1, 2, 4, 8))),
    })
    rows = launches.run([case])
    assert [(r["contender"], r["dtype"]) for r in rows] == [
        ("vtdense", "bf16"), ("vtdense", "fp32"), ("timm fused", "bf16"), ("timm fused", "fp32")]
    for r in rows:
        assert r["total"] > 0 and r["attention"] == r["fused"] > 0
        assert (r["casts"] > 0) == (r["dtype"] == "bf16")
    text = launches.markdown(rows)
    assert text.count("\n| tiny Swin inference |") == 4
    assert all(r["memory_mib"] > 0 and not r["train"] for r in rows) and text.count(" peak |") == 4
    out = tmp_path / "RESULTS.md"
    out.write_text("# head\n")
    launches.write_section("one", out)
    launches.write_section("two", out)
    body = out.read_text()
    assert body.startswith("# head\n") and "two" in body and "one" not in body


@fake_cuda
def test_stand_in_sends_a_transposed_mask_to_the_math_path() -> None:
    """GPU backends of SDPA require a unit-stride last dim of the mask as of q, k, v (torch's
    ``check_last_dim_stride_equals_1_dense``); the stand-in must report such a call as unfused, as
    the H100 ran 7 of 12 Swin-T calls on d3d489e, whose bias was a transposed view."""
    import torch.nn.functional as F

    with launches.fake_cuda() as calls:
        q = torch.randn(4, 3, 49, 32, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(49, 49, 3, device="cuda", dtype=torch.bfloat16)
        for mask in (bias.permute(2, 0, 1)[None], bias.permute(2, 0, 1).contiguous()[None]):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert [c.fused for c in calls] == [False, True]
    assert calls[0].reason == "a mask whose last dim has stride != 1"
    assert calls[1].mask_copied  # 49-entry rows: SDPA pads them (a copy), but the kernel is fused


class _Steps(torch.nn.Module):
    """Known memory: two 4 MiB temporaries alive at once, views and in-place writes that
    allocate nothing, and one 4 MiB tensor saved for the backward pass (``sin``'s input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2  # 4 MiB
        a.add_(1).view(-1)  # in place, a view: nothing new
        b = a.sin()  # 4 MiB (a saved for sin's backward)
        del a
        c = b * 3  # 4 MiB, b still alive: 8 MiB at most so far (a freed)
        return c


@fake_cuda
@pytest.mark.parametrize("train", [False, True])
def test_launches_memory_follows_storages(train: bool) -> None:
    count = launches.count_forward(_Steps(), lambda: torch.randn(1024, 1024, device="cuda", requires_grad=train),
                                   train=train, dtype=None)
    mib = 2**20
    if train:  # autograd keeps a (for sin) alive: a, b, c at once
        assert count.saved_bytes == 4 * mib and count.peak_bytes >= 8 * mib
    else:
        assert count.peak_bytes == 8 * mib and count.saved_bytes == 0
    assert count.ops["mul"] == 2 and count.ops["add_"] == 1 and count.ops["sin"] == 1

@fake_cuda
def test_drop_path_residual_is_one_draw_and_one_addcmul_on_a_gpu() -> None:
    """Stochastic depth on a GPU in training: the residual sum with the per-sample draws is two
    kernels (it was four: draw, scale, product, sum)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vtdense.layers.drop import DropPath, residual

    count = launches.Count()
    with FakeTensorMode():
        drop = DropPath(0.3).train().to("cuda")  # (its keep probability lives on the device)
        x, branch = torch.randn(4, 5, 6, device="cuda"), torch.randn(4, 5, 6, device="cuda")
        with launches._Recorder(count):
            out = residual(x, drop, branch)
    assert out.shape == x.shape
    assert dict(count.ops) == {"bernoulli_": 1, "addcmul": 1}, count.ops


def test_drop_path_residual_calls_a_replaced_or_hooked_module() -> None:
    from vtdense.layers.drop import DropPath, residual

    torch.manual_seed(0)
    x, branch = torch.randn(8, 3), torch.randn(8, 3)
    torch.testing.assert_close(residual(x, torch.nn.Identity(), branch), x + branch)
    drop = DropPath(0.5).train()
    calls = []
    drop.register_forward_hook(lambda m, i, o: calls.append(o))
    torch.manual_seed(1)
    out = residual(x, drop, branch)
    torch.manual_seed(1)
    assert calls and torch.equal(out, x + DropPath(0.5).train()(branch))
    assert torch.equal(residual(x, DropPath(0.5).eval(), branch), x + branch)


@fake_cuda
def test_mask_head_sees_padded_roi_batches_on_a_gpu() -> None:
    """The published default pads the mask branch's RoI batch on CUDA (vtdense.models.mask_rois)."""
    heads = build_detector("swin_tiny", "mask_rcnn", 3, fpn_channels=32, slim_heads=True,
                           backbone_kwargs=FAMILIES["swin"][1]).roi_heads
    seen: list[int] = []
    heads.mask_head.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    with launches.fake_cuda():
        head, predictor = heads.mask_head.to("cuda"), heads.mask_predictor.to("cuda")
        for rows in (5, 32, 33, 0):
            logits = predictor(head(torch.randn(rows, 32, 14, 14, device="cuda")))
            assert logits.shape == (rows, 4, 28, 28) and logits.is_cuda
    assert seen == [32, 32, 64, 0]


def _slot_major_attention(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Swin's ``attention`` returning its values laid out as SDPA's fused CUDA kernels lay them
    out with the windows folded into the heads: ``(B, N, nW, heads, d)`` in memory (seen on fake
    CUDA tensors). Returns a list that counts the calls so laid out."""
    import vtdense.backbones.swin as swin_mod

    real = swin_mod.attention
    calls: list[int] = []

    def gpu_like(q, k, v, mask=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real(q, k, v, mask, *args, **kwargs)  # (B, nW, heads, N, d)
        if out.dim() != 5:
            return out
        calls.append(1)
        return out.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4)

    monkeypatch.setattr(swin_mod, "attention", gpu_like)
    return calls


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_projection_on_slot_major_attention_rows_gives_the_same_bits(name: str, train: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where attention's output lies slot-major (as SDPA's GPU kernels write it), Swin projects
    those rows where they lie and gathers its tokens with :func:`slot_major_scatter`: outputs and
    the input's gradient equal the window-major path's bit for bit (shifts and padding masks
    included); the weights' gradients, sums over rows taken in another order, to float rounding."""
    from vtdense.layers.chunked import cpu_chunking

    def run(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1), requires_grad=train)
        with torch.set_grad_enabled(train), cpu_chunking(False):
            outs = list(model(x).values())
        grads = []
        if train:
            sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
            grads = [x.grad] + [p.grad for p in model.parameters()]
        return outs, grads

    monkeypatch.setattr(attention_mod, "_GPU_LAYOUT_ON_CPU", True)  # windows folded into the heads
    kw = dict(FAMILIES["swin" if name == "swin_tiny" else "swinv2"][1])
    torch.manual_seed(0)
    model = randomize_(vtdense.create_backbone(name, **kw)).train(train)
    want = run(model)
    for p in model.parameters():
        p.grad = None
    calls = _slot_major_attention(monkeypatch)
    got = run(model)
    assert calls, "no attention call took the slot-major layout"
    for a, b in zip(want[0] + want[1][:1], got[0] + got[1][:1]):  # outputs and the input's gradient
        assert torch.equal(a, b)
    # the weights' gradients sum over the rows, whose order differs: equal to float32 rounding
    for a, b in zip(want[1][1:], got[1][1:]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max())), float((a - b).abs().max())


@fake_cuda
def test_swin_copies_no_attention_output_before_its_projection_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On fake CUDA tensors (SDPA's GPU layouts): a Swin block whose windows fold into the heads
    copies q, k and v once for that, and nothing after attention. Its output was copied into window
    order before the projection, one clone more per such block (counted with the slot-major path
    switched off)."""
    import vtdense.backbones.swin as swin_mod

    def clones(train: bool) -> int:
        model = vtdense.create_backbone("swin_tiny", **dict(TINY, embed_dim=32, num_heads=(1, 2, 4, 8)))
        count = launches.count_forward(model, lambda: torch.randn(2, 3, *SIZE, device="cuda"), train=train,
                                       dtype=torch.bfloat16)
        return count.ops["clone"]

    for train in (False, True):
        now = clones(train)
        with monkeypatch.context() as m:
            m.setattr(swin_mod, "slot_major", lambda t: False)
            before = clones(train)
        folded = before - now  # blocks that took the slot-major path: one clone fewer each
        assert folded >= 3, (train, before, now)
        # left: one fold of q, k, v per such block, the 4 stage outputs made NCHW, 3 patch mergings' 2x2 gathers
        assert now == folded + 4 + 3, (train, before, now)
