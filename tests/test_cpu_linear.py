"""Float32 CPU linear layers through oneDNN (vtdense.layers.cpu_linear).

Both backends are forced in turn, whatever this machine's probe would choose, so the oneDNN path
is checked on every machine: values and gradients against ``F.linear`` and plain autograd, the
backbones against timm, where each linear layer really ran (counted by a dispatch mode), and
that no packed weight outlives a forward pass.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import vtdense
from vtdense.layers import cpu_linear
from vtdense.layers.cpu_linear import linear, mm, mm_tn, packed_weights, use_cpu_matmul
from probe import probe_loss

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


class _Ops(TorchDispatchMode):
    """Counts the matmul-like ops that run."""

    NAMES = ("_linear_pointwise", "addmm", "mm", "linear", "bmm", "baddbmm", "matmul")

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.__name__.split(".")[0]
        if name in self.NAMES:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max() <= tol * scale, float((a - b).abs().max() / scale)


@pytest.mark.parametrize("backend", ["onednn", "blas"])
@pytest.mark.parametrize("shape", [(7, 96), (2, 5, 6, 96)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_values_and_gradients_equal_plain_autograd(backend: str, shape: tuple[int, ...], with_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(288, 96, generator=g, requires_grad=True)
    b = torch.randn(288, generator=g, requires_grad=True) if with_bias else None
    go = torch.randn(*shape[:-1], 288, generator=g)
    with use_cpu_matmul(backend), _Ops() as ops:
        y = linear(x, w, b)
        grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], go)
    ref_y = F.linear(x, w, b)
    ref = torch.autograd.grad(ref_y, [t for t in (x, w, b) if t is not None], go)
    _close(y, ref_y)
    for a, r in zip(grads, ref):
        assert a.shape == r.shape and a.is_contiguous()
        _close(a, r)
    assert (ops.counts.get("_linear_pointwise", 0) == 3) == (backend == "onednn"), ops.counts


def test_flop_counter_counts_the_onednn_matmuls() -> None:
    """``FlopCounterMode`` gives a backbone the same FLOPs on either backend, eager and compiled."""
    from torch.utils.flop_counter import FlopCounterMode

    model = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8])
    x = torch.randn(1, 3, 64, 96)
    counts = []
    for backend in ("blas", "onednn"):
        with use_cpu_matmul(backend), FlopCounterMode(display=False) as counter:
            sum(f.sum() for f in model(x).values()).backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0
    g = torch.Generator().manual_seed(0)
    a, w, gout = torch.randn(10, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(10, 24, generator=g)
    with FlopCounterMode(display=False) as counter:
        torch.ops.vtdense.onednn_linear(a, w, None)
        torch.ops.vtdense.onednn_mm(gout, w)
        torch.ops.vtdense.onednn_mm_tn(gout, a)
    assert counter.get_total_flops() == 3 * 2 * 10 * 16 * 24


def test_double_backward_through_the_onednn_linear() -> None:
    """Under ``create_graph`` the backward stays differentiable (a gradient penalty)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=g, requires_grad=True)
    w = torch.randn(48, 32, generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True)

    def penalty(fn):  # noqa: ANN001, ANN202
        y = fn(x, w, b)
        (gx,) = torch.autograd.grad(y.tanh().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), [w, b])

    with use_cpu_matmul("onednn"):
        ours = penalty(linear)
    for a, r in zip(ours, penalty(F.linear)):
        _close(a, r)


def test_mm_helpers_equal_torch_mm() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(300, 96, generator=g), torch.randn(96, 384, generator=g)
    gout = torch.randn(300, 384, generator=g)
    with use_cpu_matmul("onednn"), _Ops() as ops:
        ab, tn1, tn2 = mm(a, b), mm_tn(gout, a), mm_tn(a, gout)
    assert ops.counts == {"_linear_pointwise": 3}, ops.counts
    _close(ab, a @ b)
    _close(tn1, gout.t() @ a)
    _close(tn2, a.t() @ gout)
    assert tn1.is_contiguous() and tn2.is_contiguous()


