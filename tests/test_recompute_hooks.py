"""The recomputation of ``norm -> linear`` and ``GELU -> linear`` through saved-tensor hooks
(``vtdense.layers.recompute``), the form training takes off the CPU: autograd's own backward, with
the linear's saved input remade from what the norm or the GELU keeps anyway. Run here on the CPU by
forcing the form; checked: the gradients of plain autograd (first and second order), the linear's
input not kept by the graph, one remake per layer, and the autograd functions under others' hooks
(checkpointing)."""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import vtdense
from vtdense.layers import cpu_window_attention, mlp, recompute


@pytest.fixture
def hooks_form(monkeypatch):
    """The recomputation's GPU form (saved-tensor hooks), on the CPU; the CPU's own attention path
    (norm, qkv and attention in one function, every size) off, so each block's pre-norm is hooked
    as on a GPU."""
    monkeypatch.setattr(cpu_window_attention, "MIN_BYTES", 1 << 62)
    mlp._set_recompute_form("hooks")
    try:
        yield
    finally:
        mlp._set_recompute_form("auto")


def _model(name: str = "swin_tiny", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    if name.startswith("swin"):
        kw = dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4, **kw)
    else:
        kw = dict(embed_dim=16, depths=(1, 2, 2, 1), window_size=16, **kw)
    return vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0, **kw).train()


