"""``vtdense.layers.fused_norm_train``: training's pre-norm + projection with the Triton LayerNorm.

The kernel runs here in Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``): the
recomputation gives the forward's values bit for bit, and the output and every gradient match
plain autograd through ``linear(layer_norm(x).to(bf16))`` (as CUDA autocast runs it) within bf16
rounding, first and second order. Where it applies is checked in this process."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from triton_interpreter import GPU_TIMING_STUB, ROOT, run_interpreted

from vtdense.layers import fused_norm, fused_norm_train

CHECK = textwrap.dedent("""
    import json, torch, torch.nn.functional as F
    from vtdense.layers import fused_norm
    from vtdense.layers.fused_norm_train import triton_norm_linear
    torch.manual_seed(0)
    bf = torch.bfloat16
    out = []
    for C, shape, dtype, affine, bias in [(96, (3, 7, 11), torch.float32, True, True), (100, (5, 9), torch.bfloat16, True, False),
                                          (64, (40,), torch.float32, False, True)]:
        x0 = (torch.randn(*shape, C) * 3 + 2).to(dtype)
        nw0 = torch.randn(C) if affine else None
        nb0 = torch.randn(C) if affine else None
        w0, b0 = torch.randn(48, C) / 8, (torch.randn(48) if bias else None)
        up = torch.randn(*shape, 48).to(bf)
        y, mean, rstd = fused_norm._run(x0, nw0, nb0, 1e-5, 1)
        again = fused_norm._run(x0, nw0, nb0, 1e-5, 2, mean, rstd)[0]
        row = dict(C=C, recomputed_identical=bool(torch.equal(y, again)))

        def leaves():
            return [t.clone().requires_grad_() if t is not None else None for t in (x0, nw0, nb0, w0, b0)]

        def grads(ts):
            return [t.grad for t in ts if t is not None]

        ours = leaves()
        o = triton_norm_linear(ours[0], ours[1], ours[2], 1e-5, ours[3], ours[4])
        o.backward(up)
        ref = leaves()
        a = F.layer_norm(ref[0].float(), (C,), ref[1], ref[2], 1e-5).to(bf)
        r = F.linear(a, ref[3].to(bf), ref[4].to(bf) if ref[4] is not None else None)
        r.backward(up)
        row["out_dtype"] = str(o.dtype)
        row["out_rel"] = ((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
        row["grad_dtypes_match"] = all(g.dtype == h.dtype for g, h in zip(grads(ours), grads(ref)))
        row["grad_rel"] = max(((g.float() - h.float()).abs().max() / h.float().abs().max()).item()
                              for g, h in zip(grads(ours), grads(ref)))
        # second order: a gradient penalty on x
        ours, ref = leaves(), leaves()
        g1 = torch.autograd.grad(triton_norm_linear(ours[0], ours[1], ours[2], 1e-5, ours[3], ours[4]).float().square().sum(),
                                 ours[0], create_graph=True)[0]
        g1.float().square().sum().backward()
        a = F.layer_norm(ref[0].float(), (C,), ref[1], ref[2], 1e-5).to(bf)
        r = F.linear(a, ref[3].to(bf), ref[4].to(bf) if ref[4] is not None else None)
        h1 = torch.autograd.grad(r.float().square().sum(), ref[0], create_graph=True)[0]
        h1.float().square().sum().backward()
        row["second_order_rel"] = max(((g.float() - h.float()).abs().max() / h.float().abs().max()).item()
                                      for g, h in zip(grads(ours), grads(ref)))
        out.append(row)
    print(json.dumps(out))
""")


def test_in_tritons_interpreter_against_plain_autograd() -> None:
    rows = run_interpreted(CHECK)
    assert len(rows) == 3
    for r in rows:
        assert r["recomputed_identical"], r
        assert r["out_dtype"] == "torch.bfloat16" and r["grad_dtypes_match"], r
        # the same bf16 products as plain autograd's, the norm's gradient from the kernel's statistics
        assert r["out_rel"] <= 2 ** -7 and r["grad_rel"] <= 1e-5, r
        assert r["second_order_rel"] <= 3e-2, r  # through PyTorch's LayerNorm: bf16 steps apart


def test_off_by_default_and_only_for_large_cuda_bf16_training() -> None:
    assert fused_norm_train._enabled is False
    x = torch.randn(4, 8, requires_grad=True)
    with fused_norm_train.triton_norm_training(True):
        assert fused_norm_train._enabled is True
        assert not fused_norm_train.triton_norm_training_applies(x)  # a CPU tensor
    assert fused_norm_train._enabled is False


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11),
                    reason="fake CUDA tensors need torch >= 2.11 on a machine without a GPU")
def test_fake_cuda_tensors_keep_the_other_forms() -> None:
    """Fake and subclass tensors (the GPU code paths' tests) cannot launch a kernel: not for them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from launches import cuda_autocast, fake_cuda

    with fake_cuda(), fused_norm_train.triton_norm_training(True), cuda_autocast(torch.bfloat16):
        x = torch.empty(1 << 16, 256, device="cuda", requires_grad=True)
        assert x.numel() >= fused_norm.AUTO_MIN_ELEMENTS
        assert not fused_norm_train.triton_norm_training_applies(x)


@pytest.mark.parametrize("block,rows,affine,x_type", [(128, 32, True, "*fp32"), (512, 8, True, "*bf16"), (128, 32, False, "*fp32")])
def test_backward_kernel_compiles_for_hopper(block: int, rows: int, affine: bool, x_type: str) -> None:
    """Triton compiles the backward kernel to a cubin for sm_90 (the H100/H200) without a GPU: the
    typing errors the CPU interpreter lets through fail here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = fused_norm_train._backward_kernel()
    signature = {"DY": "*bf16", "X": x_type, "W": "*fp32" if affine else "constexpr", "MEAN": "*fp32", "RSTD": "*fp32",
                 "DX": x_type, "DW": "*fp32" if affine else "constexpr", "DB": "*fp32", "M": "i32", "C": "i32",
                 "BLOCK_C": "constexpr", "ROWS": "constexpr", "HAS_W": "constexpr", "NEED_DX": "constexpr",
                 "NEED_DW": "constexpr", "NEED_DB": "constexpr", "DX_BF16": "constexpr"}
    constants = {"BLOCK_C": block, "ROWS": rows, "HAS_W": affine, "NEED_DX": True, "NEED_DW": affine, "NEED_DB": True,
                 "DX_BF16": x_type == "*bf16"}
    if not affine:
        constants.update(W=None, DW=None)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000


MODEL_CHECK = textwrap.dedent("""
    import json, torch
    import vtdense
    from vtdense.layers import fused_norm_train, mlp
    calls = []
    real = fused_norm_train._TritonNormLinear.apply
    fused_norm_train._TritonNormLinear.apply = lambda *a: (calls.append(1), real(*a))[1]
    # here on CPU tensors, in Triton's interpreter: where the GPU check passes, for every pre-norm
    on = [False]
    mlp.triton_norm_training_applies = lambda x: on[0] and torch.is_grad_enabled() and x.is_floating_point()
    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                                    window_size=4, out_norm=False, drop_path_rate=0.0).train()
    x = torch.randn(2, 3, 64, 96)

    def grads(triton):
        on[0] = triton
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), mlp.activation_recompute(False):
            out = model(x)  # (the kernel's path also takes the pre-norms with the recomputation off)
        sum(f.float().square().mean() for f in out.values()).backward()
        return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(False)
    assert not calls
    got = grads(True)
    # CPU autocast runs layer_norm in bf16 on a bf16 input (CUDA autocast in float32, as the kernel
    # does), so the two differ by more than rounding in places: compare the whole gradient's direction
    # and size, and each weight matrix's
    g, r = torch.cat([got[k].double().flatten() for k in ref]), torch.cat([ref[k].double().flatten() for k in ref])
    cos = torch.nn.functional.cosine_similarity(g, r, dim=0).item()
    mats = min(torch.nn.functional.cosine_similarity(got[k].flatten(), ref[k].flatten(), dim=0).item()
               for k in ref if ref[k].dim() == 2)
    print(json.dumps(dict(calls=len(calls), params=len(ref), same_keys=sorted(got) == sorted(ref), cos=cos,
                          norm_ratio=(g.norm() / r.norm()).item(), min_matrix_cos=mats)))
""")


def test_a_backbone_trains_through_it_in_tritons_interpreter() -> None:
    """The wiring: with it applying, every pre-norm + projection of a Swin (the qkv's, the MLP's, the
    patch mergings') takes it, and the gradients are plain autograd's within bf16 rounding."""
    r = run_interpreted(MODEL_CHECK)
    assert r["calls"] == 4 * 2 + 3 and r["same_keys"] and r["params"] > 20, r
    assert r["cos"] >= 0.9999 and abs(r["norm_ratio"] - 1) <= 1e-3 and r["min_matrix_cos"] >= 0.999, r


def test_gpu_timing_script_runs_in_the_interpreter() -> None:
    """``benchmarks/triton_norm_check.py``'s per-call timings (GPU only: CUDA events) run every
    form, the training kernels' included, in Triton's interpreter with the events stubbed."""
    code = GPU_TIMING_STUB + textwrap.dedent("""
        import json
        import triton_norm_check
        print(json.dumps(triton_norm_check.timings("cpu", repeats=1, shapes=((37, 96), (5, 384)))))
    """)
    rows = run_interpreted(code)
    assert len(rows) == 2 and all(len(r) == 11 for r in rows), rows
