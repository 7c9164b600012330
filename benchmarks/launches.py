"""ATen calls of one forward on a GPU, counted without a GPU.

The published Mask R-CNN step is bound by the host on an H100 (``shared/perf/h100-2026-11-22.md``):
the GPU idles half of each step, and bf16 autocast made it slower than TF32 because of the casts it
adds (756 ``copy_`` calls against 267). Every ATen call costs host time, however small its kernel,
so the number of calls a forward makes is a measure of that cost that needs no GPU.

This script counts them on fake CUDA tensors: torch's ``FakeTensorMode`` gives every tensor a CUDA
device, a shape, a dtype and strides but no memory, and runs no kernel. CUDA autocast is switched on
directly (``torch.autocast`` refuses it on a machine without a GPU), so autocast inserts the casts it
inserts on a GPU, and vtdense takes its GPU code paths. The count is exact and deterministic: the
same code makes the same calls. What it does not see: the backward pass (autograd's engine needs a
real device), kernel durations, and which kernel SDPA picks. For the last, a stand-in applies the
conditions of torch's ``sdp_utils`` for the fused kernels (see :class:`FusedAttentionStandIn`) and
records every call, so a call that would fall back to SDPA's math path is reported; the profiler on
a GPU (``attention_kernels.py --device cuda``) remains the proof.

It also follows the memory of the forward: the storages each call allocates, live until the last
tensor on them is collected. In inference it reports their peak (``max_memory_allocated`` of the
forward, less kernels' workspaces); in training, the bytes autograd keeps for the backward pass.
On the commit the issue's H100 figures were measured on, these counts give every memory ratio
measured there, and the stand-in the math-path calls of its profile (``benchmarks/RESULTS.md``).

    python benchmarks/launches.py                  # the table, printed
    python benchmarks/launches.py --write          # and the section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AttentionCall", "Count", "cuda_autocast", "fake_cuda", "count_forward", "CASES", "run", "markdown"]

#: ATen calls that only make a view, read metadata or allocate: no kernel is launched for them
_NO_KERNEL = frozenset({
    "view", "_unsafe_view", "permute", "t", "expand", "transpose", "unsqueeze", "squeeze", "alias", "unbind",
    "detach", "as_strided", "slice", "select", "split", "split_with_sizes", "chunk", "narrow", "unflatten",
    "flatten", "reshape", "_reshape_alias", "view_as", "expand_as", "lift_fresh", "device", "dim", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "_fused_sdp_choice", "is_same_size",
    "is_nonzero", "size", "stride", "numel", "sym_is_contiguous",
    "empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided",  # allocations, no kernel
})
_COPIES = frozenset({"clone", "copy_", "contiguous"})


@dataclasses.dataclass
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call as the kernel would receive it."""

    q_shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # q, k, v and the mask (or "none") after autocast
    fused: bool  # a fused CUDA kernel (flash or memory-efficient) takes it
    reason: str  # why not, when it does not
    mask_copied: bool  # SDPA pads (copies) the mask because its rows are not 16-aligned


