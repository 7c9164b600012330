"""``vtdense.layers.fused_norm``: the Triton LayerNorm that writes bf16 for CUDA inference.

Its kernel runs here in Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``) against
``layer_norm(x.float()).to(bfloat16)``; the backbones' use of it runs on fake CUDA tensors."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from triton_interpreter import run_interpreted

import vtdense
from vtdense.layers import fused_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import launches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

KERNEL_CHECK = textwrap.dedent("""
    import json, torch, torch.nn.functional as F
    from vtdense.layers.fused_norm import layer_norm_bf16, _launch
    torch.manual_seed(0)
    out = []
    for C, rows, dtype, affine in [(96, 77, torch.float32, True), (100, 5, torch.float32, True),
                                   (384, 33, torch.bfloat16, True), (1536, 9, torch.float32, False),
                                   (32, 0, torch.float32, True)]:
        x = (torch.randn(rows, C) * 3 + 5).to(dtype)
        w = torch.randn(C) if affine else None
        b = torch.randn(C) if affine else None
        y = layer_norm_bf16(x, w, b, 1e-5)
        ref = F.layer_norm(x.float(), (C,), w, b, 1e-5).to(torch.bfloat16)
        ulps = ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)).max().item() if rows else 0.0
        same = (y == ref).float().mean().item() if rows else 1.0
        out.append(dict(C=C, rows=rows, dtype=str(y.dtype), shape=list(y.shape), same=same, rel=ulps))
    # the float32-output variant (Swin's patch-embedding norm): PyTorch's values but for float32's last bits
    from vtdense.layers.fused_norm import _run
    for C, dtype in [(96, torch.bfloat16), (130, torch.float32)]:
        x = (torch.randn(3, 17, C) * 3 + 5).to(dtype)
        w, b = torch.randn(C), torch.randn(C)
        y = _run(x.permute(1, 0, 2), w, b, 1e-5, 0, out_dtype=torch.float32)[0]  # rows not contiguous
        ref = F.layer_norm(x.permute(1, 0, 2).float(), (C,), w, b, 1e-5)
        rel = ((y - ref).abs().max() / ref.abs().max()).item()
        out.append(dict(C=C, rows=51, dtype=str(y.dtype), shape=[51, C], same=1.0 if rel <= 1e-6 else 0.0, rel=0.0,
                        f32_shape=list(y.shape) == [17, 3, C]))
    # a strided input (rows not contiguous) goes through a contiguous copy
    x = torch.randn(8, 2, 96)[:, 0]
    y = _launch(x, None, None, 1e-6)
    ref = F.layer_norm(x, (96,), None, None, 1e-6).to(torch.bfloat16)
    out.append(dict(C=96, rows=8, dtype=str(y.dtype), shape=list(y.shape), same=(y == ref).float().mean().item(), rel=0.0))
    print(json.dumps(out))
