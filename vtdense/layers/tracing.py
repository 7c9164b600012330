"""Whether eager-only shortcuts may run: graph capture, CUDA-graph recording and ``torch.func`` transforms.

The backbones' fast paths (fused autograd functions, chunks, caches, oneDNN matmuls) are eager
PyTorch. A graph being built (``torch.compile``, ``torch.export``, TorchScript) or a functorch
transform must see the plain operations instead; :func:`tracing` tells them.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad

__all__ = ["tracing", "exporting", "functorch_transform", "cuda_graph_capturing", "fresh_tables"]


def functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...) is
    running, or forward-mode AD (a ``torch.autograd.forward_ad`` dual level): its tensors are
    wrappers or dual tensors that custom autograd functions (no ``setup_context`` / ``jvp``), fused
    kernels without forward derivatives, in-place writes into chunks and memory-format queries do
    not support, and nothing computed under it may be cached."""
    if torch.compiler.is_compiling():  # Dynamo runs the transforms itself, and graphs take the plain path anyway
        return False
    if getattr(_forward_ad, "_current_level", -1) >= 0:
        return True
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def exporting() -> bool:
    """Whether ``torch.export`` is tracing (strict or not), and not ``torch.compile``.

    Not ``torch.compiler.is_exporting()``: Dynamo in torch 2.11 (the GPU image's) folds that call
    to ``True`` inside every ``torch.compile`` (2.14 reads the flag below instead), which sent
    compiled code down the export paths: size tables built in the graph instead of fetched by the
    custom ops, no compiled CPU kernels, and a first compile minutes long. The flag that function
    returns eagerly is right under both, strict and non-strict export included, and Dynamo reads
    it as a constant."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def tracing() -> bool:
    """Whether a graph is being built (``torch.compile``, ``torch.export``, TorchScript tracing or
    scripting) or a ``torch.func`` transform runs (:func:`functorch_transform`): eager-only
    shortcuts (fused autograd functions, chunking, caches) must then keep the plain form."""
    return (torch.compiler.is_compiling() or exporting() or torch.jit.is_tracing()
            or torch.jit.is_scripting() or functorch_transform())


def cuda_graph_capturing(device: torch.device | str) -> bool:
    """Whether a CUDA graph is being recorded on ``device``'s current stream (``torch.cuda.graph``,
    or ``torch.compile`` with ``mode="reduce-overhead"``)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def fresh_tables(device: torch.device | str) -> bool:
    """Whether size-dependent tables (window masks, token and position indices, position biases)
    must be built for this call instead of read from, or written to, a cache: while a graph is
    built (:func:`tracing`: a traced tensor must never be cached) and while a CUDA graph records
    on ``device``. A replay reruns the recorded kernels on the addresses they read, and a cache
    entry can be evicted, its memory reused, before a replay; a table built while recording lives
    in the graph's own memory, and its few small kernels are replayed with the graph."""
    return tracing() or cuda_graph_capturing(device)