@dataclasses.dataclass
class Count:
    """What one forward called: every ATen call that launches a kernel (views excluded)."""

    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    casts: int = 0  # _to_copy to another dtype
    weight_casts: int = 0  # of those, casts of a parameter or buffer (autocast's, once per forward and weight)
    recasts: int = 0  # casts of a float tensor already cast to that dtype in this forward (same elements)
    copies: int = 0  # clone / copy_ / _to_copy of the same dtype
    attention: list[AttentionCall] = dataclasses.field(default_factory=list)
    peak_bytes: int = 0  # most bytes of activations live at once (storages the forward allocated)
    saved_bytes: int = 0  # bytes of the distinct activation storages autograd keeps for the backward

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class _Recorder(TorchDispatchMode):
    """Counts the calls (see :class:`Count`) and follows the storages the calls allocate: a storage
    is live from the call that creates it until the last tensor on it is collected, so the peak
    of their sum is the forward's activation memory, as ``max_memory_allocated`` would see it
    without workspaces. Meaningful without autograd (inference): a storage autograd saves has no
    Python tensor left to follow (:attr:`Count.saved_bytes` measures training instead)."""

    def __init__(self, count: Count, before: set[int] | None = None, weights: set[int] | None = None) -> None:
        super().__init__()
        self.count = count
        self._weights = weights or set()  # storages of the model's parameters and buffers
        self._cast: set[tuple] = set()  # (storage, offset, shape, strides, dtype) of every cast source
        self._live: dict[int, list] = {}  # storage -> [bytes, ids of the tensors on it, its cast keys]
        self._bytes = 0
        self._before = before or set()  # storages that existed before the forward (weights, input)

    def _free(self, key: int, ident: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1].discard(ident)
            if not entry[1]:  # the storage is freed: a later tensor may get its address
                self._bytes -= entry[0]
                self._cast.difference_update(entry[2])
                del self._live[key]

    def _follow(self, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = None
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key in self._before:
                continue
            entry = self._live.get(key)
            if entry is None:
                if inputs is None:  # a view, an in-place or out= result lies on an input's storage
                    inputs = {a.untyped_storage()._cdata for a in torch.utils._pytree.tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor)}
                if key in inputs:
                    continue
                entry = self._live[key] = [t.untyped_storage().nbytes(), set(), []]
                self._bytes += entry[0]
                self.count.peak_bytes = max(self.count.peak_bytes, self._bytes)
            if id(t) not in entry[1]:
                entry[1].add(id(t))
                weakref.finalize(t, self._free, key, id(t))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._count(func, args, kwargs)
        out = func(*args, **kwargs)
        self._follow(args, kwargs, out)
        return out

    def _count(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = func.overloadpacket.__name__
        if name in _NO_KERNEL:
            return
        self.count.ops[name] += 1
        if name == "_to_copy":
            src = args[0]
            if isinstance(src, torch.Tensor) and kwargs.get("dtype", src.dtype) != src.dtype:
                self.count.casts += 1
                self.count.weight_casts += src.untyped_storage()._cdata in self._weights
                if not src.is_floating_point():  # a mask made a float: not autocast's doing
                    return
                key = (src.untyped_storage()._cdata, src.storage_offset(), tuple(src.shape), src.stride(),
                       kwargs["dtype"])
                self.count.recasts += key in self._cast
                self._cast.add(key)
                entry = self._live.get(key[0])
                if entry is not None:  # forgotten when the storage is freed
                    entry[2].append(key)
            else:
                self.count.copies += 1
        elif name in _COPIES:
            self.count.copies += 1


def _fused_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str:
    """Why neither fused CUDA kernel would take these inputs ("" when one does). The conditions of
    torch's ``sdp_utils`` (``use_mem_efficient_attention`` / ``use_flash_attention``) that depend on
    the inputs, not on the device: 4-D ``q, k, v`` of one floating dtype with unit-stride last dims
    and a head dim that is a multiple of 8, and a mask that is boolean or of ``q``'s dtype with a
    unit-stride last dim (``check_last_dim_stride_equals_1_dense``: GPU backends require it of the
    mask too; a transposed bias view sent 7 of Swin-T's 12 calls to the math path on the H100)."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"{q.dim()}-D inputs (fused kernels take 4-D)"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "a last dim with stride != 1"
    if q.shape[-1] % 8 or v.shape[-1] % 8 or q.shape[-1] != k.shape[-1]:
        return f"head dims {q.shape[-1]}, {v.shape[-1]}"
    if mask is not None and mask.dtype not in (torch.bool, q.dtype):
        return f"mask dtype {mask.dtype} with {q.dtype} queries"
    if mask is not None and mask.stride(-1) != 1:
        return "a mask whose last dim has stride != 1"
    return ""


class FusedAttentionStandIn(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on fake CUDA tensors, as a GPU would run it.

    SDPA asks the device which kernel to run, which fake tensors cannot answer, and would decompose
    into its math path. This mode applies autocast's casts (SDPA is on its lower-precision list),
    checks :func:`_fused_reason`, pads a mask whose strides are not multiples of 16 (torch's
    ``preprocess_mask`` copies such a mask in every call) and calls the fused op itself, flash
    without a mask and memory-efficient with one; a call no fused kernel takes runs the math path.
    Each call is appended to ``calls``."""

    def __init__(self, calls: list[AttentionCall]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.pop("attn_mask", args[3] if len(args) > 3 else None)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        scale = kwargs.get("scale")
        if q.is_cuda and torch.is_autocast_enabled("cuda"):
            low = torch.get_autocast_dtype("cuda")
            q, k, v = (t.to(low) if t.is_floating_point() else t for t in (q, k, v))
            if mask is not None and mask.is_floating_point():
                mask = mask.to(low)
        reason = _fused_reason(q, k, v, mask)
        copied = mask is not None and any(s % 16 for s in mask.stride()[:-1])
        self.calls.append(AttentionCall(tuple(q.shape), tuple(str(t.dtype).replace("torch.", "") for t in (q, k, v))
                                        + (str(mask.dtype).replace("torch.", "") if mask is not None else "none",),
                                        not reason, reason, bool(copied and not reason)))
        if reason:
            return func(q, k, v, attn_mask=mask, **kwargs)
        with torch._C.DisableTorchFunction():
            if mask is None:
                return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, scale=scale)[0]
            if mask.dtype == torch.bool:
                mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            if copied:
                n = mask.shape[-1]
                mask = F.pad(mask, (0, -n % 16))[..., :n]
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, torch.is_grad_enabled() and q.requires_grad, dropout, scale=scale)[0]


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None) -> Iterator[None]:
    """CUDA autocast in ``dtype`` (``None``: off), also on a machine without a GPU, where
    ``torch.autocast("cuda")`` switches itself off. Only fake CUDA tensors can then be used."""
    if dtype is None:
        yield
        return
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