""")


def test_kernel_in_tritons_interpreter_matches_layer_norm_then_cast() -> None:
    results = run_interpreted(KERNEL_CHECK)
    assert len(results) == 8
    f32 = [r for r in results if "f32_shape" in r]
    assert len(f32) == 2 and all(r["dtype"] == "torch.float32" and r["f32_shape"] and r["same"] == 1.0 for r in f32), f32
    for r in results:
        if "f32_shape" in r:
            continue
        assert r["dtype"] == "torch.bfloat16" and r["shape"] == [r["rows"], r["C"]], r
        # rounded to nearest even like the cast: equal but for float32 results on a rounding boundary
        assert r["same"] >= 0.999, r
        assert r["rel"] <= 2 ** -7, r  # one bf16 step at most (2^-8 to 2^-7 of the value)


def test_auto_by_default_and_only_for_cuda_bf16_inference() -> None:
    norm = torch.nn.LayerNorm(8)
    x = torch.randn(2, 8)
    assert fused_norm._enabled == "auto"
    with fused_norm.triton_norm(True):
        assert not fused_norm.triton_norm_applies(x, norm)  # a CPU tensor
    assert fused_norm._enabled == "auto"
    with pytest.raises(ValueError, match="set_triton_norm takes True, False or 'auto'; got 'on'"):
        fused_norm.set_triton_norm("on")
    assert fused_norm._enabled == "auto"


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11),
                    reason="fake CUDA tensors need torch >= 2.11 on a machine without a GPU")
def test_swin_inference_under_bf16_autocast_takes_it_when_switched_on() -> None:
    """On fake CUDA tensors: each pre-norm + projection becomes one ``vtdense::layer_norm_bf16``
    call with no cast after it; training, fp32 and the default (off) keep ``native_layer_norm``."""
    def count(train: bool, dtype, on: bool) -> launches.Count:
        torch.manual_seed(0)
        model = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=(1, 2, 1, 1), num_heads=(1, 2, 4, 8),
                                        drop_path_rate=0.0)
        with fused_norm.triton_norm(on):
            return launches.count_forward(model, lambda: torch.randn(2, 3, 100, 132, device="cuda"), train=train,
                                          dtype=dtype)

    on, off = count(False, torch.bfloat16, True), count(False, torch.bfloat16, False)
    fused = sum(v for k, v in on.ops.items() if "layer_norm_bf16" in k)
    # per block norm1 -> qkv and norm2 -> fc1, and the three patch mergings; the out norms stay
    assert fused == 2 * 5 + 3, on.ops
    assert on.casts <= off.casts - fused, (on.casts, off.casts)
    assert on.total < off.total
    for train, dtype in [(True, torch.bfloat16), (False, None)]:
        assert not any("layer_norm_bf16" in k for k in count(train, dtype, True).ops)
    # "auto" (the default): only inputs of at least AUTO_MIN_ELEMENTS values; this small model at
    # this size has none, and with the bar lowered below its first stage's size it has some, not all
    assert not any("layer_norm_bf16" in k for k in count(False, torch.bfloat16, "auto").ops)
    old = fused_norm.AUTO_MIN_ELEMENTS
    try:
        fused_norm.AUTO_MIN_ELEMENTS = 2 * 25 * 33 * 32  # the first stage's tokens x channels
        some = sum(v for k, v in count(False, torch.bfloat16, "auto").ops.items() if "layer_norm_bf16" in k)
        fused_norm.AUTO_MIN_ELEMENTS = 0
        every = sum(v for k, v in count(False, torch.bfloat16, "auto").ops.items() if "layer_norm_bf16" in k)
    finally:
        fused_norm.AUTO_MIN_ELEMENTS = old
    assert 0 < some < every == fused, (some, every)


def test_gpu_check_script_runs_here(capsys) -> None:
    """``benchmarks/triton_norm_check.py`` (a step of ``gpu_session.sh focus``) on the CPU, where the
    op is the two ops it replaces: every value identical, the backbones unchanged."""
    import triton_norm_check

    assert triton_norm_check.main(["--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["identical"] for r in report["kernel"]] == [1.0] * 6
    assert report["backbones_max_rel_diff"] == {"swin_tiny": 0.0, "mvitv2_tiny": 0.0}


@pytest.mark.parametrize("block,rows,affine,x_type,stats,out_bf16", [
    (128, 32, True, "*fp32", 0, True), (1024, 4, False, "*bf16", 0, True), (8192, 1, True, "*fp32", 0, True),
    (128, 32, True, "*fp32", 1, True), (256, 16, True, "*bf16", 2, True), (128, 32, True, "*bf16", 0, False)])
def test_kernel_compiles_for_hopper(block: int, rows: int, affine: bool, x_type: str, stats: int, out_bf16: bool) -> None:
    """Triton compiles the kernel to PTX and a cubin for sm_90 (the H100/H200) without a GPU (the
    wheel carries ptxas): the typing errors the CPU interpreter lets through fail here. ``stats``:
    inference (0), training's forward that stores the rows' statistics (1), its recomputation (2)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = fused_norm._triton_kernel()[0]
    signature = {"X": x_type, "W": "*fp32" if affine else "constexpr", "B": "*fp32" if affine else "constexpr",
                 "Y": "*bf16" if out_bf16 else "*fp32", "MEAN": "*fp32" if stats else "constexpr", "RSTD": "*fp32" if stats else "constexpr",
                 "M": "i32", "C": "i32", "stride_x": "i64", "eps": "fp32", "BLOCK_C": "constexpr",
                 "ROWS": "constexpr", "HAS_W": "constexpr", "HAS_B": "constexpr", "STATS": "constexpr",
                 "OUT_BF16": "constexpr"}
    constants = {"BLOCK_C": block, "ROWS": rows, "HAS_W": affine, "HAS_B": affine, "STATS": stats,
                 "OUT_BF16": out_bf16}
    if not affine:
        constants.update(W=None, B=None)
    if not stats:
        constants.update(MEAN=None, RSTD=None)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 8 if block >= 2048 else 4})
    assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000


