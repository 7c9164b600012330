"""Every attention path (fused SDPA with an additive bias, FlexAttention, explicit math) gives the
math path's outputs to 1e-5 in fp32, for the kernel alone and for whole Swin V1/V2 and MViTv2 models
at sizes that need padding and shifted-window masks; and the cached bias follows weight changes."""

from __future__ import annotations

import pytest
import torch

import vtdense
from vtdense.backbones.swin import SwinBlock
from vtdense.layers.attention import attention, attention_backend, flex_available, get_attention_backend, set_attention_backend
from vtdense.layers.windows import MASK_VALUE, window_attention_mask

from tests.test_swin import randomize_
from probe import probe_loss

# FlexAttention without torch.compile runs PyTorch's unfused reference and says so; exact, but slow.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TINY_SWIN = dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)

FLEX = pytest.param(
    "flex",
    marks=pytest.mark.skipif(
        not flex_available(), reason=f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    ),
)
PATHS = ["sdpa", FLEX, "math"]
#: the paths the whole-model tests compare with the math path (itself checked against an einsum)
FAST_PATHS = ["sdpa", FLEX]


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    return randomize_(model, seed, std=0.1)


def _reference(q, k, v, term, scale):
    """softmax(q k^T * scale + term) v written out with broadcasting, no reshapes."""
    logits = torch.einsum("...nd,...md->...nm", q, k) * scale
    if term is not None:
        logits = logits + term
    return torch.einsum("...nm,...md->...nd", logits.softmax(-1), v)


