"""``vtdense.layers.triton_window_attention``: Swin's training attention (V1, and V2's scaled cosine)
in two Triton kernels.

The kernels run here in Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``): their
output and the gradients of q, k, v, the bias and V2's logit scale match attention computed in
float64, in float32 to float rounding and in bf16 within its rounding, with and without a shift
mask; a Swin V1 or V2 trained through them gets the default path's outputs and gradients. Both
kernels also compile for sm_90 (the H100/H200) here. Where they apply, a failing kernel's fallback
and their count on fake CUDA are checked in this process."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import GPU_TIMING_STUB, run_interpreted

from vtdense.layers import triton_window_attention as twa

KERNEL_CHECK = textwrap.dedent("""
    import json, math, torch
    from vtdense.layers import triton_window_attention as twa
    from vtdense.layers.triton_window_attention import window_attention
    torch.manual_seed(0)
    # several windows per backward program, as at real sizes (Swin-T's first stage: 25 at batch 8 and
    # 512x768), the last program's run short: 3 programs for 4-12 (window, head) pairs
    twa._BACKWARD_PROGRAMS = 3

    def reference(qkv, bias, mask, scale, h, logit=None):
        # the attention as vtdense's math path computes it, in float64 (Swin V2's scaled cosine with a logit scale)
        B, nW, N, C3 = qkv.shape
        C = C3 // 3
        q, k, v = qkv.double().view(B, nW, N, 3, h, C // h).permute(3, 0, 1, 4, 2, 5).unbind(0)
        if logit is not None:
            q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            scale = torch.clamp(logit.double(), max=math.log(100)).exp().view(1, 1, h, 1, 1)
        t = bias.double()[None, None]
        if mask is not None:
            t = torch.where(mask[None, :, None], torch.tensor(-1e4, dtype=torch.float64), t)
        o = ((q @ k.transpose(-1, -2)) * scale + t).softmax(-1) @ v
        return o.transpose(2, 3).reshape(B, nW, N, C)

    rows = []
    for B, nW, N, h, d, masked, dtype, bias_grad, logits in [
            (2, 3, 49, 2, 16, True, torch.float32, True, None), (1, 4, 16, 3, 32, False, torch.float32, True, None),
            (1, 2, 64, 1, 64, True, torch.float32, False, None), (2, 3, 49, 2, 32, True, torch.bfloat16, True, None),
            (1, 2, 9, 2, 16, False, torch.bfloat16, True, None),
            # Swin V2: one logit scale above the clamp (no gradient), one at timm's initial log(10)
            (2, 3, 49, 2, 16, True, torch.float32, True, [math.log(10), 5.0]),
            (1, 2, 64, 3, 32, False, torch.float32, True, [2.0, -1.0, 4.5]),
            (2, 3, 49, 2, 32, True, torch.bfloat16, True, [math.log(10), 1.0])]:
        qkv0 = torch.randn(B, nW, N, 3 * h * d).to(dtype)
        bias0 = torch.randn(h, N, N)
        mask = (torch.rand(nW, N, N) < 0.3) if masked else None
        if mask is not None:
            mask[:, :, 0] = False  # no row wholly blocked (Swin's never is: a token sees itself)
        up = torch.randn(B, nW, N, h * d).to(dtype)
        qkv, bias = qkv0.clone().requires_grad_(), bias0.clone().requires_grad_(bias_grad)
        logit0 = torch.tensor(logits).view(h, 1, 1) if logits else None
        logit = logit0.clone().requires_grad_() if logits else None
        scale = 1.0 if logits else d ** -0.5
        out = window_attention(qkv, bias, mask, scale, h, logit, math.log(100))
        out.backward(up)
        qkv_r, bias_r = qkv0.double().requires_grad_(), bias0.double().requires_grad_()
        logit_r = logit0.double().requires_grad_() if logits else None
        ref = reference(qkv_r, bias_r, mask, scale, h, logit_r)
        ref.backward(up.double())

        def err(a, b):
            return ((a.double() - b).abs().max() / b.abs().max()).item()

        rows.append(dict(dtype=str(dtype), out_dtype=str(out.dtype), grad_dtype=str(qkv.grad.dtype), cosine=bool(logits),
                         bias_grad=None if bias.grad is None else err(bias.grad, bias_r.grad),
                         bias_grad_dtype=None if bias.grad is None else str(bias.grad.dtype),
                         out=err(out, ref), qkv_grad=err(qkv.grad, qkv_r.grad),
                         logit_grad=err(logit.grad, logit_r.grad) if logits else None,
                         logit_grad_clamped=logit.grad.flatten()[torch.tensor(logits) > math.log(100)].tolist() if logits else None))
    print(json.dumps(rows))
""")


def test_the_kernels_match_attention_in_tritons_interpreter() -> None:
    rows = run_interpreted(KERNEL_CHECK)
    assert len(rows) == 8
    for r in rows:
        assert r["out_dtype"] == r["grad_dtype"] == r["dtype"], r
        fp32 = r["dtype"] == "torch.float32"
        if r["cosine"]:  # scores up to 100x a cosine: float32's rounding grows with them
            bound = 1e-5 if fp32 else 0.1
            assert max(r["out"], r["qkv_grad"], r["bias_grad"]) <= bound, r
            assert r["logit_grad"] <= 10 * bound, r  # a sum over every score of a head: rounding adds up
            assert all(g == 0 for g in r["logit_grad_clamped"]), r  # above the clamp: no gradient
        elif fp32:
            assert r["out"] <= 1e-6 and r["qkv_grad"] <= 1e-6, r
        else:  # the probabilities and the gradients' operands rounded to bf16, as SDPA's fused kernels do
            assert r["out"] <= 2e-2 and r["qkv_grad"] <= 3e-2, r
        if r["bias_grad"] is not None and not r["cosine"]:
            assert r["bias_grad_dtype"] == "torch.float32"
            assert r["bias_grad"] <= (1e-6 if fp32 else 3e-2), r
    assert rows[2]["bias_grad"] is None  # the bias without a gradient: that kernel variant ran too
    assert rows[5]["logit_grad_clamped"] == [0.0]


MODEL_CHECK = textwrap.dedent("""
    import json, sys, torch
    import vtdense
    from vtdense.layers import triton_window_attention as twa
    from vtdense.layers.triton_window_attention import triton_window_attention
    calls = []
    real = twa.window_attention
    twa.window_attention = lambda *a: (calls.append(1), real(*a))[1]
    torch.manual_seed(0)
    # shifted windows and padding (72x100: stage maps 18x25, 9x12, 4x6, 2x3; window 7)
    model = vtdense.create_backbone(sys.argv[1], embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 2),
                                    drop_path_rate=0.0).train()
    if sys.argv[1].startswith("swinv2"):  # logit scales apart, one above the clamp (log(100))
        for i, blk in enumerate(b for stage in model.layers for b in stage.blocks):
            blk.attn.logit_scale.data = torch.linspace(1.0, 4.0 + 0.4 * i, blk.attn.logit_scale.numel()).view_as(blk.attn.logit_scale)
    x = torch.randn(2, 3, 72, 100)

    def run(on):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with triton_window_attention(on):
            out = model(xi)
        sum((f * torch.linspace(-1, 1, f.numel()).view_as(f)).sum() for f in out.values()).backward()
        return [f.detach() for f in out.values()], {n: p.grad for n, p in model.named_parameters()}, xi.grad

    out_on, grads_on, x_on = run(True)
    n_on = len(calls)
    out_off, grads_off, x_off = run(False)
    rel = {n: ((grads_on[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in grads_off.items()}
    # and both against the default path in float64
    model.double()
    x = x.double()
    out_64, grads_64, x_64 = run(False)

    def err(outs, grads, xg):
        return dict(out=max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(outs, out_64)),
                    grad=max(((grads[n].double() - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                             for n, g in grads_64.items()),
                    x_grad=((xg.double() - x_64).abs().max() / x_64.abs().max()).item())

    print(json.dumps(dict(calls_on=n_on, calls_off=len(calls) - n_on, params=len(rel),
                          out=max((a - b).abs().max().item() for a, b in zip(out_on, out_off)),
                          grad=max(rel.values()), x_grad=((x_on - x_off).abs().max() / x_off.abs().max()).item(),
                          on_vs_64=err(out_on, grads_on, x_on), off_vs_64=err(out_off, grads_off, x_off))))
""")


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
def test_a_swin_trains_through_the_kernels_in_tritons_interpreter(name: str) -> None:
    """Every block of a Swin V1 or V2 takes the kernels when they apply, shifted and padded windows
    included, and the outputs and every gradient (V2's logit scales and Log-CPB MLP included) are
    the default path's (float32)."""
    r = run_interpreted(MODEL_CHECK.replace("sys.argv[1]", repr(name)))
    assert r["calls_on"] == 8 and r["calls_off"] == 0 and r["params"] > 40, r
    if name == "swin_tiny":
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5 and r["x_grad"] <= 1e-5, r
    else:
        # Scores up to 100 cosines: both float32 paths are about 1e-4 from float64 in the outputs and most
        # gradients. The logit scales' gradients are sums of many cancelling terms (0.08 at most in one block,
        # against 6000 for a qkv weight), where both paths lose about three digits, and which loses more
        # depends on the host's BLAS: 4.1e-3 against the default path's 1.6e-3 on an Intel Xeon (AVX-512),
        # within a factor 2 on Zen 4. A wrong gradient is off by far more than that slack.
        for k in ("out", "grad", "x_grad"):
            assert r["on_vs_64"][k] <= 3 * r["off_vs_64"][k] + 1e-3, (k, r)
        assert r["out"] <= 1e-3 and r["grad"] <= 1e-2, r


COMPILED_CHECK = textwrap.dedent("""
    import copy, json, sys, torch
    import vtdense
    from torch._dynamo.utils import counters
    from vtdense.layers import triton_window_attention as twa
    from vtdense.models.compile import compile_backbone
    launches = {"forward": 0, "backward": 0}
    real_forward, real_backward = twa._launch_forward, twa._launch_backward
    def forward(*a, **k):
        launches["forward"] += 1
        return real_forward(*a, **k)
    def backward(*a, **k):
        launches["backward"] += 1
        return real_backward(*a, **k)
    twa._launch_forward, twa._launch_backward = forward, backward
    torch.manual_seed(0)
    # two blocks in the first stage (plain and shifted); padded windows at 64x96 (stage maps 16x24 .. 2x3)
    eager = vtdense.create_backbone(sys.argv[1], embed_dim=16, depths=(2, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                    drop_path_rate=0.0).train()
    compiled = compile_backbone(copy.deepcopy(eager), "aot_eager", fullgraph=True)
    def run(m, x, on):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with twa.triton_window_attention(on):
            out = m(xi)
        sum((f * torch.linspace(-1, 1, f.numel()).view_as(f)).sum() for f in out.values()).backward()
        return [f.detach() for f in out.values()], {n: p.grad for n, p in m.named_parameters()}, xi.grad
    rows = []
    # compile_backbone's cells graph (whole 32-pixel cells), padded windows; then another batch (a
    # smaller or larger map would cross a window side at some stage: a guard of its own)
    for batch in (2, 3):
        x = torch.randn(batch, 3, 64, 96)
        launches.update(forward=0, backward=0)
        out_c, grads_c, x_c = run(compiled, x, True)
        seen = dict(launches)
        out_e, grads_e, x_e = run(eager, x, False)
        rows.append(dict(launches=seen, graphs=counters["stats"]["unique_graphs"],
                         out=max((a - b).abs().max().item() for a, b in zip(out_c, out_e)),
                         grad=max(((grads_c[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                                  for n, g in grads_e.items()),
                         x_grad=((x_c - x_e).abs().max() / x_e.abs().max()).item()))
    print(json.dumps(rows))
""")


OPCHECK = textwrap.dedent("""
    import json, math, torch
    import vtdense.layers.triton_window_attention  # noqa: F401 (registers the ops)
    torch.manual_seed(0)
    B, nW, N, h, d = 2, 3, 9, 2, 16  # 9 tokens: a tile of 16, log-sum-exp rows of 64
    results = {}
    for cosine, masked, need_bias in ((False, False, True), (False, True, False), (True, True, True)):
        qkv = torch.randn(B, nW, N, 3 * h * d, requires_grad=True)
        bias = torch.randn(h, N, N, requires_grad=True)
        mask = torch.rand(nW, N, N) > 0.8 if masked else None
        if masked:
            mask.diagonal(dim1=1, dim2=2).fill_(False)
        logit = torch.full((h, 1, 1), math.log(10.0), requires_grad=True) if cosine else None
        rows = qkv.detach().view(-1, 3 * h * d).requires_grad_()
        args = (rows, [B, nW, N], bias, mask, 1.0 if cosine else d ** -0.5, h, logit, math.log(100.0))
        key = f"cosine={cosine} masked={masked}"
        results["forward " + key] = torch.library.opcheck(torch.ops.vtdense.triton_window_attention.default, args)
        out, lse = (t.detach() for t in torch.ops.vtdense.triton_window_attention(*args))
        back = (torch.randn_like(out), rows.detach(), bias.detach(), mask, out, lse,
                None if logit is None else logit.detach(), args[4], h, args[7], need_bias)
        results["backward " + key] = torch.library.opcheck(torch.ops.vtdense.triton_window_attention_backward.default, back)
    print(json.dumps(results))
""")


def test_the_graph_ops_pass_torch_librarys_opcheck() -> None:
    """Both ops (forward and backward; V1 with and without a mask, V2's cosine; the bias gradient
    asked for or not) pass ``torch.library.opcheck``: schema, autograd registration, fake forms
    against the real outputs' shapes and strides, and AOT dispatch at dynamic sizes (which found the
    log-sum-exp rows' unwritten tail, now zeros)."""
    results = run_interpreted(OPCHECK)
    assert len(results) == 6, results
    for name, checks in results.items():
        assert checks and all(v == "SUCCESS" for v in checks.values()), (name, checks)


def test_compiled_training_calls_the_kernels_as_ops() -> None:
    """``compile_backbone`` (training; its cells graph at two batch sizes) calls the kernels through the
    custom ops ``vtdense::triton_window_attention`` and its backward, opaque to the compiler, in
    every block of a Swin V2 (its cosine variant: the logit scale's gradient too): the forward and
    backward kernels launch once per block and step (and once for the probe that admits the device),
    and the outputs and every gradient are eager's default path's (float32; V2's cosine scores to
    1e-4, as its eager check). Before, graphs always took SDPA. (V1's variant: the opcheck test; by
    hand also this check, within 1.5e-6, and Inductor's compile of Swin-T's GPU-path graph with the ops,
    ``TRITON_INTERPRET=1 python benchmarks/compile_train_sizes.py --gpu-path --full --families swin
    --sizes 256x384``: one graph, within 5.2e-6 of eager.)"""
    rows = run_interpreted(COMPILED_CHECK.replace("sys.argv[1]", repr("swinv2_tiny")))
    bound = 1e-4
    # 5 blocks a step; the first also launched the probe (once per device, while the graph was traced)
    assert [r["launches"] for r in rows] == [{"forward": 6, "backward": 6}, {"forward": 5, "backward": 5}], rows
    assert [r["graphs"] for r in rows] == [1, 1], rows
    for r in rows:
        assert r["out"] <= bound and r["grad"] <= bound and r["x_grad"] <= bound, rows


def test_graphs_keep_sdpa_where_the_probe_launch_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled graph cannot fall back at run time, so graphs take the ops only where a probe launch
    worked: a failing one is said once, in a warning naming the error, and the answer (no) is kept."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the CPU counts as the interpreter's device; nothing launches)
    monkeypatch.setattr(twa, "_probed", {})
    monkeypatch.setattr(twa, "_failed", None)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no ptxas here")

    monkeypatch.setattr(twa, "_launch_forward", broken)
    with pytest.warns(RuntimeWarning, match="no ptxas here.*compiled graphs"):
        assert twa._usable_in_graphs("cpu", -1) is False
    assert twa._usable_in_graphs("cpu", -1) is False and twa._failed is not None
    assert twa._usable_in_graphs("cuda", 3) is False  # the failure holds for every device: SDPA everywhere


def test_auto_by_default_and_only_where_the_kernels_fit() -> None:
    x = torch.randn(2, 3, 49, 64, requires_grad=True)
    assert twa.triton_window_attention_enabled() == "auto"
    assert twa.takes_dtype(torch.bfloat16) and twa.takes_dtype(torch.float16) and not twa.takes_dtype(torch.float32)
    assert not twa.triton_window_attention_applies(x, 49, 32, 0.0)  # a CPU tensor, no interpreter
    with twa.triton_window_attention(True):
        assert twa.triton_window_attention_enabled() is True and twa.takes_dtype(torch.float32)
        assert not twa.triton_window_attention_applies(x, 49, 32, 0.0)
    with twa.triton_window_attention(False):
        assert not twa.triton_window_attention_enabled()
    assert twa.triton_window_attention_enabled() == "auto"
    with pytest.raises(ValueError, match="set_triton_window_attention takes True, False or 'auto'; got 'on'"):
        twa.set_triton_window_attention("on")


@pytest.mark.parametrize("tokens,width,dropout,grad,applies", [
    (49, 32, 0.0, True, True), (64, 16, 0.0, True, True), (65, 32, 0.0, True, False), (49, 24, 0.0, True, False),
    (49, 32, 0.1, True, False), (49, 32, 0.0, False, False)])
def test_where_the_kernels_apply(monkeypatch: pytest.MonkeyPatch, tokens: int, width: int, dropout: float,
                                 grad: bool, applies: bool) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the check then takes CPU tensors as it takes CUDA ones)
    x = torch.randn(1, 2, tokens, 2 * width)
    with twa.triton_window_attention(True), torch.set_grad_enabled(grad):
        assert twa.triton_window_attention_applies(x, tokens, width, dropout) is applies


@pytest.mark.parametrize("kernel,dtype,masked,cosine", [
    ("forward", "bf16", True, False), ("forward", "fp32", False, False), ("backward", "bf16", True, False),
    ("backward", "fp16", False, False), ("forward", "bf16", True, True), ("backward", "bf16", True, True)])
def test_the_kernels_compile_for_hopper(kernel: str, dtype: str, masked: bool, cosine: bool) -> None:
    """Triton compiles both kernels to a cubin for sm_90 (the H100/H200) without a GPU: the typing
    errors the CPU interpreter lets through fail here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fwd, bwd, _ = twa._build()
    t = f"*{dtype}"
    mask = "*u8" if masked else "constexpr"
    common = {"QKV": t, "BIAS": "*fp32" if not cosine else t, "MASK": mask, "OUT": t}
    logit = "*fp32" if cosine else "constexpr"
    consts: dict = {"D": 32, "BLOCK_N": 64, "HAS_MASK": masked, "PREC": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False,
                    "COSINE": cosine}
    if not masked:
        consts["MASK"] = None
    if not cosine:
        consts.update(LOGIT=None, **({} if kernel == "forward" else {"DLOGIT": None}))
    if kernel == "forward":
        fn = fwd
        signature = {**common, "LSE": "*fp32", "LOGIT": logit, "nW": "i32", "N": "i32", "H": "i32", "scale": "fp32",
                     "MASKED_VALUE": "fp32", "LOGIT_MAX": "fp32", "LSE_ROW": "i32"}
    else:
        fn = bwd
        signature = {**common, "DOUT": t, "LSE": "*fp32", "DQKV": t, "DBIAS": "*fp32", "LOGIT": logit, "DLOGIT": logit,
                     "BW": "i32", "nW": "i32", "N": "i32", "H": "i32", "scale": "fp32", "MASKED_VALUE": "fp32",
                     "LOGIT_MAX": "fp32", "WPP": "i32", "LSE_ROW": "i32"}
        consts.update(NEED_DBIAS=True)
    signature.update({k: "constexpr" for k in ("D", "BLOCK_N", "HAS_MASK", "PREC", "NEED_DBIAS", "UPCAST", "COSINE")
                      if k in consts})
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if kernel == "forward" else twa._BACKWARD_WARPS})
    assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000


def test_the_benchmarks_attention_contenders_switch_the_kernels() -> None:
    """``benchmarks/run.py``'s ``vtdense triton-attn`` / ``sdpa-attn`` rows: vtdense's model, run with
    the kernels on for every dtype / off."""
    import sys

    from triton_interpreter import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from contenders import _SETTINGS, build_model

    from vtdense.backbones.swin import SwinTransformer

    case = dict(family="swin_t", mode="train", batch=1, size=[64, 64], dtype="bf16")
    assert isinstance(build_model("vtdense triton-attn", case), SwinTransformer)
    assert isinstance(build_model("vtdense sdpa-attn", case), SwinTransformer)
    with _SETTINGS[" triton-attn"]():
        assert twa.triton_window_attention_enabled() is True
    with _SETTINGS[" sdpa-attn"]():
        assert twa.triton_window_attention_enabled() is False
    assert twa.triton_window_attention_enabled() == "auto"


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11),
                    reason="fake CUDA tensors need torch >= 2.11 on a machine without a GPU")
def test_on_fake_cuda_the_kernels_replace_sdpa_and_the_copies_around_it() -> None:
    """Counted on fake CUDA tensors (``benchmarks/launches.py``, the kernel a stand-in call): a Swin-T
    training forward in bf16 with the kernels makes no SDPA call, about four ATen calls fewer per block
    (the heads-first copy, the bias cast and, where a mask applies, the term's two), fewer copies, and
    keeps less for the backward."""
    import sys

    from triton_interpreter import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import launches

    import vtdense

    def count(wrap: bool) -> launches.Count:
        torch.manual_seed(0)
        model = vtdense.create_backbone("swin_tiny", out_norm=False, drop_path_rate=0.0)
        return launches.count_forward(launches._TritonAttn(model) if wrap else model,
                                      lambda: torch.randn(2, 3, 128, 192, device="cuda"), train=True, dtype=torch.bfloat16)

    default, kernels = count(False), count(True)
    assert len(default.attention) == 12 and not kernels.attention
    assert kernels.ops["triton_window_attention_forward"] == 12, kernels.ops
    assert default.total - kernels.total >= 3 * 12, (default.total, kernels.total)
    assert kernels.copies < default.copies and kernels.saved_bytes < default.saved_bytes


def test_the_gpu_check_script_runs_in_tritons_interpreter() -> None:
    """``benchmarks/triton_attention_check.py`` (GPU only: CUDA events) runs its check and its
    timings, the backward's settings swept, in Triton's interpreter at a tiny size, events stubbed."""
    code = GPU_TIMING_STUB + textwrap.dedent("""
        import json
        import triton_attention_check as t
        stages = ((9, 13, 32, 2),)
        checks = t.check("cpu", batch=1, stages=stages)
        times = t.timings("cpu", batch=1, repeats=1, stages=stages, sweep=((4, 4), (16, 8)))
        print(json.dumps(dict(check=checks, times=times)))
    """)
    r = run_interpreted(code)
    assert len(r["check"]) == 4 and len(r["times"]) == 5, r
    for row in r["check"]:  # float32 exact to rounding; bf16 (upcast in the interpreter) within its rounding
        keys = ("out", "x_grad", "qkv_weight_grad", "position_grad") + (("logit_scale_grad",) if row["family"] == "v2" else ())
        bound = (1e-5 if row["family"] == "v1" else 1e-4) if row["dtype"] == "fp32" else 5e-2
        assert max(row[k] for k in keys) <= bound, row
    assert all(set(t) >= {"triton"} for t in r["times"]), r


def test_a_kernel_that_fails_is_said_once_and_the_sdpa_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the forward kernel cannot build or launch (a driver, a Triton version), the first failure
    is one warning naming it, the block's attention takes the SDPA path, and nothing is asked of the
    kernels again: the training step goes on with the default path's values."""
    import warnings

    import vtdense

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the check then takes CPU tensors as it takes CUDA ones)
    monkeypatch.setattr(twa, "_failed", None)
    tries = []

    def broken(*args: object) -> None:
        tries.append(1)
        raise RuntimeError("PTX JIT compilation failed\nmore detail")

    monkeypatch.setattr(twa, "_launch_forward", broken)
    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 2),
                                    drop_path_rate=0.0).train()
    x = torch.randn(1, 3, 64, 64)
    ref = model(x)
    with warnings.catch_warnings(record=True) as seen, twa.triton_window_attention(True):
        warnings.simplefilter("always")
        out = model(x)
        sum(f.sum() for f in out.values()).backward()
        model(x)
    said = [w for w in seen if "Triton window attention failed" in str(w.message)]
    assert len(said) == 1 and "RuntimeError: PTX JIT compilation failed" in str(said[0].message)
    assert tries == [1] and twa._failed is not None
    assert all(torch.equal(out[k], ref[k]) for k in ref)


def test_kernels_launch_on_their_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current CUDA device: a model on ``cuda:1`` in a process whose current
    device is 0 gets its kernels launched under ``torch.cuda.device(1)``, and nothing is switched
    where the devices agree or the tensor is not on a GPU."""
    import contextlib
    import types

    from vtdense.layers.fused_norm import launch_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_1 = types.SimpleNamespace(device=torch.device("cuda", 1))
    switch = launch_device(on_1)  # type: ignore[arg-type]
    assert isinstance(switch, torch.cuda.device) and switch.idx == 1
    assert isinstance(launch_device(types.SimpleNamespace(device=torch.device("cuda", 0))), contextlib.nullcontext)  # type: ignore[arg-type]
    assert isinstance(launch_device(torch.zeros(1)), contextlib.nullcontext)
    # every launch site goes through it
    import inspect

    from vtdense.layers import fused_norm, fused_norm_train

    for source in (inspect.getsource(fused_norm._run), inspect.getsource(fused_norm_train),
                   inspect.getsource(twa._launch_forward), inspect.getsource(twa._launch_backward)):
        assert "launch_device(" in source


def test_the_profiler_counts_the_kernels_as_fused_attention() -> None:
    """``benchmarks/attention_kernels.py`` (every bf16 attention call on a fused kernel): the kernels
    are launched by Triton, not through an ATen op, so their launches carry profiler labels, recorded
    only while a profiler runs."""
    got = run_interpreted(textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, "benchmarks")
        from attention_kernels import classify, kernel_counts
        from vtdense.layers.triton_window_attention import window_attention
        qkv = torch.randn(1, 2, 16, 3 * 16, requires_grad=True)
        bias = torch.randn(1, 16, 16, requires_grad=True)
        step = lambda: window_attention(qkv, bias, None, 0.25, 1).sum().backward()
        counts = kernel_counts(step, "cpu")
        print(json.dumps({k: [n, classify(k)] for k, n in counts.items()}))
        """))
    assert got == {twa.LABEL: [1, "fused"], twa.LABEL + "_backward": [1, "fused"]}


