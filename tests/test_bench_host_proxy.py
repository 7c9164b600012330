"""benchmarks/host_proxy.py: the GPU code forms of a training step, timed and counted on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_proxy  # noqa: E402

from vtdense.layers import attention, mlp  # noqa: E402


def test_proxy_times_and_counts_every_contender_and_restores_the_settings(capsys) -> None:  # noqa: ANN001
    threads = torch.get_num_threads()
    assert host_proxy.main(["--size", "64x64", "--repeats", "2"]) == 0
    table = capsys.readouterr().out
    for name in ("vtdense", "vtdense unfused", "vtdense fn-recompute", "timm fused"):
        assert f"| {name} |" in table
    rows = host_proxy.measure("swin_t", (64, 64), repeats=1)
    by = {r["contender"]: r for r in rows}
    assert all(r["forward_ms"] > 0 and r["backward_ms"] > 0 for r in rows)
    # the hooks form remakes each recomputed layer's input in Python during the backward pass (39
    # layers: 27 pre-norms, 12 GELUs); without the recomputation the backward is autograd's C++ alone
    assert by["vtdense"]["backward_calls"] > by["vtdense unfused"]["backward_calls"] + 39
    assert by["vtdense"]["forward_calls"] > by["timm fused"]["forward_calls"]
    # the process-wide switches are back as they were, and so is the thread count
    assert attention._GPU_LAYOUT_ON_CPU is False and mlp._form == "auto" and mlp._recompute is True
    assert torch.get_num_threads() == threads


def test_gpu_forms_take_the_hooks_recomputation_on_the_cpu() -> None:
    """Under :func:`host_proxy.gpu_forms` a CPU tensor takes the saved-tensor-hooks form (the GPU
    default), not the CPU's autograd functions."""
    x = torch.randn(4, 8, requires_grad=True)
    assert mlp._via_hooks(x) is False
    with host_proxy.gpu_forms():
        assert mlp._via_hooks(x) is True and attention.gpu_layout(x.device)
    assert mlp._via_hooks(x) is False and not attention.gpu_layout(x.device)