@pytest.mark.parametrize("path", PATHS)
def test_kernel_paths_match_math(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    B, nW, h, N, d = 2, 6, 3, 10, 8
    q, k, v = (torch.randn(B, nW, h, N, d, generator=g) for _ in range(3))
    bias = torch.randn(h, N, N, generator=g)
    blocked = torch.rand(nW, N, N, generator=g) > 0.7
    blocked[..., 0] = False  # every row keeps a key
    per_window = torch.where(blocked[:, None], MASK_VALUE, bias)  # nW, h, N, N: folded into heads
    per_item = torch.randn(B, nW, h, N, N, generator=g)  # e.g. MViTv2's query-dependent term
    for term in (None, bias, per_window, per_item):
        expected = _reference(q, k, v, term, 0.3)
        got = attention(q, k, v, term, scale=0.3, backend=path)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-5, (path, None if term is None else term.shape)


def test_backend_switch_and_errors() -> None:
    assert get_attention_backend() == "sdpa"
    with attention_backend("math"):
        assert get_attention_backend() == "math"
    assert get_attention_backend() == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend 'fast'.*sdpa, flex, math"):
        set_attention_backend("fast")
    q = torch.randn(1, 4, 1, 5, 8)
    with pytest.raises(ValueError, match="per-window mask of 3 windows"):
        attention(q, q, q, torch.zeros(3, 1, 5, 5))


def _outputs(model: torch.nn.Module, x: torch.Tensor, path: str) -> list[torch.Tensor]:
    with attention_backend(path), torch.no_grad():
        return list(model(x).values())


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny"])
def test_swin_paths_match_math(path: str, name: str) -> None:
    model = _randomize(vtdense.create_backbone(name, **TINY_SWIN)).eval()
    x = torch.randn(2, 3, 75, 101)  # stage maps 19x26, 10x13, 5x7, 3x4: padding, shifts, shrunk windows
    for a, b in zip(_outputs(model, x, path), _outputs(model, x, "math")):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("path", FAST_PATHS)
def test_mvitv2_paths_match_math(path: str) -> None:
    model = _randomize(
        vtdense.create_backbone("mvitv2_tiny", embed_dim=16, depths=(1, 2, 2, 1), window_size=16, drop_path_rate=0.0), seed=1
    ).eval()
    x = torch.randn(2, 3, 97, 131)  # every window level pads
    for a, b in zip(_outputs(model, x, path), _outputs(model, x, "math")):
        assert (a - b).abs().max().item() < 1e-5


def test_training_gradients_match_math() -> None:
    """The fused path's gradients (bias table, Log-CPB MLP, q/k/v) equal the math path's."""
    x = torch.randn(2, 3, 75, 101)
    for name in ("swin_tiny", "swinv2_tiny"):
        model = _randomize(vtdense.create_backbone(name, **TINY_SWIN))
        grads = []
        for path in ("sdpa", "math"):
            model.zero_grad()
            with attention_backend(path):
                probe_loss(model(x)).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n in grads[0]:
            assert torch.allclose(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4), (name, n)


@pytest.mark.parametrize("version", [1, 2])
def test_cached_bias_follows_weight_changes(version: int) -> None:
    block = _randomize(SwinBlock(8, 2, (4, 4), shifted=True, post_norm=version == 2)).eval()
    x = torch.randn(1, 9, 10, 8)
    attn = block.attn
    with torch.no_grad():
        first = block(x)
        assert attn.cached_position_bias((4, 4), torch.float32) is attn.cached_position_bias((4, 4), torch.float32)
        table = attn.cpb_mlp[2].weight if version == 2 else attn.relative_position_bias_table
        table.mul_(1.5)  # an in-place update, like an optimizer step
        changed = block(x)
        fresh = attn.position_bias((4, 4))
    assert torch.equal(attn.cached_position_bias((4, 4), torch.float32), fresh)
    assert (changed - first).abs().max() > 1e-3
    # with gradients on, the bias is recomputed and reaches the table
    block.train()
    block(x).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_mask_blocks_regions_and_padding() -> None:
    """The traceable mask builder: an unshifted map that tiles exactly has nothing to mask; a
    shifted one blocks across regions; padded keys are blocked for every query."""
    assert window_attention_mask(8, 8, (4, 4), (0, 0)) is None
    m = window_attention_mask(8, 8, (4, 4), (2, 2))
    assert m.shape == (4, 16, 16) and not m[0].any() and m[3].any()
    p = window_attention_mask(6, 8, (4, 4), (0, 0))  # two padded rows in the lower windows
    assert not p[0].any() and p[2][:, 8:].all() and not p[2][:, :8].any()


@pytest.mark.parametrize("name", ["swin_tiny", "swinv2_tiny", "mvitv2_tiny", "mvitv2_tiny-windows"])
def test_inference_runs_sdpa_fused_kernel_in_every_attention_call(name: str) -> None:
    """The profiler sees SDPA's fused CPU kernel (or, for Swin in fp32, vtdense's batched-matmul
    window path) in every attention call of inference, fp32 and bf16 autocast, masked / shifted /
    padded blocks included, and never SDPA's math fallback (what
    ``benchmarks/attention_kernels.py`` reports for full-size models)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from attention_kernels import classify, kernel_counts

    mvit = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, drop_path_rate=0.0)
    kwargs = {"swin_tiny": TINY_SWIN, "swinv2_tiny": TINY_SWIN, "mvitv2_tiny": mvit,
              "mvitv2_tiny-windows": dict(mvit, window_size=8)}[name]
    model = vtdense.create_backbone(name.split("-")[0], **kwargs).eval()
    calls = sum(kwargs["depths"])
    x = torch.randn(2, 3, 96, 160)  # stage maps 24x40 .. 3x5: padded windows and shifted-window masks
    for dtype in (torch.float32, torch.bfloat16):
        def infer() -> None:
            with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                model(x)

        infer()
        counts = kernel_counts(infer, "cpu")
        # fp32 Swin inference runs windows as batched matmuls (faster than SDPA's CPU kernel at
        # window sizes); under autocast, and for MViTv2, SDPA's fused kernel. Never its math fallback.
        allowed = {"fused", "cpu-bmm"} if dtype == torch.float32 and name.startswith("swin") else {"fused"}
        assert {classify(k) for k in counts} <= allowed and counts, (dtype, counts)
        # window attention runs once per image and chunk in CPU inference: at least once per block
        assert sum(counts.values()) >= calls, (dtype, counts)


def test_sdpa_under_autocast_takes_a_low_precision_term_without_casting_it() -> None:
    """CUDA autocast runs LayerNorm (MViTv2's q/k/v norms) and Swin V2's cosine normalisation in fp32, so
    q reaches the kernel in fp32 with a bf16 bias. The term goes straight to autocast's dtype: it is not
    copied up to fp32 and cast down again by SDPA's autocast (two copies of the largest tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
                self.shapes.append(tuple(out.shape))
            return out

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 16, 8) for _ in range(3))  # (B, nW, heads, N, d), fp32
    term = torch.randn(3, 4, 16, 16).bfloat16()  # per-window bias made by a bf16 matmul
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Casts() as casts:
            out = attention(q, k, v, term, backend="sdpa")
        assert out.dtype == torch.bfloat16
        assert all(s[-2:] != (16, 16) for s in casts.shapes), casts.shapes  # only q, k, v are cast
    # the values autocast's SDPA computes from bf16 inputs, which the fp32 detour gave too
    fold = lambda t: t.bfloat16().reshape(2, 12, 16, 8)  # noqa: E731
    expected = torch.nn.functional.scaled_dot_product_attention(fold(q), fold(k), fold(v), attn_mask=term.reshape(1, 12, 16, 16))
    assert torch.equal(out.reshape(2, 12, 16, 8), expected)


@pytest.mark.parametrize("per_window", [False, True])
def test_cpu_window_attention_in_runs_of_windows_matches_math(per_window: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU inference attends an image's windows in runs that stay in cache; with a small budget an image
    takes several runs (counted), and the result is still the math path's, shared or per-window term."""
    import vtdense.layers.chunked as chunked
    from tests.op_calls import OpCalls

    g = torch.Generator().manual_seed(0)
    B, nW, h, N, d = 2, 45, 3, 16, 8  # MIN_ROWS (256) rows: runs of at least 16 windows
    q, k, v = (torch.randn(B, nW, h, N, d, generator=g) for _ in range(3))
    term = torch.randn(*((nW,) if per_window else ()), h, N, N, generator=g)
    expected = _reference(q, k, v, term, 0.3)
    for budget, runs in ((1 << 30, 1), (1, 3)):
        monkeypatch.setattr(chunked, "CHUNK_BYTES", budget)
        with torch.no_grad(), OpCalls(torch.ops.aten.baddbmm) as calls:
            got = attention(q, k, v, term, scale=0.3, backend="sdpa")
        assert calls.count == B * runs
        assert (got - expected).abs().max().item() < 1e-5, budget
