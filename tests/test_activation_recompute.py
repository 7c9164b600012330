"""``vtdense.layers.mlp.set_activation_recompute``: training with or without the two memory-saving
autograd functions (norm -> linear, GELU -> linear). Off, the backbones keep what plain autograd
keeps (more bytes saved for the backward pass) and compute the same gradients."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

import vtdense
from vtdense.layers import mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return vtdense.create_backbone("swin_tiny", embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                                   window_size=4, out_norm=False, drop_path_rate=0.0).train()


@contextlib.contextmanager
def _fused_calls() -> Iterator[list[int]]:
    """A list that gets one entry per call of the two memory-saving autograd functions in the block."""
    calls: list[int] = []
    real = mlp._NormLinear.apply, mlp._GeluLinear.apply
    mlp._NormLinear.apply = lambda *a: (calls.append(1), real[0](*a))[1]
    mlp._GeluLinear.apply = lambda *a: (calls.append(1), real[1](*a))[1]
    try:
        yield calls
    finally:
        del mlp._NormLinear.apply, mlp._GeluLinear.apply  # back to the inherited classmethod


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], int, int]:
    """Gradients, the bytes of the distinct storages autograd saved, and the fused functions' calls."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with _fused_calls() as calls:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        sum(f.square().mean() for f in out.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, sum(storages.values()), len(calls)


def test_off_keeps_more_activations_and_gives_the_same_gradients() -> None:
    model, x = _model(), torch.randn(2, 3, 64, 96)
    on, saved_on, calls_on = _step(model, x)
    with mlp.activation_recompute(False):
        assert mlp._recompute is False
        off, saved_off, calls_off = _step(model, x)
    assert mlp._recompute is True  # restored
    assert calls_on > 0 and calls_off == 0
    assert saved_off > saved_on * 1.1, (saved_on, saved_off)
    assert on.keys() == off.keys() and len(on) > 10
    for name in on:
        torch.testing.assert_close(off[name], on[name], rtol=1e-4, atol=1e-6, msg=name)


def test_setter_is_global_until_set_back() -> None:
    try:
        mlp.set_activation_recompute(False)
        _, _, calls = _step(_model(), torch.randn(1, 3, 64, 64))
        assert calls == 0
    finally:
        mlp.set_activation_recompute(True)
    _, _, calls = _step(_model(), torch.randn(1, 3, 64, 64))
    assert calls > 0


def test_benchmark_unfused_contender_runs_with_it_off_and_restores_it() -> None:
    import contenders

    step = contenders.make_step("vtdense unfused", dict(family="swin_t", mode="train", batch=1, size=(64, 96)), "cpu")
    with _fused_calls() as seen:
        step()
    assert seen == [] and mlp._recompute is True


def test_tasks_apply_the_option_when_the_model_is_configured() -> None:
    """``--model.activation_recompute false`` in the recipes: Lightning's ``configure_model`` hook
    sets the process-wide switch, and the segmenter's training step then runs without the fused
    functions (the detector takes the same base-class hook)."""
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    tiny = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
    try:
        det = DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, slim_heads=True,
                            activation_recompute=False)
        det.configure_model()
        assert mlp._recompute is False
        DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, slim_heads=True).configure_model()
        assert mlp._recompute is True  # the default puts it back
        seg = SegmentationTask(arch="upernet", backbone="swin_tiny", backbone_kwargs=tiny, num_classes=3,
                               activation_recompute=False)
        seg.configure_model()
        def fused_calls() -> int:
            with _fused_calls() as seen:
                seg.train()
                logits = seg(torch.rand(2, 3, 64, 64))  # (UPerNet's pooling branch batch-normalises 1x1 maps: batch 2)
                torch.nn.functional.cross_entropy(logits, torch.randint(0, 3, (2, 64, 64))).backward()
            return len(seen)

        assert fused_calls() == 0 and seg.hparams.activation_recompute is False
        mlp.set_activation_recompute(True)
        assert fused_calls() > 0  # the control: the same step with the switch on
    finally:
        mlp.set_activation_recompute(True)


def test_context_managers_restore_the_setting_when_the_block_raises() -> None:
    """The layers' switches share one context-manager form (``vtdense.layers.scoped``)."""
    from vtdense.layers import attention, chunked

    with pytest.raises(RuntimeError, match="inside"):
        with mlp.activation_recompute(False), chunked.cpu_chunking(False), attention.attention_backend("math"):
            assert (mlp._recompute, chunked._enabled, attention.get_attention_backend()) == (False, False, "math")
            raise RuntimeError("inside")
    assert (mlp._recompute, chunked._enabled, attention.get_attention_backend()) == (True, True, "sdpa")
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        with attention.attention_backend("bogus"):
            pass
    assert attention.get_attention_backend() == "sdpa"


def test_tasks_apply_the_threshold_and_refuse_a_negative_one() -> None:
    """``--model.activation_recompute_min_bytes``: the tasks set the threshold of
    :func:`vtdense.layers.mlp.set_activation_recompute` when the model is configured (``null``:
    the default) and refuse a bad value when built, naming the option."""
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    tiny = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
    try:
        DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, slim_heads=True,
                      activation_recompute_min_bytes=0).configure_model()
        assert mlp._min_bytes == 0 and mlp._recompute is True
        SegmentationTask(arch="upernet", backbone="swin_tiny", backbone_kwargs=tiny, num_classes=3,
                         activation_recompute_min_bytes=1 << 20).configure_model()
        assert mlp._min_bytes == 1 << 20
        DetectionTask(backbone="swin_tiny", backbone_kwargs=tiny, num_classes=2, slim_heads=True).configure_model()
        assert mlp._min_bytes == mlp.DEFAULT_RECOMPUTE_MIN_BYTES  # the default puts it back
        for bad in (-1, 1.5, True, "8"):
            with pytest.raises(ValueError, match="activation_recompute_min_bytes"):
                SegmentationTask(arch="upernet", backbone="swin_tiny", backbone_kwargs=tiny, num_classes=3,
                                 activation_recompute_min_bytes=bad)
    finally:
        mlp.set_activation_recompute(True, min_bytes=mlp.DEFAULT_RECOMPUTE_MIN_BYTES)
