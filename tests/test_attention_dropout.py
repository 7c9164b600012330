"""Attention dropout and the logit scale on every attention path.

Dropout on the attention weights is inverted dropout (kept weights scaled by ``1 / (1 - p)``), so
the expected output is the undropped one; it applies in training only, with or without a gradient
in eval. An explicit ``scale`` reaches every path, the CPU's per-image bf16 path included.
"""

from __future__ import annotations

import pytest
import torch

import vtdense
from vtdense.layers.attention import attention

from test_attention_paths import _reference as definition


def _windows(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """q, k, v of ``(B=2, nW=3, heads=2, N=16, d=8)`` and a per-window term ``(3, 2, 16, 16)``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 2, 16, 8, generator=g, dtype=dtype) for _ in range(3))
    term = torch.randn(3, 2, 16, 16, generator=g, dtype=dtype)
    return q, k, v, term


def _reference(q, k, v, term, scale: float) -> torch.Tensor:
    """The definition (``test_attention_paths``'s reference) in float64."""
    return definition(*(t.double() for t in (q, k, v, term)), scale)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_attention_dropout_is_inverted_dropout(backend: str) -> None:
    """Every draw differs from the undropped output, and their mean converges to it."""
    torch.manual_seed(0)
    q, k, v, term = _windows(1)
    clean = attention(q, k, v, term, backend=backend)
    assert torch.allclose(clean.double(), _reference(q, k, v, term, 8**-0.5), atol=1e-5)
    draws = torch.stack([attention(q, k, v, term, dropout=0.5, backend=backend) for _ in range(600)])
    assert all((d - clean).abs().max() > 0.1 for d in draws[:5])
    # the mean of 600 draws: standard error ~0.04 of values ~1
    assert (draws.mean(0) - clean).abs().mean() < 0.03
    assert (draws.mean(0) - clean).abs().max() < 0.3


def test_flex_backend_refuses_attention_dropout() -> None:
    q, k, v, term = _windows(2)
    with pytest.raises(ValueError, match="flex.*dropout"):
        attention(q, k, v, term, dropout=0.1, backend="flex")


@pytest.mark.parametrize("autocast", [False, True])
def test_explicit_scale_reaches_the_cpu_inference_path(autocast: bool) -> None:
    """CPU inference on windows runs image by image (batched matmuls in fp32, SDPA per image
    under bf16 autocast); both take the caller's scale (Swin V2 passes 1.0)."""
    q, k, v, term = _windows(3)
    for scale in (1.0, 0.05):
        expected = _reference(q, k, v, term, scale)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = attention(q, k, v, term, scale=scale)
        assert got.dtype == (torch.bfloat16 if autocast else torch.float32)
        tol = 0.05 if autocast else 1e-5
        assert (got.double() - expected).abs().max() < tol, scale
    # the two scales give clearly different outputs, so a dropped scale could not pass
    assert (_reference(q, k, v, term, 1.0) - _reference(q, k, v, term, 0.05)).abs().max() > 0.5


TINY = {
    "swin_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1),
}


def _build(name: str, attn_drop: float) -> torch.nn.Module:
    if name.startswith("swin"):
        return vtdense.create_backbone(name, attn_drop_rate=attn_drop, drop_path_rate=0.0, **TINY[name])
    model = vtdense.create_backbone(name, drop_path_rate=0.0, **TINY[name])  # (no attn_drop_rate option, as in timm)
    for m in model.modules():
        if hasattr(m, "attn_drop"):
            m.attn_drop = attn_drop
    return model


@pytest.mark.parametrize("name", list(TINY))
def test_backbone_attention_dropout_only_in_training(name: str) -> None:
    """``attn_drop_rate``: eval outputs are deterministic and equal the model without dropout,
    with or without a gradient; training outputs vary from draw to draw."""
    torch.manual_seed(0)
    model, plain = _build(name, 0.5), _build(name, 0.0)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 64, 64)
    model.eval(), plain.eval()
    with torch.no_grad():
        expected = plain(x)["stage4"]
        assert torch.equal(model(x)["stage4"], expected)
    with_grad = [model(x)["stage4"] for _ in range(2)]  # eval with a gradient: the training code paths
    for out in with_grad:
        assert torch.allclose(out, expected, atol=1e-5)
    model.train()
    a, b = model(x)["stage4"], model(x)["stage4"]
    assert (a - b).abs().max() > 1e-3
    with torch.no_grad():  # training without a gradient (frozen weights) drops too
        a, b = model(x)["stage4"], model(x)["stage4"]
    assert (a - b).abs().max() > 1e-3