def test_the_default_takes_half_precision_training_only() -> None:
    """The ``"auto"`` default: a Swin trained under bf16 autocast runs every block's attention in the
    kernels; in float32 and in inference, none (SDPA's path)."""
    got = run_interpreted(textwrap.dedent("""
        import json, torch
        import vtdense
        from vtdense.layers import triton_window_attention as twa
        calls = []
        real = twa.window_attention
        twa.window_attention = lambda *a: (calls.append(1), real(*a))[1]
        model = vtdense.create_backbone("swin_tiny", embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                        drop_path_rate=0.0).train()
        x = torch.randn(1, 3, 64, 64)
        counts = {}
        for name, cast, grad in (("bf16", True, True), ("fp32", False, True), ("bf16 inference", True, False)):
            del calls[:]
            with torch.autocast("cpu", torch.bfloat16, enabled=cast), torch.set_grad_enabled(grad):
                out = model(x)
            if grad:
                sum(f.float().sum() for f in out.values()).backward()
            counts[name] = len(calls)
        print(json.dumps(dict(mode=twa.triton_window_attention_enabled(), **counts)))
        """))
    assert got == {"mode": "auto", "bf16": 4, "fp32": 0, "bf16 inference": 0}


def test_tasks_take_the_switch_as_an_option() -> None:
    """``--model.triton_attention false`` in the recipes: checked when the task is made, applied
    process-wide when the trainer builds the model (as ``activation_recompute`` is)."""
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    tiny = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
    try:
        DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, slim_heads=True,
                      triton_attention=False).configure_model()
        assert twa.triton_window_attention_enabled() is False
        SegmentationTask(arch="upernet", backbone="swin_tiny", backbone_kwargs=tiny, num_classes=3,
                         triton_attention=True).configure_model()
        assert twa.triton_window_attention_enabled() is True
        DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, slim_heads=True).configure_model()
        assert twa.triton_window_attention_enabled() == "auto"  # the default puts it back
        for bad in ("on", 1, None):
            with pytest.raises(ValueError, match="option 'triton_attention'"):
                DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, triton_attention=bad)
    finally:
        twa.set_triton_window_attention("auto")