def test_a_kernel_that_fails_here_warns_once_and_pytorch_runs(monkeypatch) -> None:
    """A Triton that cannot build or launch the kernel (no working compiler, an old GPU) must not
    stop inference: one warning names the failure, PyTorch's LayerNorm + cast give the result, and
    the kernel is not tried again."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("PassManager::run failed\nmore lines")

    monkeypatch.setattr(fused_norm, "_direct", lambda x: True)  # a CPU tensor here stands for a CUDA one
    monkeypatch.setattr(fused_norm, "_run", broken)
    monkeypatch.setattr(fused_norm, "_failed", None)
    x, w, b = torch.randn(4, 24), torch.randn(24), torch.randn(24)
    ref = torch.nn.functional.layer_norm(x, (24,), w, b, 1e-5).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"Triton LayerNorm failed on this machine \(RuntimeError: PassManager::run failed\)"):
        y = fused_norm.eager_layer_norm_bf16(x, w, b, 1e-5)
    assert torch.equal(y, ref) and calls == [1]
    assert torch.equal(fused_norm.eager_layer_norm_bf16(x, w, b, 1e-5), ref) and calls == [1]  # not tried again
    assert not fused_norm._usable_on(torch.device("cuda", 0))  # and no longer chosen


def test_no_size_test_while_a_graph_is_built(monkeypatch) -> None:
    """On by default, the kernel's size test (``"auto"``) must not run while a graph is built: under
    ``torch.compile(dynamic=True)`` it would install a guard on the input's size, and a size on the
    other side of the bar would compile the graph again."""
    from types import SimpleNamespace

    def numel() -> int:
        raise AssertionError("the size was read while tracing")

    x = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.float32, numel=numel, shape=(4, 96))
    monkeypatch.setattr(fused_norm, "tracing", lambda: True)
    assert fused_norm._enabled == "auto"
    assert not fused_norm.triton_norm_applies(x, torch.nn.LayerNorm(96))  # type: ignore[arg-type]


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11),
                    reason="fake CUDA tensors need torch >= 2.11 on a machine without a GPU")
def test_mvitv2_takes_it_for_both_pre_norms_of_every_block() -> None:
    """MViTv2's attention pre-norm feeds only linear layers (the q/k/v products and, where the width
    changes, the shortcut's), as does the MLP's: with the kernel on every pre-norm, each block runs it
    twice, and no pre-norm output is cast after it. The ``"auto"`` default leaves them to PyTorch."""
    def count(on: bool | str) -> launches.Count:
        torch.manual_seed(0)
        model = vtdense.create_backbone("mvitv2_tiny", embed_dim=16, depths=(1, 2, 2, 1), window_size=16,
                                        drop_path_rate=0.0)
        with fused_norm.triton_norm(on):
            return launches.count_forward(model, lambda: torch.randn(2, 3, 96, 128, device="cuda"), train=False,
                                          dtype=torch.bfloat16)

    on, off = count(True), count(False)
    fused = sum(v for k, v in on.ops.items() if "layer_norm_bf16" in k)
    assert fused == 2 * 6, on.ops  # six blocks
    assert on.casts <= off.casts - fused, (on.casts, off.casts)
    assert on.total < off.total
    # "auto" (the default) leaves MViTv2's block norms to PyTorch (keep_out_of_auto: slower on both GPUs
    # timed), even with the size bar at 0, where Swin's norms all take it (the Swin test above)
    old = fused_norm.AUTO_MIN_ELEMENTS
    try:
        fused_norm.AUTO_MIN_ELEMENTS = 0
        auto = count("auto")
    finally:
        fused_norm.AUTO_MIN_ELEMENTS = old
    assert not any("layer_norm_bf16" in k for k in auto.ops), auto.ops
    assert auto.ops == off.ops


def test_swins_patch_embedding_norm_takes_the_float32_variant(monkeypatch) -> None:
    """Where the kernel applies (CUDA bf16 inference, a large input), Swin's patch-embedding norm runs
    it with a float32 output, the residual stream's dtype; elsewhere the module. (A CPU tensor stands
    for a CUDA one here; the kernel itself is checked in the interpreter above.)"""
    from vtdense.backbones.swin import PatchEmbed

    seen = []

    def run(x, w, b, eps, stats, mean=None, rstd=None, out_dtype=torch.bfloat16):
        seen.append((tuple(x.shape), out_dtype))
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], w, b, eps), None, None

    torch.manual_seed(0)
    embed = PatchEmbed(3, 32, 4).eval()
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        ref = embed(x)
        monkeypatch.setattr(fused_norm, "_direct", lambda t: True)
        monkeypatch.setattr(fused_norm, "triton_norm_applies", lambda t, norm: True)
        monkeypatch.setattr(fused_norm, "_run", run)
        got = embed(x)
    assert seen == [((2, 8, 12, 32), torch.float32)]
    assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=1e-6)
    monkeypatch.setattr(fused_norm, "triton_norm_applies", lambda t, norm: False)
    with torch.no_grad():
        embed(x)
    assert len(seen) == 1  # not applying: the module
