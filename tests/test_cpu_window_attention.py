"""Windowed attention with its own backward for CPU training steps
(``vtdense.layers.cpu_window_attention``): the values and every gradient equal the math path's
to float rounding, and Swin blocks take it exactly where they should."""

from __future__ import annotations

import pytest
import torch

import vtdense
from tests.test_swin import randomize_
from vtdense.layers.attention import _math, attention_backend
from vtdense.layers import chunked
from vtdense.layers import cpu_window_attention
from vtdense.layers.chunked import cpu_chunking
from vtdense.layers.cpu_window_attention import norm_qkv_window_attention, qkv_window_attention

B, NW, N, H, D = 2, 3, 5, 2, 4


def _reference(qk: torch.Tensor, term: torch.Tensor, scale: float, v: torch.Tensor | None) -> torch.Tensor:
    q, k = qk[:, :, :, 0].transpose(2, 3), qk[:, :, :, 1].transpose(2, 3)  # (B, nW, heads, N, d)
    v = (qk[:, :, :, 2] if v is None else v).transpose(2, 3)
    return _math(q, k, v, term, scale, 0.0)


def _grads(fn, qk: torch.Tensor, term: torch.Tensor, v: torch.Tensor | None, frozen: set[str]):  # noqa: ANN001, ANN202
    leaves = {"qk": qk, "term": term, **({"v": v} if v is not None else {})}
    leaves = {n: t.detach().requires_grad_(n not in frozen) for n, t in leaves.items()}
    out = fn(leaves["qk"], leaves["term"], 0.37, leaves.get("v"))
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("split_v", [False, True])
@pytest.mark.parametrize("per_window", [True, False])
@pytest.mark.parametrize("frozen", [set(), {"term"}, {"qk"}, {"qk", "v"}])
def test_values_and_gradients_equal_the_math_path(split_v: bool, per_window: bool, frozen: set[str]) -> None:
    torch.manual_seed(0)
    qk = torch.randn(B, NW, N, 2 if split_v else 3, H, D)
    v = torch.randn(B, NW, N, H, D + 1) if split_v else None
    term = torch.randn(NW, H, N, N) if per_window else torch.randn(H, N, N)
    if per_window:
        term[1, :, :, 2] = -100.0  # a masked key, as Swin's shifted windows have
    out, grads = _grads(lambda *a: qkv_window_attention(a[0], a[1], a[2], v=a[3]), qk, term, v, frozen)
    ref, grads_ref = _grads(_reference, qk, term, v, frozen)
    assert out.shape == ref.shape == (B, NW, H, N, (D + 1) if split_v else D)
    assert out.transpose(2, 3).is_contiguous()  # heads merge into channels with a view
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for name, g in grads_ref.items():
        if name in frozen or (name == "v" and "qk" in frozen and not split_v):
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("budget", [1, 4 * 3 * 8 * 5 * 4, 1 << 30])  # one window, 4 windows, the whole batch
@pytest.mark.parametrize("per_window", [True, False])
@pytest.mark.parametrize("frozen", [set(), {"x"}, {"qkv.weight", "qkv.bias", "norm.weight", "norm.bias"}, {"term"}])
def test_norm_qkv_attention_equals_autograd_of_its_parts(budget: int, per_window: bool, frozen: set[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """V1's fused branch (norm, qkv projection, attention) over chunks of windows: whole images,
    runs of windows inside an image, and single windows."""
    monkeypatch.setattr(chunked, "MIN_ROWS", 1)
    torch.manual_seed(0)
    C = H * D
    norm, proj = randomize_(torch.nn.LayerNorm(C), std=0.5), torch.nn.Linear(C, 3 * C)
    x0 = torch.randn(B, NW, N, C)
    term0 = torch.randn(NW, H, N, N) if per_window else torch.randn(H, N, N)

    def run(fused: bool):  # noqa: ANN202
        params = {"norm.weight": norm.weight, "norm.bias": norm.bias, "qkv.weight": proj.weight, "qkv.bias": proj.bias}
        for n, p in params.items():
            p.grad = None
            p.requires_grad_(n not in frozen)
        x, term = x0.clone().requires_grad_("x" not in frozen), term0.clone().requires_grad_("term" not in frozen)
        if fused:
            out = norm_qkv_window_attention(x, norm, proj, term, 0.37, H, budget=budget)
        else:
            out = _reference(proj(norm(x)).view(B, NW, N, 3, H, D), term, 0.37, None)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), {"x": x.grad, "term": term.grad, **{n: p.grad for n, p in params.items()}}

    (out, grads), (ref, grads_ref) = run(True), run(False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for name, g in grads_ref.items():
        if name in frozen:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def _uses_own_backward(y: torch.Tensor) -> bool:
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if fn.name() in ("_QkvWindowAttentionBackward", "_NormQkvWindowAttentionBackward"):
            return True
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return False


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
def test_swin_training_takes_it_on_the_cpu_only_where_it_applies(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = randomize_(vtdense.create_backbone(name, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4,
                                               out_indices=(0, 1), drop_path_rate=0.0)).train()
    x = torch.randn(1, 3, 32, 48)

    def run() -> torch.Tensor:
        return list(model(x).values())[-1]

    assert not _uses_own_backward(run())  # qkv far under cpu_window_attention.MIN_BYTES: SDPA's math path
    monkeypatch.setattr(cpu_window_attention, "MIN_BYTES", 0)
    monkeypatch.setattr(chunked, "TRAIN_CHUNK_MIN_BYTES", 1 << 30)  # (the chunked MLP's threshold is not this one)
    assert _uses_own_backward(run())
    with cpu_chunking(False):
        assert not _uses_own_backward(run())
    with attention_backend("math"):  # a backend the user chose is kept
        assert not _uses_own_backward(run())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _uses_own_backward(run())
    model.layers[0].blocks[0].attn.attn_drop = 0.1
    assert not _uses_own_backward(model.layers[0].blocks[0].attn(torch.randn(1, 2, 16, 16), (4, 4)))