@contextlib.contextmanager
def fake_cuda() -> Iterator[list[AttentionCall]]:
    """Fake CUDA tensors (no GPU needed) with the SDPA stand-in; yields the list of attention calls.
    Modules moved to ``"cuda"`` inside it hold fake parameters: build a fresh model for each use.
    vtdense's per-size caches are emptied on exit (they would hold fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls: list[AttentionCall] = []
    capturing = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: False  # no CUDA runtime to ask; nothing records
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), FusedAttentionStandIn(calls):
            yield calls
    finally:
        torch.cuda.is_current_stream_capturing = capturing
        _clear_vtdense_caches()


def _clear_vtdense_caches() -> None:
    from vtdense.export import _clear_size_caches

    _clear_size_caches()


def count_forward(model: torch.nn.Module, make_input: Callable[[], Any], *, train: bool,
                  dtype: torch.dtype | None) -> Count:
    """The ATen calls of one forward of ``model`` on fake CUDA tensors under autocast in ``dtype``
    (``None``: no autocast), after one warm-up forward that fills the per-size caches.

    ``make_input`` builds the input inside the fake mode (e.g. ``lambda: torch.randn(..., device="cuda")``).
    ``train``: training mode with gradients recorded (the forward of a training step); else eval
    under ``no_grad``."""
    count = Count()
    with fake_cuda() as calls:
        model = model.to("cuda").train(train)
        x = make_input()
        grad = torch.enable_grad() if train else torch.no_grad()
        with grad, cuda_autocast(dtype):
            model(x)
        calls.clear()
        weights = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in weights and key != x.untyped_storage()._cdata:
                saved[key] = t.untyped_storage().nbytes()
            return t

        recorder = _Recorder(count, weights | {x.untyped_storage()._cdata}, weights)
        with grad, cuda_autocast(dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
            out = model(x)
        del out
        count.saved_bytes = sum(saved.values())
        count.attention = list(calls)
    return count


# ------------------------------------------------------------------------------------ the cases
def _timm(name: str, size: tuple[int, int], fused: bool = False) -> torch.nn.Module:
    import timm

    kw: dict[str, Any] = {"img_size": max(size)} if name.startswith("mvitv2") else {"img_size": size}
    model = timm.create_model(name, pretrained=False, features_only=True, drop_path_rate=0.0, **kw)
    return _fuse(model) if fused else model


def _fuse(model: torch.nn.Module) -> torch.nn.Module:
    """timm's model with its fused attention path switched on."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    return model


def _vtdense(name: str, **kw: Any) -> torch.nn.Module:
    import vtdense

    return vtdense.create_backbone(name, out_norm=False, drop_path_rate=0.0, **kw)