def test_other_dtypes_autocast_and_graphs_keep_f_linear() -> None:
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with use_cpu_matmul("onednn"):
        with _Ops() as ops:
            linear(x.double(), w.double())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = linear(x, w)
            linear(x[:0], w)
        assert y.dtype == torch.bfloat16
        assert "_linear_pointwise" not in ops.counts, ops.counts

        class M(torch.nn.Module):
            def forward(self, t: torch.Tensor) -> torch.Tensor:
                return linear(t, w)

        graph = str(torch.export.export(M(), (x,)).graph)  # exported graphs stay portable
        assert "linear" in graph and "mkldnn" not in graph and "vtdense" not in graph, graph
        compiled = torch.compile(M(), backend="aot_eager", fullgraph=True)
        _close(compiled(x), x @ w.t())  # inside torch.compile: the vtdense::onednn_linear op


@pytest.mark.parametrize("name,timm_name,size", [("swin_tiny", "swin_tiny_patch4_window7_224", 224),
                                                  ("swinv2_tiny", "swinv2_tiny_window8_256", 256),
                                                  ("mvitv2_tiny", "mvitv2_tiny", 224)])
def test_backbones_through_onednn_equal_timm_and_blas(name: str, timm_name: str, size: int) -> None:
    """Every linear layer of an eval forward runs through oneDNN (no BLAS matmul left); the maps
    equal timm's to 1e-5 of their largest value; a training step's gradients equal the BLAS path's."""
    from test_swin import randomize_

    torch.manual_seed(0)
    ref = randomize_(timm.create_model(timm_name, pretrained=False)).eval()
    ours = vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0).eval()
    vtdense.load_pretrained(ours, ref.state_dict())
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3))
    with use_cpu_matmul("onednn"), torch.no_grad():
        ours(x)  # (Swin V2's Log-CPB MLP runs once per size, then its output is cached)
        with _Ops() as ops:
            got = list(ours(x).values())
    assert ops.counts.get("_linear_pointwise", 0) > 0
    assert not ops.counts.get("addmm") and not ops.counts.get("mm") and not ops.counts.get("linear"), ops.counts
    with use_cpu_matmul("blas"), torch.no_grad():
        want = ref.forward_intermediates(x, intermediates_only=True)
    for a, b in zip(got, want):
        assert a.shape == b.shape and b.std() > 0.5
        _close(a, b)

    ours.train()
    xs = x[:1, :, :96, :128].clone()
    grads = {}
    for backend in ("onednn", "blas"):
        ours.zero_grad(set_to_none=True)
        with use_cpu_matmul(backend):
            probe_loss(ours(xs)).backward()
        grads[backend] = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    assert grads["onednn"].keys() == grads["blas"].keys()
    for n in grads["blas"]:
        _close(grads["onednn"][n], grads["blas"][n], 1e-4)


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
@pytest.mark.parametrize("through_data", [False, True])
def test_packed_copies_live_for_one_forward_and_follow_in_place_edits(name: str, through_data: bool) -> None:
    """Weights edited between two forwards are used as they are now: the packed copies last one
    call; the cached position bias follows too, also after an edit through ``.data``, which
    autograd's version counter does not see."""
    torch.manual_seed(0)
    kw = dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8])
    model = vtdense.create_backbone(name, **kw).eval()
    x = torch.randn(1, 3, 64, 64)
    with use_cpu_matmul("onednn"), torch.no_grad():
        model(x)
        assert getattr(cpu_linear._local, "cache", None) is None
        for p in model.parameters():
            (p.data if through_data else p).mul_(1.5)
        edited = model(x)
        fresh = vtdense.create_backbone(name, **kw).eval()
        fresh.load_state_dict(model.state_dict())
        want = fresh(x)
    for k in want:
        _close(edited[k], want[k])
    w = torch.randn(8, 16)
    x2 = torch.randn(cpu_linear.PACK_MIN_ROWS, 16)  # enough rows for the scope to pack the weight
    with use_cpu_matmul("onednn"):
        with packed_weights():
            a = linear(x2, w)
            w.mul_(2)  # inside one scope: a version bump is seen
            b = linear(x2, w)
        _close(b, 2 * a)
        w.data.mul_(2)  # unseen by the version counter, but the next scope packs afresh
        with packed_weights():
            _close(linear(x2, w), 4 * a)


