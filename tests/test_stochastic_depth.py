"""Stochastic depth: what :class:`DropPath` does to a batch, and which rate each block gets."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import vtdense
from vtdense.layers.drop import DropPath


@pytest.mark.parametrize("p", [0.1, 0.3, 0.7])
def test_drop_path_zeroes_whole_samples_with_probability_p_and_rescales_the_rest(p: float) -> None:
    torch.manual_seed(0)
    n = 4000
    x = torch.randn(n, 3, 5, 2) + 3.0  # no sample is zero by chance
    out = DropPath(p).train()(x)
    flat_x, flat_out = x.flatten(1), out.flatten(1)
    dropped = (flat_out == 0).all(1)
    kept = ~dropped
    # each sample is either dropped whole or kept whole, scaled by exactly 1 / (1 - p)
    assert not (flat_out[kept] == 0).any()
    assert torch.allclose(flat_out[kept], flat_x[kept] / (1 - p), rtol=1e-6, atol=0)
    # the dropped fraction is p, within 5 binomial standard deviations
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped.float().mean().item() - p) < 5 * sigma
    # so the expected output is the input: the residual sum keeps its scale
    assert abs(out.mean().item() - x.mean().item()) < 0.05 * x.mean().item()


def test_drop_path_is_the_identity_in_eval_and_at_p_zero() -> None:
    x = torch.randn(64, 7)
    assert DropPath(0.5).eval()(x) is x
    assert DropPath(0.0).train()(x) is x
    assert torch.equal(DropPath(0.5).eval().add_to(x, 2 * x), 3 * x)


def test_drop_path_gradient_follows_the_same_draw() -> None:
    torch.manual_seed(1)
    x = torch.randn(256, 4, requires_grad=True)
    out = DropPath(0.4).train()(x)
    out.sum().backward()
    kept = (out != 0).all(1)
    assert 0 < kept.sum() < 256
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.6))
    assert (x.grad[~kept] == 0).all()


@pytest.mark.parametrize(
    "timm_name,name",
    [("swin_tiny_patch4_window7_224", "swin_tiny"), ("swinv2_tiny_window8_256", "swinv2_tiny"), ("mvitv2_tiny", "mvitv2_tiny")],
)
def test_per_block_rates_match_timm(timm_name: str, name: str) -> None:
    """Rates rise linearly from 0 at the first block to ``drop_path_rate`` at the last, as in timm
    (which puts an ``Identity`` where the rate is 0)."""
    with torch.device("meta"):
        ref = timm.create_model(timm_name, pretrained=False, drop_path_rate=0.3)
        ours = vtdense.create_backbone(name, drop_path_rate=0.3)
    expected = {n: m.drop_prob for n, m in ref.named_modules() if type(m).__name__ == "DropPath"}
    got = {n: m.p for n, m in ours.named_modules() if isinstance(m, DropPath)}
    assert set(expected) <= set(got) and len(got) > 10
    for key, p in got.items():
        assert p == pytest.approx(expected.get(key, 0.0), abs=1e-6), key
    assert max(got.values()) == pytest.approx(0.3) and min(got.values()) == 0.0


def test_keep_probability_follows_p_stays_float32_and_survives_meta_init() -> None:
    """The rate graphs read (``keep = 1 - p``, a float32 buffer that is not saved) follows a new
    ``p``, is not rounded by a cast of the model, and is made again after ``to_empty`` from the
    meta device; a rate outside [0, 1) is refused, naming it."""
    drop = DropPath(0.1)
    assert drop.keep.dtype == torch.float32 and drop.keep.item() == pytest.approx(0.9)
    assert "keep" not in drop.state_dict()
    drop.p = 0.25
    assert drop.keep.item() == 0.75 and drop.active
    assert drop.to(torch.bfloat16).keep.dtype == torch.float32 and drop.keep.item() == 0.75  # bf16 would be 0.75 too,
    drop.p = 0.1
    assert drop.half().keep.item() == pytest.approx(0.9, abs=1e-7)  # but not 0.9 (0.8999 in fp16)
    with torch.device("meta"):
        lazy = DropPath(0.3)
    assert lazy.to_empty(device="cpu").keep.item() == pytest.approx(0.7, abs=1e-7)
    drop.p = 0.0
    assert not drop.active and drop.train()(x := torch.randn(3, 2)) is x
    with pytest.raises(ValueError, match="1.0"):
        DropPath(1.0)