def _grads(model: torch.nn.Module, x: torch.Tensor, amp: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    sum(f.float().square().mean() for f in out.values()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny", "mvitv2_tiny"])
@pytest.mark.parametrize("amp", [False, True])
def test_gradients_equal_plain_autograd(name: str, amp: bool, hooks_form) -> None:
    model, x = _model(name), torch.randn(2, 3, 64, 96)
    got = _grads(model, x, amp)
    with mlp.activation_recompute(False):
        ref = _grads(model, x, amp)
    assert got.keys() == ref.keys() and len(ref) > 20
    # float32: the plain path's CPU linear layers are oneDNN's, these the BLAS's (rounding alone)
    tol = 2e-2 if amp else 1e-5
    for k in ref:
        assert (got[k] - ref[k]).abs().max() <= tol * max(1.0, float(ref[k].abs().max())), k


class _SeenInputs:
    """Weak references to the tensors ``recompute``'s linear is applied to, and the remakes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref] = []
        self.remade = 0
        real_linear, real_remake = F.linear, recompute._Recipe.remake

        def linear(a, w, b=None):
            self.refs.append(weakref.ref(a))
            return real_linear(a, w, b)

        def remake(recipe):
            self.remade += 1
            return real_remake(recipe)

        monkeypatch.setattr(recompute, "F", SimpleNamespace(linear=linear))
        monkeypatch.setattr(recompute._Recipe, "remake", remake)

    def alive(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.refs)


@pytest.mark.parametrize("amp", [False, True])
def test_the_graph_keeps_no_linear_input_and_remakes_each_once(amp: bool, hooks_form, monkeypatch) -> None:
    model, x = _model(), torch.randn(2, 3, 64, 96)
    seen = _SeenInputs(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    loss = sum(f.float().square().mean() for f in out.values())
    calls = len(seen.refs)
    assert calls == 4 * 3 + 3  # per block the qkv's pre-norm, the MLP's and its GELU; per patch merging its norm
    assert seen.alive() == 0  # the graph (alive: `loss`) keeps none of them
    loss.backward()
    assert seen.remade == calls


def test_the_check_above_fails_when_the_input_is_kept(hooks_form, monkeypatch) -> None:
    """The control: a pack hook that keeps every tensor leaves the linear inputs alive."""
    model, x = _model(), torch.randn(2, 3, 64, 96)
    seen = _SeenInputs(monkeypatch)
    monkeypatch.setattr(recompute, "_Recipe", lambda fn, args, amp, dtype, saved: saved)
    out = model(x)
    assert seen.alive() == len(seen.refs) > 0
    del out


def test_double_backward_equals_plain_autograd(hooks_form) -> None:
    """A gradient penalty: the remade input is differentiable under ``create_graph``."""
    g = torch.Generator().manual_seed(0)
    norm, fc1, fc2 = torch.nn.LayerNorm(12), torch.nn.Linear(12, 20), torch.nn.Linear(20, 12)
    with torch.no_grad():
        for p in (norm.weight, norm.bias):
            p.copy_(torch.randn(p.shape, generator=g))
    x0 = torch.randn(3, 5, 12, generator=g)

    def penalty(fused: bool) -> list[torch.Tensor]:
        for m in (norm, fc1, fc2):
            m.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        if fused:
            y = mlp.gelu_linear(mlp.norm_linear(x, norm, fc1), fc2)
        else:
            y = fc2(F.gelu(fc1(norm(x))))
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        return [p.grad.clone() for m in (norm, fc1, fc2) for p in m.parameters()]

    with mlp.activation_recompute(True):
        got = penalty(True)
    ref = penalty(False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_others_hooks_and_checkpointing_take_the_autograd_functions(hooks_form, monkeypatch) -> None:
    """Under another's saved-tensor hooks (here activation checkpointing) every saved tensor must
    reach them: the recomputation then takes the autograd functions, with the same gradients."""
    calls = []
    real = mlp._NormLinear.apply
    monkeypatch.setattr(mlp._NormLinear, "apply", lambda *a: (calls.append(1), real(*a))[1])
    assert mlp._via_hooks(torch.empty(1))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not mlp._via_hooks(torch.empty(1))
    x = torch.randn(2, 3, 64, 96)
    ref = _grads(_model(), x, False)
    assert calls == []
    got = _grads(_model(grad_checkpointing=True), x, False)
    assert calls  # checkpointed blocks ran the autograd function
    for k in ref:
        assert (got[k] - ref[k]).abs().max() <= 1e-5 * max(1.0, float(ref[k].abs().max())), k


class _Sub(torch.Tensor):
    pass


def test_auto_form_is_per_device_and_for_plain_tensors(hooks_form) -> None:
    mlp._set_recompute_form("auto")
    assert not mlp._via_hooks(torch.empty(1))  # the CPU keeps the autograd functions (oneDNN backward)
    assert mlp._via_hooks(torch.empty(1, device="meta"))
    # a subclass (DTensor, say) need not own its storage: the autograd functions then
    assert not mlp._via_hooks(torch.empty(1, device="meta").as_subclass(_Sub))
    mlp._set_recompute_form("hooks")
    assert mlp._via_hooks(torch.empty(1)) and not mlp._via_hooks(torch.empty(1).as_subclass(_Sub))
    with pytest.raises(ValueError, match="unknown recompute form 'x'"):
        mlp._set_recompute_form("x")


def test_a_cast_copy_of_the_input_that_fn_saves_is_remade_too() -> None:
    """CUDA autocast runs ``layer_norm`` in float32, so on a bf16 input the norm saves a float32
    copy of it. Emulated here by a norm that casts its input itself: the copy is not kept, and the
    gradients equal plain autograd's."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 6, 16, generator=g).bfloat16()
    norm, fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)
    copies: list[weakref.ref] = []

    def float_norm(x, shape, w, b, eps):
        xf = x.float()
        copies.append(weakref.ref(xf))
        return F.layer_norm(xf, shape, w, b, eps)

    def run(fused: bool):
        norm.zero_grad(set_to_none=True), fc.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        args = (x, (16,), norm.weight, norm.bias, 1e-5)
        out = recompute.recomputed_input_linear(float_norm, args, fc) if fused else fc(float_norm(*args))
        gc.collect()
        kept = copies[-1]() is not None
        out.square().sum().backward()
        return kept, [x.grad, norm.weight.grad, norm.bias.grad, fc.weight.grad, fc.bias.grad]

    kept, got = run(True)
    assert not kept
    kept_plain, ref = run(False)
    assert kept_plain  # the control: plain autograd keeps the float copy
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gpu_check_script_runs_here() -> None:
    """``benchmarks/recompute_check.py``'s gradient check on the CPU, at a small size (its memory
    part needs CUDA): the three forms' Swin-T gradients are identical, with the hooks form forced as
    on a GPU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import recompute_check

    out = recompute_check.gradients("cpu", size=(64, 96))
    for form in ("plain_vs_plain", "function_vs_plain", "hooks_vs_plain"):
        assert all(float(v) == 0.0 for v in out["swin_tiny"][form].values()), out
        assert all(float(v) < 1e-6 for v in out["mvitv2_tiny"][form].values()), out
    assert mlp._form == "auto"


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11),
                    reason="fake CUDA tensors need torch >= 2.11 on a machine without a GPU")
def test_on_the_gpu_path_the_norms_float32_copies_are_remade_too(monkeypatch) -> None:
    """On fake CUDA tensors under bf16 autocast (the GPU's code path, the hooks form by default):
    every linear input of a pre-norm or GELU becomes a recipe, and so does each float32 copy that
    autocast's float32 LayerNorm makes of a bf16 input (Swin's residual stream after a patch
    merging), which the norm would otherwise keep."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from launches import cuda_autocast, fake_cuda

    made: list[str] = []
    real_init = recompute._Recipe.__init__

    def init(self, fn, *rest):
        made.append("cast" if fn is recompute._same else "input")
        real_init(self, fn, *rest)

    monkeypatch.setattr(recompute._Recipe, "__init__", init)
    model = _model()
    with fake_cuda(), mlp.activation_recompute(True, min_bytes=0):  # every layer, however small
        model = model.to("cuda")
        x = torch.empty(2, 3, 64, 96, device="cuda")
        with cuda_autocast(torch.bfloat16):
            model(x)
    assert made.count("input") == 4 * 3 + 3
    # bf16 inputs: both pre-norms of the blocks of stages 2-4, and the norms of the last two mergings
    assert made.count("cast") == 3 * 2 + 2


def test_off_the_cpu_only_layers_with_large_activations_recompute(monkeypatch) -> None:
    """The default threshold (8 MiB of the activation a layer would free, in the linear's dtype):
    Swin-T at batch 8 and 512x768 on fake CUDA tensors under bf16 autocast recomputes every layer
    but the pre-norms of stage 4 (4.5 MiB each; stage 3's have 9 MiB, the GELUs 18-144 MiB); at
    16 MiB it also keeps stage 3's pre-norms and the last merging's norm (9 MiB). At 64x96 nothing
    reaches it; ``min_bytes=0`` recomputes all 39 layers; the CPU ignores the threshold."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from launches import cuda_autocast, fake_cuda

    made: list[int] = []
    real_init = recompute._Recipe.__init__

    def init(self, fn, *rest):
        if fn is not recompute._same:
            made.append(1)
        real_init(self, fn, *rest)

    monkeypatch.setattr(recompute._Recipe, "__init__", init)

    def recipes(size: tuple[int, int], batch: int, device: str = "cuda", **setting) -> int:
        made.clear()
        torch.manual_seed(0)
        model = vtdense.create_backbone("swin_tiny", out_norm=False, drop_path_rate=0.0).train()
        with contextlib.ExitStack() as stack:
            if device == "cuda":
                stack.enter_context(fake_cuda())
                model = model.to("cuda")
                stack.enter_context(cuda_autocast(torch.bfloat16))
            if setting:
                stack.enter_context(mlp.activation_recompute(True, **setting))
            model(torch.empty(batch, 3, *size, device=device))
        return len(made)

    assert mlp._min_bytes == 8 << 20
    assert recipes((512, 768), 8) == 12 * 3 + 3 - 4
    assert recipes((512, 768), 8, min_bytes=16 << 20) == 2 * 3 + 1 + 2 * 3 + 1 + 6 + 2
    assert recipes((64, 96), 1) == 0
    assert recipes((64, 96), 1, min_bytes=0) == 12 * 3 + 3
    assert recipes((512, 768), 8, min_bytes=0) == 12 * 3 + 3
    assert mlp._min_bytes == 8 << 20  # restored
    with pytest.raises(ValueError, match="min_bytes must be >= 0"):
        mlp.set_activation_recompute(True, min_bytes=-1)
    mlp._set_recompute_form("hooks")  # the CPU ignores the threshold: a small model recomputes every layer
    monkeypatch.setattr(cpu_window_attention, "MIN_BYTES", 1 << 62)  # (the pre-norms hooked, as on a GPU)
    try:
        assert recipes((64, 96), 1, device="cpu") == 12 * 3 + 3
    finally:
        mlp._set_recompute_form("auto")