def test_environment_variable_is_checked_and_auto_draws_no_random_numbers() -> None:
    code = (
        "import torch\n"
        "from vtdense.layers import cpu_linear\n"
        "torch.manual_seed(0); cpu_linear.linear(torch.ones(4, 8), torch.ones(2, 8)); a = torch.rand(3)\n"
        "torch.manual_seed(0); b = torch.rand(3)\n"
        "assert torch.equal(a, b)\n"
        "print(cpu_linear.cpu_matmul())\n"
    )
    env = {"VTDENSE_CPU_MATMUL": "auto"}
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("onednn", "blas")
    forced = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VTDENSE_CPU_MATMUL": "BLAS"},
                            capture_output=True, text=True)
    assert forced.stdout.strip() == "blas", forced.stderr
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VTDENSE_CPU_MATMUL": "mkl"},
                         capture_output=True, text=True)
    assert bad.returncode != 0
    assert "VTDENSE_CPU_MATMUL='mkl'" in bad.stderr and "expected one of" in bad.stderr.splitlines()[-1]
    with pytest.raises(ValueError, match="one of"):
        cpu_linear.set_cpu_matmul("openblas")


def test_detector_box_head_and_predictor_run_through_onednn_as_torchvision() -> None:
    """The R-CNN box head and predictor keep torchvision's layers and keys; with oneDNN they give
    torchvision's outputs and gradients."""
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

    from vtdense.models.detection import BoxHead, BoxPredictor

    torch.manual_seed(0)
    ours_head, ours_pred = BoxHead(16 * 7 * 7, 64), BoxPredictor(64, 5)
    ref_head, ref_pred = TwoMLPHead(16 * 7 * 7, 64), FastRCNNPredictor(64, 5)
    ref_head.load_state_dict(ours_head.state_dict())
    ref_pred.load_state_dict(ours_pred.state_dict())
    x = torch.randn(12, 16, 7, 7, requires_grad=True)
    with use_cpu_matmul("onednn"), _Ops() as ops:
        logits, deltas = ours_pred(ours_head(x))
        (logits.sum() + deltas.square().sum()).backward()
    assert ops.counts.get("_linear_pointwise", 0) >= 4 and not ops.counts.get("addmm"), ops.counts
    got = [logits, deltas, x.grad, ours_head.fc6.weight.grad, ours_pred.bbox_pred.weight.grad]
    x.grad = None
    logits, deltas = ref_pred(ref_head(x))
    (logits.sum() + deltas.square().sum()).backward()
    for a, b in zip(got, [logits, deltas, x.grad, ref_head.fc6.weight.grad, ref_pred.bbox_pred.weight.grad]):
        _close(a, b)
    with pytest.raises(AssertionError, match="box features must be"):
        ours_pred(torch.randn(2, 64, 2, 1))


def test_auto_probes_only_real_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backbone built under ``torch.device("meta")`` or inside a dispatch mode (fake tensors,
    FLOP counting) leaves the choice to the first call outside it: timing meta or fake ops would
    decide at random, and a FLOP counter would count the probe."""
    from torch.utils.flop_counter import FlopCounterMode

    with use_cpu_matmul("auto"):
        cpu_linear._use = None
        with FlopCounterMode(display=False) as counter:
            vtdense.create_backbone("swin_tiny", embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1])
            assert cpu_linear.cpu_matmul() == "blas"
        assert cpu_linear._use is None and counter.get_total_flops() == 0
        seen = []
        real_lp = cpu_linear._lp
        monkeypatch.setattr(cpu_linear, "_lp", lambda x, w, b: (seen.append(x.device.type), real_lp(x, w, b))[1])
        with torch.device("meta"):
            model = vtdense.create_backbone("swin_tiny", embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1])
        assert next(model.parameters()).is_meta
        assert cpu_linear._use is not None and seen and set(seen) == {"cpu"}  # probed on real CPU tensors


def test_auto_keeps_whichever_library_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` times both once: a oneDNN kernel slower than the BLAS is not chosen, a faster one is."""
    import time

    plain_linear = F.linear
    fast_lp = cpu_linear._lp

    def slow(fn):  # noqa: ANN001, ANN202
        def wrapped(*args):  # noqa: ANN002, ANN202
            time.sleep(0.05)  # far above either kernel, even on a loaded machine
            return fn(*args)
        return wrapped

    monkeypatch.setattr(cpu_linear, "_lp", slow(fast_lp))
    with use_cpu_matmul("auto"):
        assert cpu_linear.cpu_matmul() == "blas"
    monkeypatch.setattr(cpu_linear, "_lp", fast_lp)
    monkeypatch.setattr(cpu_linear.F, "linear", slow(plain_linear))
    with use_cpu_matmul("auto"):
        assert cpu_linear.cpu_matmul() == "onednn"


