"""The ``vtdense unfused`` benchmark contender: vtdense's training without its two memory-saving
autograd functions, to time what they cost. It must compute the same gradients through the plain
operations, take effect only inside its step, and leave the library as it found it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import contenders  # noqa: E402

import vtdense  # noqa: E402
from vtdense.layers import mlp  # noqa: E402


def _grads(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    sum(f.square().mean() for f in model(x).values()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_unfused_swaps_the_functions_for_plain_ops_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                                    window_size=4, out_norm=False, drop_path_rate=0.0).train()
    x = torch.randn(1, 3, 64, 96)
    fused_fns = mlp._NormLinear, mlp._GeluLinear
    calls = []
    real_apply = mlp._NormLinear.apply

    def counting_apply(*args):
        calls.append(1)
        return real_apply(*args)

    mlp._NormLinear.apply = counting_apply
    try:
        fused = _grads(model, x)
        n_fused = len(calls)
        with contenders.unfused():
            assert (mlp._NormLinear, mlp._GeluLinear) == (contenders._PlainNormLinear, contenders._PlainGeluLinear)
            plain = _grads(model, x)
        assert len(calls) == n_fused > 0  # the fused path ran before, and not inside unfused()
    finally:
        del mlp._NormLinear.apply  # back to the class's own staticmethod
    assert (mlp._NormLinear, mlp._GeluLinear) == fused_fns
    assert fused.keys() == plain.keys() and len(fused) > 10
    for name in fused:
        torch.testing.assert_close(plain[name], fused[name], rtol=1e-4, atol=1e-6, msg=name)


def test_unfused_contender_step_runs_and_restores_the_library() -> None:
    case = dict(family="swin_t", mode="train", batch=1, size=(64, 96))
    step = contenders.make_step("vtdense unfused", case, "cpu")
    step()
    assert mlp._NormLinear.__name__ == "_NormLinear" and mlp._GeluLinear.__name__ == "_GeluLinear"
