"""The pre-norm fused with the next projection (``vtdense.layers.mlp.norm_linear``): its backward.

Training keeps only the norm's input and recomputes the norm in the backward. The usual backward
does that with ``native_layer_norm`` / ``native_layer_norm_backward`` directly: the nested
``torch.autograd.grad`` call it used before cost about 0.6 ms of host time per call on an H200
(16 ms of a Swin-T Mask R-CNN training step; see benchmarks/RESULTS.md). Checked here: the
gradients equal plain autograd's through ``linear(layer_norm(x))`` in every dtype and autocast
regime the forward meets, and only a double backward makes the nested call.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vtdense.layers import cpu_linear
from vtdense.layers.cpu_linear import mm_tn, use_cpu_matmul
from vtdense.layers.mlp import _norm_linear_backward, _NormLinear


def _inputs(dtype: torch.dtype, affine: bool = True, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 24, generator=g, dtype=dtype) * 3 + 1
    nw = torch.randn(24, generator=g, dtype=dtype) if affine else None
    nb = torch.randn(24, generator=g, dtype=dtype) if affine else None
    w = torch.randn(40, 24, generator=g, dtype=dtype) / 5
    b = torch.randn(40, generator=g, dtype=dtype) if bias else None
    up = torch.randn(2, 5, 40, generator=g, dtype=dtype)
    return x, nw, nb, w, b, up


def _grads(fn, tensors, wanted, up):
    leaves = [t.clone().requires_grad_(need) if t is not None else None for t, need in zip(tensors, wanted)]
    out = fn(*leaves)
    out.backward(up.to(out.dtype))
    return out.detach(), [t.grad if t is not None and need else None for t, need in zip(leaves, wanted)]


def _ours(x, nw, nb, w, b):
    return _NormLinear.apply(x, nw, nb, 1e-5, w, b)


def _plain(x, nw, nb, w, b):
    return F.linear(F.layer_norm(x, x.shape[-1:], nw, nb, 1e-5), w, b)


def _assert_close(a, b, tol):
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            assert u.dtype == v.dtype
            assert (u.double() - v.double()).abs().max() <= tol * max(1.0, float(v.double().abs().max()))


@pytest.mark.parametrize("backend", ["blas", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("affine,bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("wanted", [(True, True, True, True, True), (True, False, False, False, False),
                                    (False, True, True, True, True), (False, False, False, True, False)])
def test_gradients_equal_plain_autograd(backend, dtype, affine, bias, wanted) -> None:
    x, nw, nb, w, b, up = _inputs(dtype, affine, bias)
    tensors = (x, nw, nb, w, b)
    with use_cpu_matmul(backend):
        out, ours = _grads(_ours, tensors, wanted, up)
    ref_out, ref = _grads(_plain, tensors, wanted, up)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    _assert_close([out], [ref_out], tol)
    _assert_close(ours, ref, tol)


def test_cpu_autocast_gradients_equal_plain_autograd() -> None:
    """CPU autocast runs the linear in bfloat16 and leaves the norm in its input's dtype."""
    x, nw, nb, w, b, up = _inputs(torch.float32)
    tensors, wanted = (x, nw, nb, w, b), (True,) * 5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ours = _grads(_ours, tensors, wanted, up)
        ref_out, ref = _grads(_plain, tensors, wanted, up)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out)
    _assert_close(ours, ref, 1e-2)


def test_bfloat16_input_with_float32_norm_weights() -> None:
    """Mixed dtypes outside autocast: layer_norm takes a bfloat16 input with float32 weights and
    returns bfloat16; each gradient comes back in its own input's dtype."""
    x, nw, nb, w, b, up = _inputs(torch.float32)
    tensors = (x.bfloat16(), nw, nb, w.bfloat16(), b.bfloat16())
    wanted = (True,) * 5
    out, ours = _grads(_ours, tensors, wanted, up)
    ref_out, ref = _grads(_plain, tensors, wanted, up)
    assert torch.equal(out, ref_out)
    _assert_close(ours, ref, 1e-2)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_float32_norm_under_a_casting_autocast(x_dtype) -> None:
    """CUDA autocast runs layer_norm in float32 (casting a bfloat16 input and any weights) and the
    linear in bfloat16. The backward, given the forward's cast (``ctx.norm_cast``), equals
    autograd through those explicit casts. (Run here on the CPU by calling the backward itself.)"""
    x, nw, nb, w, b, up = _inputs(torch.float32)
    x = x.to(x_dtype)
    nw16, nb16 = nw.bfloat16(), nb.bfloat16()  # weights of another dtype are cast too

    def ref_fn(x, nw, nb, w, b):
        y = F.layer_norm(x.float(), x.shape[-1:], nw.float(), nb.float(), 1e-5)
        return F.linear(y.bfloat16(), w.bfloat16(), b.bfloat16())

    tensors, wanted = (x, nw16, nb16, w, b), (True,) * 5
    ref_out, ref = _grads(ref_fn, tensors, wanted, up)
    ctx = SimpleNamespace(norm_cast=torch.float32, eps=1e-5, has_bias=True, weight_dtype=torch.float32,
                          needs_input_grad=(True, True, True, False, True, True))
    grad = up.bfloat16()
    ours = _norm_linear_backward(ctx, grad, x, nw16, nb16, w.bfloat16())
    ours = [ours[0], ours[1], ours[2], ours[4], ours[5]]
    _assert_close(ours, ref, 2e-2)
    assert [t.dtype for t in ours] == [x_dtype, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]


def test_no_nested_autograd_call_except_under_create_graph(monkeypatch) -> None:
    calls = []
    real = torch.autograd.grad

    def counting(*args, **kwargs):
        calls.append(kwargs.get("create_graph", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    x, nw, nb, w, b, up = _inputs(torch.float64)
    tensors = [t.clone().requires_grad_(True) for t in (x, nw, nb, w, b)]
    _ours(*tensors).backward(up)
    assert calls == []  # the usual backward: the norm's kernels, no autograd graph of its own

    out = _ours(*tensors)
    (gx,) = real(out, tensors[0], up, create_graph=True)  # a double backward keeps the nested call
    assert calls == [True]
    gx.pow(2).sum().backward()
    assert tensors[3].grad is not None


def test_onednn_copies_a_broadcast_gradient_before_multiplying() -> None:
    """``out.sum()``'s gradient is a broadcast tensor (zero strides). As oneDNN's weight operand
    in the weight-gradient product it took a path hundreds of times slower; it is now copied
    first, and the product equals ``torch.mm``."""
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, x, w, *rest):
            seen.append(tuple(w.stride()))
            return real(x, w, *rest)

    g = torch.ones(()).expand(64, 288)
    x = torch.randn(64, 96)
    orig = cpu_linear.torch.ops.mkldnn._linear_pointwise
    with use_cpu_matmul("onednn"):
        try:
            torch.ops.mkldnn._linear_pointwise = Spy()
            got = mm_tn(g, x)
        finally:
            torch.ops.mkldnn._linear_pointwise = orig
    assert seen and all(0 not in s for s in seen), seen
    torch.testing.assert_close(got, torch.mm(g.t(), x))
