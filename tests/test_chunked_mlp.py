"""The MLP's chunked CPU training step (``vtdense.layers.chunked_mlp``).

Its outputs and gradients equal plain autograd's to float rounding (the matmuls run on fewer
rows, and the weight gradients are sums over chunks), for every combination of pre-norm, biases and frozen inputs;
it keeps only ``x`` and the ``fc1`` output for the backward pass and never holds a hidden-width
tensor of all rows; and ``Mlp`` takes it exactly where it should.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import vtdense
from tests.test_swin import randomize_
from vtdense.layers import chunked, chunked_mlp as cm
from vtdense.layers.chunked import cpu_chunking
from vtdense.layers.mlp import Mlp

ROWS, DIM, HIDDEN = 2 * 37, 12, 48
BUDGET = 10 * HIDDEN * 4  # 10 rows a chunk: 8 chunks, the last one shorter


def _assert_close(a: torch.Tensor, b: torch.Tensor, name: str, floor: float = 1e-7) -> None:
    """Equal to float32 rounding of sums in another order: within 1e-5 of the largest entry."""
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= 1e-5 * scale + floor, (name, err, scale)


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked, "MIN_ROWS", 1)  # let the tiny budgets below cut tiny chunks


def _model(norm: bool, bias: bool) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.LayerNorm | None]:
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(DIM, HIDDEN, bias=bias), torch.nn.Linear(HIDDEN, DIM + 4, bias=bias)
    ln = randomize_(torch.nn.LayerNorm(DIM), std=0.5) if norm else None
    return fc1, fc2, ln


def _run(chunked: bool, fc1, fc2, ln, x, frozen: set[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    params = {"fc1.weight": fc1.weight, "fc2.weight": fc2.weight}
    params.update({"fc1.bias": fc1.bias, "fc2.bias": fc2.bias} if fc1.bias is not None else {})
    params.update({"ln.weight": ln.weight, "ln.bias": ln.bias} if ln is not None else {})
    for name, p in params.items():
        p.grad = None
        p.requires_grad_(name not in frozen)
    x = x.detach().requires_grad_("x" not in frozen)
    if chunked:
        y = cm.chunked_mlp(x, fc1, fc2, ln, budget=BUDGET)
    else:
        y = fc2(F.gelu(fc1(ln(x) if ln is not None else x)))
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in params.items()}}


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen", [set(), {"x"}, {"fc1.weight", "fc1.bias", "ln.weight", "ln.bias"}, {"x", "fc2.weight"}])
def test_chunked_mlp_matches_plain_autograd(norm: bool, bias: bool, frozen: set[str]) -> None:
    fc1, fc2, ln = _model(norm, bias)
    x = torch.randn(2, 37, DIM)
    y, grads = _run(True, fc1, fc2, ln, x, frozen)
    y_ref, grads_ref = _run(False, fc1, fc2, ln, x, frozen)
    _assert_close(y, y_ref, "output")  # the same ops; only the matmul blocking differs
    assert grads.keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        if name in frozen:
            assert grads[name] is None, name
            continue
        assert grads[name] is not None and grads[name].shape == g.shape, name
        _assert_close(grads[name], g, name)


def test_chunked_mlp_keeps_x_and_h_and_no_whole_hidden_tensor() -> None:
    fc1, fc2, ln = _model(True, True)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    saved: list[torch.Tensor] = []
    weights = {p.untyped_storage().data_ptr() for m in (fc1, fc2, ln) for p in m.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t)
        return t

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                # activations are (rows, HIDDEN); fc1.weight.t(), fc2.weight and its gradient are
                # (DIM, HIDDEN) and (DIM + 4, HIDDEN)
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == HIDDEN and t.shape[0] not in (DIM, DIM + 4):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Largest():
        y = cm.chunked_mlp(x, fc1, fc2, ln, budget=BUDGET)
        y.sum().backward()
    assert saved[0] is x or saved[0].data_ptr() == x.data_ptr()
    hidden = [t for t in saved if t.shape[-1] == HIDDEN]
    assert sum(t.shape[0] for t in hidden) == ROWS and len(hidden) == 8  # h, one tensor per chunk
    assert sum(t.numel() for t in saved) == ROWS * DIM + ROWS * HIDDEN  # nothing else
    assert 0 < Largest.numel <= 10 * HIDDEN  # no hidden-width tensor over more than one chunk


def _grad_fn_names(y: torch.Tensor) -> set[str]:
    names, seen, todo = set(), set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            names.add(fn.name())
            todo.extend(f for f, _ in fn.next_functions)
    return names


def test_mlp_takes_the_chunked_path_only_for_large_cpu_training_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    mlp, norm = Mlp(DIM, HIDDEN), torch.nn.LayerNorm(DIM)
    x = torch.randn(ROWS, DIM, requires_grad=True)
    own = "_ChunkedMlpBackward"
    assert own not in _grad_fn_names(mlp(x, norm=norm))  # ROWS * HIDDEN * 4 bytes: under the threshold
    monkeypatch.setattr(chunked, "TRAIN_CHUNK_MIN_BYTES", ROWS * HIDDEN * 4)
    assert own in _grad_fn_names(mlp(x, norm=norm)) and own in _grad_fn_names(mlp(x))
    with cpu_chunking(False):
        assert own not in _grad_fn_names(mlp(x, norm=norm))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert own not in _grad_fn_names(mlp(x, norm=norm))
    mlp_drop = Mlp(DIM, HIDDEN, drop=0.1).train()
    assert own not in _grad_fn_names(mlp_drop(x, norm=norm))
    with torch.no_grad():  # inference has its own chunked path (Mlp.add_to_), not this one
        assert mlp(x, norm=norm).grad_fn is None


@pytest.mark.parametrize("name", ["swin", "swinv2", "mvitv2"])
def test_backbone_gradients_with_chunked_mlp_match_unchunked(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole tiny backbones (pre-norm V1 and MViTv2, post-norm V2, the MViTv2 projected-shortcut
    MLP without a norm): chunked MLPs in every block give the unchunked gradients."""
    monkeypatch.setattr(chunked, "TRAIN_CHUNK_MIN_BYTES", 0)
    monkeypatch.setattr(cm, "TRAIN_CHUNK_BYTES", 64 * 4 * 4 * 16)  # a few chunks per block (attention too: no threshold)
    torch.manual_seed(0)
    if name == "mvitv2":
        model = vtdense.create_backbone("mvitv2_tiny", embed_dim=16, depths=(1, 2, 1, 1), drop_path_rate=0.0,
                                        expand_attn=False)
    else:
        model = vtdense.create_backbone(f"{name}_tiny", embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                                        window_size=4, drop_path_rate=0.0)
    model = randomize_(model).train()
    x = torch.randn(2, 3, 64, 96)

    def run(chunk: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with cpu_chunking(chunk):
            feats = list(model(x).values())
            names = set().union(*(_grad_fn_names(f) for f in feats))
            assert ("_ChunkedMlpBackward" in names) == chunk
            sum((f * torch.linspace(-1, 1, f.numel()).view_as(f)).sum() for f in feats).backward()
        return [f.detach() for f in feats], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (feats, grads), (feats_ref, grads_ref) = run(True), run(False)
    for a, b in zip(feats, feats_ref):
        _assert_close(a, b, "features")
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    # key-norm biases shift every logit of a query row equally (softmax ignores that): their true
    # gradient is 0 and their computed one rounding noise, so their floor is the largest gradient's;
    # every other parameter is held to its own scale
    floor = 1e-5 * max(g.abs().max().item() for g in grads_ref.values())
    for n, g in grads_ref.items():
        _assert_close(grads[n], g, n, floor if n.endswith("norm_k.bias") else 1e-7)