def test_auto_times_the_weight_gradient_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight-gradient product (``mm_tn``) has its own probe: where oneDNN wins the linears but
    its transposed copy makes it lose ``g.T @ x``, linears run on oneDNN and ``mm_tn`` on
    ``torch.mm``; a forced backend takes both; on leaving the scope the old choice comes back."""
    import time

    plain_linear, onednn_tn = F.linear, cpu_linear._onednn_mm_tn

    def slow(fn):  # noqa: ANN001, ANN202
        def wrapped(*args):  # noqa: ANN002, ANN202
            time.sleep(0.05)
            return fn(*args)
        return wrapped

    g, x = torch.randn(300, 384), torch.randn(300, 96)
    monkeypatch.setattr(cpu_linear.F, "linear", slow(plain_linear))
    before = (cpu_linear._choice, cpu_linear._use, cpu_linear._use_tn)
    for tn_slow, tn_op in ((True, "mm"), (False, "_linear_pointwise")):
        monkeypatch.setattr(cpu_linear, "_onednn_mm_tn", slow(onednn_tn) if tn_slow else onednn_tn)
        if not tn_slow:  # now the BLAS's product is the slow one
            monkeypatch.setattr(cpu_linear.torch, "mm", slow(torch.ops.aten.mm))
        with use_cpu_matmul("auto"):
            assert cpu_linear.cpu_matmul() == "onednn"  # (resolved outside the counting mode)
            monkeypatch.undo()  # the real kernels again, the choice kept
            with _Ops() as ops:
                got = mm_tn(g, x)
            assert ops.counts == {tn_op: 1}, ops.counts
            _close(got, g.t() @ x)
        monkeypatch.setattr(cpu_linear.F, "linear", slow(plain_linear))
    monkeypatch.undo()
    assert (cpu_linear._choice, cpu_linear._use, cpu_linear._use_tn) == before
    with use_cpu_matmul("onednn"), _Ops() as ops:
        mm_tn(g, x)
    assert ops.counts == {"_linear_pointwise": 1}, ops.counts


def test_a_scope_packs_a_weight_only_for_calls_with_enough_rows() -> None:
    """Reordering a weight costs about what reading it does: a call with few rows runs oneDNN on the
    plain weight (faster for it), a call with :data:`PACK_MIN_ROWS` rows packs it, and every later
    call in the scope, small ones included, reuses that copy. Values are the same either way."""
    from tests.op_calls import OpCalls

    torch.manual_seed(0)
    w, b = torch.randn(64, 32), torch.randn(64)
    small, large = torch.randn(5, 32), torch.randn(cpu_linear.PACK_MIN_ROWS, 32)
    with use_cpu_matmul("onednn"), torch.no_grad(), packed_weights():
        with OpCalls(torch.ops.mkldnn._reorder_linear_weight) as reorders:
            got_small = linear(small, w, b)
            assert reorders.count == 0
            got_large = linear(large, w, b)
            assert reorders.count == 1
            again = linear(small, w, b)
            assert reorders.count == 1
    for got, x in ((got_small, small), (got_large, large), (again, small)):
        _close(got, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny", "mvitv2_tiny"])
def test_a_backbone_built_under_inference_mode_runs_in_and_out_of_it(name: str) -> None:
    """Weights made under ``torch.inference_mode`` have no version counter, which the caches of
    packed weights and of Swin's position bias stamped their entries with ("Inference tensors do not
    track version counter"). Such a model runs inside inference mode and out of it (no_grad), through
    the chunked CPU paths with packed weights, with the maps of a model built normally."""
    torch.manual_seed(0)
    kw = dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=1 if name.startswith("mvit") else [1, 2, 4, 8])
    ref = vtdense.create_backbone(name, **kw).eval()
    x = torch.randn(2, 3, 128, 128)  # stage 1: 2048 rows, enough to pack weights
    with use_cpu_matmul("onednn"):
        with torch.inference_mode():
            model = vtdense.create_backbone(name, **kw).eval()
            model.load_state_dict(ref.state_dict())
            assert next(model.parameters()).is_inference()
            inside = [model(x), model(x)]
        with torch.no_grad():
            outside, want = model(x), ref(x)
    for got in (*inside, outside):
        for k in want:
            _close(got[k], want[k])
