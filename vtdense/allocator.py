"""Keep freed CPU memory in the process, instead of handing it back to the kernel after every step.

PyTorch allocates CPU tensors with the C library's ``malloc``. With glibc (Linux), a block of more
than 128 KiB, or of more than the largest block freed so far, up to 32 MiB, is mapped from the kernel
and unmapped when it is freed. glibc also gives the free top of its heap back to the kernel once it
passes twice that threshold. Each later step then touches fresh pages, and every first touch of a
4 KiB page is a page fault, a few microseconds each on a virtual machine. One Swin-T forward at batch
8 and 224 made about 21,000-25,000 of them, and a training step at batch 2 and 512x768 about 34,000-45,000.

:func:`keep_freed_memory` tells glibc (``mallopt``) to serve blocks up to 32 MiB (the most it allows)
from its heap, and to give the heap's free top back to the kernel only beyond 1 GiB. Freed memory then
stays in the process for the next step, as PyTorch's CUDA caching allocator keeps GPU memory. The
process's resident memory then stays near its peak instead of shrinking between steps. Blocks over
32 MiB are still mapped and unmapped each time. vtdense's chunked CPU paths keep their temporaries
under that: 8 MiB in inference (:data:`vtdense.layers.chunked.CHUNK_BYTES`), 16 MiB in the training
MLP (:data:`vtdense.layers.chunked_mlp.TRAIN_CHUNK_BYTES`).

The setting is for the whole process, so a library does not make it behind its user's back. The
recipes (:func:`vtdense.cli.run_script`, which every ``recipes/*.py`` command goes through) apply it at
start unless ``VTDENSE_KEEP_FREED_MEMORY=0``. Elsewhere, call :func:`keep_freed_memory` yourself, or
start Python with ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set (see the README).
Other C libraries (macOS, musl, Windows) are left alone.

Measured with ``benchmarks/steady.py --keep-freed-memory`` (each contender alone in its process, 3
rounds, 2-core Zen 4 host, 2026-11-28). Swin-T inference at batch 8 and 224 took 472 ms with 25,041
faults per forward, and 445 ms with 1 fault with the setting (timm fused: 515 and 509 ms). The training
step at 512x768 took 3197 and 3120 ms (34,130 and 2 faults; timm fused 3346 and 3206).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["keep_freed_memory", "enabled_by_environment", "ENV_VAR", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

#: Environment variable: ``0`` (or ``false``/``no``/``off``) stops the recipes from calling
#: :func:`keep_freed_memory`.
ENV_VAR = "VTDENSE_KEEP_FREED_MEMORY"
#: Largest block glibc serves from its heap (bytes). 32 MiB is the most ``mallopt`` takes on 64-bit systems.
MMAP_THRESHOLD = 32 << 20
#: Free heap top that glibc keeps before giving memory back to the kernel (bytes).
TRIM_THRESHOLD = 1 << 30

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # another C library (musl)
    return libc


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Tell glibc to keep freed memory in the process (see the module docstring). It serves blocks
    of up to ``mmap_threshold`` bytes from its heap and keeps up to ``trim_threshold`` bytes of free
    heap top. It applies to the whole process and to processes forked from it later (DataLoader
    workers). glibc's adaptive threshold stays off afterwards, even if the values are set back.

    Returns:
        ``True`` if glibc took both settings. ``False`` where the C library is not glibc (then left
        as it was) or glibc refused a setting.

    Raises:
        ValueError: ``mmap_threshold`` not in ``[0, 32 MiB]``, or ``trim_threshold`` negative or
            over 2**31 - 1 (``mallopt`` takes a C ``int``).
    """
    if not 0 <= mmap_threshold <= MMAP_THRESHOLD:
        raise ValueError(f"keep_freed_memory: mmap_threshold must be in [0, {MMAP_THRESHOLD}] bytes, got {mmap_threshold}")
    if not 0 <= trim_threshold < 1 << 31:
        raise ValueError(f"keep_freed_memory: trim_threshold must be in [0, 2**31 - 1] bytes, got {trim_threshold}")
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold))
    return bool(ok)


def enabled_by_environment() -> bool:
    """Whether :data:`ENV_VAR` leaves :func:`keep_freed_memory` on (unset, empty or anything but
    ``0``/``false``/``no``/``off``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("0", "false", "no", "off")