class _TritonNorm(torch.nn.Module):
    """``model`` run with :func:`vtdense.layers.fused_norm.set_triton_norm` on (the ``vtdense triton-norm`` rows)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> Any:
        from vtdense.layers.fused_norm import triton_norm

        with triton_norm(True):
            return self.model(x)


@torch.library.custom_op("vtdense_bench::triton_window_attention_forward", mutates_args=())
def _attention_kernel(qkv: torch.Tensor, heads: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton window attention's forward kernel as one call that fake tensors can make
    (:class:`_TritonAttn`): its output and row log-sum-exps, uninitialised."""
    B, nW, N, C3 = qkv.shape
    return qkv.new_empty((B, nW, N, C3 // 3)), qkv.new_empty((B * nW, heads, block), dtype=torch.float32)


@_attention_kernel.register_fake
def _(qkv: torch.Tensor, heads: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, nW, N, C3 = qkv.shape
    return qkv.new_empty((B, nW, N, C3 // 3)), qkv.new_empty((B * nW, heads, block), dtype=torch.float32)


class _TritonAttn(torch.nn.Module):
    """``model`` with Swin's training attention in :mod:`vtdense.layers.triton_window_attention`'s
    kernels (the default of bf16 training on a GPU: the training rows' ``vtdense``; ``vtdense sdpa-attn``
    is the model as fake tensors run it, SDPA's path). Fake tensors cannot launch a Triton kernel, so the
    forward kernel is counted as one call of a stand-in op that makes its outputs; everything around
    it, what autograd saves included, is the real code's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> Any:
        from vtdense.layers import triton_window_attention as twa

        def applies(windows: torch.Tensor, tokens: int, width: int, dropout: float) -> bool:
            return torch.is_grad_enabled() and not dropout and tokens <= twa.MAX_WINDOW_TOKENS and width in twa._HEAD_WIDTHS

        def launch(qkv: torch.Tensor, bias: torch.Tensor, masks: Any, scale: float, heads: int, *cosine: Any) -> Any:
            return _attention_kernel(qkv, heads, twa._block(qkv.shape[2]))

        before = twa.triton_window_attention_applies, twa._launch_forward
        twa.triton_window_attention_applies, twa._launch_forward = applies, launch
        try:
            return self.model(x)
        finally:
            twa.triton_window_attention_applies, twa._launch_forward = before


def _detector_fpn() -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from contenders import PUBLISHED_DETECTOR

    from vtdense.models.detection import build_detector

    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PUBLISHED_DETECTOR.items()}
    return build_detector("swin_tiny", "mask_rcnn", **cfg).backbone  # stochastic depth 0.2, as published


def _torchvision_fpn() -> torch.nn.Module:
    import torchvision

    return torchvision.models.detection.maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None).backbone


#: (case, train, batch, (h, w), {contender: builder})
CASES: list[tuple[str, bool, int, tuple[int, int], dict[str, Callable[[], torch.nn.Module]]]] = [
    ("Swin-T inference, batch 64 at 224", False, 64, (224, 224), {
        "vtdense": lambda: _vtdense("swin_tiny"),
        "vtdense triton-norm": lambda: _TritonNorm(_vtdense("swin_tiny")),
        "timm": lambda: _timm("swin_tiny_patch4_window7_224", (224, 224)),
        "timm fused": lambda: _timm("swin_tiny_patch4_window7_224", (224, 224), fused=True)}),
    ("SwinV2-T inference, batch 64 at 256", False, 64, (256, 256), {
        "vtdense": lambda: _vtdense("swinv2_tiny"),
        "timm": lambda: _timm("swinv2_tiny_window8_256", (256, 256))}),
    ("MViTv2-T inference, batch 64 at 224", False, 64, (224, 224), {
        "vtdense": lambda: _vtdense("mvitv2_tiny"),
        "vtdense triton-norm": lambda: _TritonNorm(_vtdense("mvitv2_tiny")),
        "timm": lambda: _timm("mvitv2_tiny", (224, 224))}),
    ("Swin-T training forward, batch 8 at 512x768", True, 8, (512, 768), {
        "vtdense": lambda: _TritonAttn(_vtdense("swin_tiny")),
        "vtdense sdpa-attn": lambda: _vtdense("swin_tiny"),
        "timm": lambda: _timm("swin_tiny_patch4_window7_224", (512, 768)),
        "timm fused": lambda: _timm("swin_tiny_patch4_window7_224", (512, 768), fused=True)}),
    ("SwinV2-T training forward, batch 8 at 512x768", True, 8, (512, 768), {
        "vtdense": lambda: _TritonAttn(_vtdense("swinv2_tiny")),
        "vtdense sdpa-attn": lambda: _vtdense("swinv2_tiny"),
        "timm": lambda: _timm("swinv2_tiny_window8_256", (512, 768))}),
    ("MViTv2-T training forward, batch 8 at 512x768", True, 8, (512, 768), {
        "vtdense": lambda: _vtdense("mvitv2_tiny"),
        "vtdense windows 56": lambda: _vtdense("mvitv2_tiny", window_size=56)}),
    ("Mask R-CNN backbone + FPN training forward (drop path 0.2), batch 2 at 800x1344", True, 2, (800, 1344), {
        "vtdense": lambda: _TritonAttn(_detector_fpn()),
        "vtdense sdpa-attn": _detector_fpn,
        "torchvision R50-FPN v2": _torchvision_fpn}),
]


def run(cases: list | None = None, dtypes: tuple[str, ...] = ("bf16", "fp32")) -> list[dict[str, Any]]:
    """Count every contender of every case in each of ``dtypes``; one row per (case, contender, dtype)."""
    rows = []
    for case, train, batch, (h, w), contenders in cases or CASES:
        for name, build in contenders.items():
            for dt in dtypes:
                torch.manual_seed(0)
                c = count_forward(build(), lambda: torch.randn(batch, 3, h, w, device="cuda"), train=train,
                                  dtype=torch.bfloat16 if dt == "bf16" else None)
                rows.append(dict(case=case, contender=name, dtype=dt, total=c.total, casts=c.casts, recasts=c.recasts,
                                 weight_casts=c.weight_casts,
                                 copies=c.copies,
                                 attention=len(c.attention), fused=sum(a.fused for a in c.attention),
                                 mask_copies=sum(a.mask_copied for a in c.attention),
                                 math_reasons=sorted({a.reason for a in c.attention if not a.fused}),
                                 memory_mib=round((c.saved_bytes if train else c.peak_bytes) / 2**20), train=train))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| case | contender | precision | ATen calls | casts: of weights / of activations (of one cast before) | "
           "copies | attention calls (fused) | mask copied in SDPA | activations MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        math = f"; math: {', '.join(r['math_reasons'])}" if r["math_reasons"] else ""
        prec = "bf16 autocast" if r["dtype"] == "bf16" else "fp32"
        mem = f"{r['memory_mib']} {'saved' if r['train'] else 'peak'}"
        out.append(f"| {r['case']} | {r['contender']} | {prec} | {r['total']} | {r['weight_casts']} / {r['casts'] - r['weight_casts']} ({r['recasts']}) | "
                   f"{r['copies']} | "
                   f"{r['attention']} ({r['fused']}{math}) | {r['mask_copies']} | {mem} |")
    return "\n".join(out)


_START, _END = "<!-- bench:launches:start -->", "<!-- bench:launches:end -->"


def write_section(text: str, path: Path) -> None:
    """Put ``text`` between the launches markers of ``path`` (appended the first time)."""
    body = path.read_text() if path.exists() else ""
    block = f"{_START}\n{text}\n{_END}"
    if _START in body and _END in body:
        head, rest = body.split(_START, 1)
        body = head + block + rest.split(_END, 1)[1]
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    p.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import environment

    cases = [c for c in CASES if args.only in c[0]]
    rows = run(cases)
    env = environment("cpu")
    text = ("## GPU code paths, ATen calls of one forward (`python benchmarks/launches.py`)\n\n"
            f"Counted {env['date']} on fake CUDA tensors (no GPU: `FakeTensorMode`, CUDA autocast switched on "
            f"directly); torch {env['torch']}, timm {env.get('timm', '?')}, vtdense {env.get('vtdense', '?')}. "
            "Every ATen call that launches a kernel, after a warm-up forward; views are not counted, nor the "
            "backward pass. Exact and deterministic, but not a time: see the module docstring. Activations: "
            "inference, the most bytes of tensors the forward allocated that are alive at once (`peak`); "
            "training, the bytes of the distinct tensors autograd keeps for the backward pass (`saved`); "
            "weights and the input excluded, kernels' workspaces not seen.\n\n" + markdown(rows))
    print(text)
    if args.write:
        write_section(text, Path(__file__).resolve().parent / "RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
