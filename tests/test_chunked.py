"""Chunked CPU inference (``vtdense.layers.chunked``): the same outputs as the whole-tensor path,
taken only where nothing but speed can change, and its large temporaries are really gone."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vtdense
from vtdense.layers import chunked
from vtdense.layers.chunked import chunking_applies, cpu_chunking, row_slices, window_slices

from tests.test_swin import randomize_

MODELS = {
    "swin": ("swin_tiny", dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4)),
    "swinv2": ("swinv2_tiny", dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, extra_norm_every=2)),
    # expand_attn=False (the default): the first block of stages 2-4 projects the MLP shortcut
    "mvitv2": ("mvitv2_tiny", dict(embed_dim=16, depths=(1, 2, 2, 1), num_heads=1)),
    "mvitv2-windows": ("mvitv2_tiny", dict(embed_dim=16, depths=(1, 2, 2, 1), num_heads=1, window_size=8)),
}


class _Widest(TorchDispatchMode):
    """The most rows a GELU of width ``width`` (an MLP's hidden activation) ran on at once."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.gelu, torch.ops.aten.gelu_) and out.shape[-1] == self.width:
            self.rows = max(self.rows, out.numel() // self.width)
        return out


def _model(key: str) -> torch.nn.Module:
    name, kwargs = MODELS[key]
    return randomize_(vtdense.create_backbone(name, drop_path_rate=0.0, **kwargs), 0, std=0.1).eval()


@pytest.mark.parametrize("key", list(MODELS))
def test_chunked_inference_equals_the_whole_tensor_path(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At a budget that splits every stage (several images per chunk at the small stages, runs of
    windows inside one image at the large ones), the pyramid equals the unchunked one exactly, and
    the MLP's hidden activation is never materialised for all tokens at once."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(chunked, "MIN_ROWS", 64)  # stage 4: two windows per image, three images per chunk
    model = _model(key)
    x = torch.randn(3, 3, 96, 160)  # stage maps 24x40 .. 3x5: padded windows and shifted-window masks
    hidden = 64  # stage 1's MLP: 16 channels x 4
    results, widest = {}, {}
    for on in (False, True):
        with cpu_chunking(on), torch.inference_mode(), _Widest(hidden) as spy:
            results[on] = model(x)
        widest[on] = spy.rows
    for name in results[False]:
        # global attention (all of "mvitv2", the last block of stages 2-4 of "mvitv2-windows") is split into
        # bands of query rows, which SDPA may round differently (torch 2.11 does in stage 4 of the windowed one)
        if key.startswith("mvitv2"):
            torch.testing.assert_close(results[True][name], results[False][name], rtol=0, atol=1e-5)
        else:
            assert torch.equal(results[True][name], results[False][name]), name
    assert widest[False] == 3 * 24 * 40  # every stage-1 token at once
    assert widest[True] <= 64  # = max(MIN_ROWS, CHUNK_BYTES / (hidden * 4 bytes))


def test_budget_and_slices() -> None:
    """Row and window slices cover everything once, in contiguous blocks within the budget."""
    for n, per_row, budget in [(25088, 384 * 4, 8 << 20), (100, 4, 1 << 20), (1000, 10_000, 1000), (7, 1, 2)]:
        slices = row_slices(n, per_row, budget)
        assert [i for s in slices for i in range(s.start, s.stop)] == list(range(n))
        assert max(s.stop - s.start for s in slices) <= max(chunked.MIN_ROWS, budget // per_row)
        assert max(s.stop - s.start for s in slices) - min(s.stop - s.start for s in slices) < len(slices)  # near-equal
    # whole images when one fits: 8 images of 64 windows x 49 tokens x 288 floats in 8 MiB chunks
    pairs = window_slices(8, 64, 49, 288 * 4, 8 << 20)
    assert all(w == slice(0, 64) for _, w in pairs) and sum(b.stop - b.start for b, _ in pairs) == 8 and len(pairs) > 1
    # runs of windows inside each image when one image is over the budget (a detection-size map)
    pairs = window_slices(2, 1400, 49, 288 * 4, 8 << 20)
    assert {b.stop - b.start for b, _ in pairs} == {1}
    for img in range(2):
        runs = [w for b, w in pairs if b.start == img]
        assert [i for w in runs for i in range(w.start, w.stop)] == list(range(1400))
        assert max(w.stop - w.start for w in runs) * 49 * 288 * 4 <= 8 << 20


def test_chunking_is_taken_only_where_it_changes_nothing_but_speed() -> None:
    model = _model("swin")
    block = model.layers[0].blocks[0]
    x = torch.randn(1, 8, 8, 16)
    with torch.no_grad():
        assert chunking_applies(x, block)
        with cpu_chunking(False):
            assert not chunking_applies(x, block)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not chunking_applies(x, block)  # autocast's casts are per op: keep the reference path
        assert not chunking_applies(x.to("meta"), block)
    assert not chunking_applies(x, block)  # gradients to the weights
    assert not chunking_applies(x.requires_grad_(), block.requires_grad_(False))  # gradients to the input
    assert chunking_applies(x.detach(), block)  # frozen weights, input without gradient
    block.train()
    with torch.no_grad():
        assert not chunking_applies(x, block)  # dropout / drop path are active in train mode
    block.eval().requires_grad_(True)

    # A training forward goes through the autograd path and matches the chunked eval outputs
    # (drop path is 0, so train and eval compute the same function).
    img = torch.randn(2, 3, 64, 96)
    with torch.inference_mode():
        expected = model(img)
    model.train()
    got = model(img)
    assert all(v.requires_grad for v in got.values())
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)


class _Masks(TorchDispatchMode):
    """The additive terms SDPA receives: their largest size in bytes and the query rows they cover."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.rows = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket is torch.ops.aten.scaled_dot_product_attention:
            mask = args[3] if len(args) > 3 else (kwargs or {}).get("attn_mask")
            if mask is not None:
                # the bytes the term really holds (a broadcast one is held once)
                held = mask.untyped_storage().nbytes()
                self.largest = max(self.largest, held)
                self.rows += args[0].shape[0] * args[0].shape[1] * args[0].shape[2]  # batch x heads x queries
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("key", ["mvitv2", "mvitv2-windows"])
def test_mvitv2_attention_term_is_made_per_chunk(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU inference never makes MViTv2's whole (B, nW, heads, Nq, Nk) relative-position term: it is
    summed per chunk of images, windows or query rows of at most CHUNK_BYTES (or one row of queries), and the chunks cover
    every query of every head once (global attention: one-row bands; windows: runs of windows)."""
    # a chunk has one row of the query grid at least: up to 20 queries x 240 (windows model: 60) keys
    # x 2 heads x 4 bytes in a global block; one image's windows hold 30 KiB in stage 2's first block
    budget = (40 << 10) if key == "mvitv2" else (10 << 10)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", budget)
    monkeypatch.setattr(chunked, "MIN_ROWS", 1)  # else chunks keep at least MIN_ROWS queries
    model = _model(key)
    x = torch.randn(3, 3, 96, 160)
    spies = {}
    for on in (False, True):
        with cpu_chunking(on), torch.inference_mode(), _Masks() as spy:
            model(x)
        spies[on] = spy
    assert spies[False].largest > 2 * budget  # the whole term (global: 3 x 24 x 40 x 60 x 4 bytes at stage 1)
    assert spies[True].largest <= budget
    assert spies[True].rows == spies[False].rows  # every (image, head, query) attended once
