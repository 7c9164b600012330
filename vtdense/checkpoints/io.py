"""Reading and writing checkpoint files safely.

The container is recognised from the file's first bytes (one exception: a pickle that torch's
``weights_only`` loader refuses is read as a detectron2 pickle only when its name ends in ``.pkl``,
so a torch file with pickled code gets torch's error, not the detectron2 reader's):

- safetensors (``save_backbone``'s format; timm / Hugging Face ``model.safetensors``): tensors
  plus string metadata.
- torch files (zip or legacy pickle): read with ``torch.load(weights_only=True)``.
- detectron2 model-zoo pickles (``.pkl``: a dict with numpy arrays under ``model`` and an
  ``__author__`` key): read with a restricted unpickler that admits numpy arrays and dtypes and
  plain containers only. Anything else in the pickle (a ``__reduce__`` to ``os.system``, a class
  of any library) is refused before it is built.

Checkpoints from elsewhere are untrusted; nothing here can run code stored in a file.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vtdense.files import temp_path_beside

__all__ = ["CheckpointError", "CheckpointFile", "read_checkpoint", "read_task_checkpoint", "write_safetensors",
           "cut_short", "SAFETENSORS_CONFIG_KEY"]

#: safetensors metadata key holding a vtdense backbone config (JSON).
SAFETENSORS_CONFIG_KEY = "vtdense_backbone"

# (module, name) pairs a detectron2 pickle needs: numpy's array reconstruction, dtypes, scalars,
# the bytes helper protocol-2 pickles use, and OrderedDict. Nothing that can call arbitrary code.
_PKL_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("collections", "OrderedDict"),
}
_PKL_DTYPE_CLASS = ("numpy.dtypes", "numpy._core.dtypes", "numpy.core.dtypes")  # numpy 2 dtype classes (Float32DType, ...)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model (the message names the file)."""


CheckpointReadError = CheckpointError


@dataclass
class CheckpointFile:
    """What :func:`read_checkpoint` found.

    Attributes:
        obj: the loaded object (a state dict, or a dict wrapping one).
        container: ``"safetensors"``, ``"torch"`` or ``"detectron2-pkl"``.
        metadata: safetensors string metadata (empty for other containers).
    """

    obj: Any
    container: str
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def vtdense_config(self) -> dict[str, Any] | None:
        """The backbone config ``save_backbone`` stored, if any."""
        if isinstance(self.obj, dict) and isinstance(self.obj.get(SAFETENSORS_CONFIG_KEY), dict):
            return dict(self.obj[SAFETENSORS_CONFIG_KEY])
        raw = self.metadata.get(SAFETENSORS_CONFIG_KEY)
        return json.loads(raw) if raw else None


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file, encoding="latin1")  # detectron2's Python 2 era pickles
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PKL_ALLOWED or (module in _PKL_DTYPE_CLASS and name.endswith("DType")):
            return super().find_class(module, name)
        raise CheckpointReadError(
            f"{self.source}: refused to unpickle {module}.{name}: a detectron2 checkpoint holds only numpy arrays "
            "and plain containers (this file may carry code; it was not run)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointReadError(f"{self.source}: persistent ids are not allowed in a detectron2 pickle")


def _numpy_to_torch(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.ndarray):
        # numbers only: an array of strings or objects is no weight (and torch cannot hold it)
        return torch.from_numpy(np.ascontiguousarray(obj)) if obj.dtype.kind in "biufc" else obj
    if isinstance(obj, dict):
        return {k: _numpy_to_torch(v) for k, v in obj.items()}
    return obj


def _read_detectron2_pickle(path: Path) -> Any:
    source = str(path)
    with path.open("rb") as f:
        try:
            obj = _RestrictedUnpickler(f, source).load()
        except CheckpointReadError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated or malformed: re-raised with the file name
            raise CheckpointReadError(f"cannot read detectron2 pickle {source}: {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointReadError(f"{source}: a detectron2 pickle is a dict, got {type(obj).__name__}")
    model = obj.get("model", obj)
    if not isinstance(model, dict):
        raise CheckpointReadError(f"{source}: 'model' is not a dict of arrays")
    return {"model": OrderedDict((k, v) for k, v in _numpy_to_torch(model).items() if isinstance(v, Tensor))}


def _safetensors_head(head: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes starting with ``head`` is laid out as safetensors: an 8-byte
    little-endian header length below the file size, then the JSON header's ``{``."""
    return len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size


def cut_short(path: str | Path) -> str | None:
    """What is wrong with ``path`` when it is a torch zip archive or a safetensors file whose end is
    missing (an interrupted save, copy or download): ``None`` for a whole file or one of another
    kind. Only the first bytes, the header and the zip's end record are read."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(16)
        if head[:4] == b"PK\x03\x04":  # torch.save's zip archive: its directory is at the end
            if zipfile.is_zipfile(f):
                return None
            return (f"it is a zip archive (torch.save's format) of {size:,} bytes without the end record that "
                    "closes one: the file is cut short or damaged (an interrupted save, copy or download)")
        if not _safetensors_head(head, size):
            return None
        n = int.from_bytes(head[:8], "little")
        f.seek(8)
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return None  # malformed rather than short: the reader's own error says more
    expected = 8 + n + end
    if size >= expected:
        return None
    return (f"it is a safetensors file of {size:,} bytes where its header describes {expected:,}: the file is cut "
            "short (an interrupted save, copy or download)")


def safetensors_metadata(path: str | Path) -> dict[str, str] | None:
    """The metadata of a safetensors file (no tensor is read); ``None`` for a file of another kind."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(16)
    if not _safetensors_head(head, path.stat().st_size):
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - re-raised with the file name
        raise CheckpointReadError(f"cannot read safetensors file {path}: {e}") from e


def read_checkpoint(path: str | Path) -> CheckpointFile:
    """Read a checkpoint file of any container vtdense supports (see the module docstring).

    Raises:
        CheckpointReadError: unreadable file, unknown container, or a pickle with anything but
            arrays and containers in it; the message names the file.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(16)
    damage = cut_short(path)
    if damage is not None:
        raise CheckpointReadError(f"cannot read checkpoint {path}: {damage}")
    if _safetensors_head(head, path.stat().st_size):
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
                metadata = dict(f.metadata() or {})
        except Exception as e:  # noqa: BLE001 - re-raised with the file name
            raise CheckpointReadError(f"cannot read safetensors file {path}: {e}") from e
        return CheckpointFile(tensors, "safetensors", metadata)
    if head[:2] == b"PK":  # torch's zip container
        return CheckpointFile(_torch_load(path), "torch")
    if head[:1] == b"\x80":  # a pickle: torch's legacy format, or a detectron2 model-zoo .pkl
        try:
            return CheckpointFile(_torch_load(path), "torch")
        except CheckpointReadError:
            if path.suffix != ".pkl":
                raise
        return CheckpointFile(_read_detectron2_pickle(path), "detectron2-pkl")
    raise CheckpointReadError(f"cannot read checkpoint {path}: not a safetensors, torch or detectron2 .pkl file")


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file name
        raise CheckpointReadError(f"cannot read checkpoint {path}: {e}") from e


#: The only classes a Lightning checkpoint of a vtdense task may hold besides tensors and plain
#: containers: ``pathlib`` paths, which ``save_hyperparameters`` stores as they were given (a data
#: module's ``root=Path(...)``).
_TASK_CHECKPOINT_GLOBALS = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]


#: First bytes of files sometimes passed where a checkpoint belongs -> what they are.
_KNOWN_HEADS = (
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
)


def _describe_head(head: bytes, size: int) -> str:
    """``"it is empty"``, ``"it is a PNG image"`` or ``"it starts with b'...'"``: what a file of
    ``size`` bytes that is not a checkpoint holds, from its first bytes."""
    if not head:
        return "it is empty"
    if _safetensors_head(head, size):
        return "it is a safetensors file torch.load cannot read"
    kind = next((name for magic, name in _KNOWN_HEADS if head.startswith(magic)), None)
    return f"it is {kind}" if kind else f"it starts with {head[:8]!r}"


def read_task_checkpoint(path: str | Path, mapped: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint of a vtdense task, read with ``torch.load(weights_only=True)`` on the
    CPU: tensors, plain containers and ``pathlib`` paths only, no code from the file runs.

    Args:
        path: the file.
        mapped: map the tensors' bytes from the file instead of reading them (``torch.load``'s
            ``mmap``; zip archives only, a legacy pickle is read whole): for a look at the
            checkpoint's entries and shapes that costs little for any size.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is no ``torch.save`` file at all (an image, a text file, an empty
            file: neither a zip archive nor a binary pickle; the message says what it is), is cut
            short (an interrupted save or copy), holds other Python objects (the message says
            ``weights_only=True``) or is no checkpoint dict; each message names the file.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        if (path / ".metadata").is_file():
            raise ValueError(
                f"checkpoint {str(path)!r} is the folder of a sharded checkpoint (FSDP with save_distributed_checkpoint=True), "
                "not a .ckpt file: loading a model from it outside the fit is not supported; resume the fit from it "
                "(--ckpt_path) with save_distributed_checkpoint=False, the default, to have rank 0 write one file"
            )
        raise ValueError(f"checkpoint {str(path)!r} is a folder, not a .ckpt file")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    damage = cut_short(path)
    if damage is not None:
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {damage}")
    try:
        with path.open("rb") as f:
            zipped = f.read(2) == b"PK"
        with torch.serialization.safe_globals(_TASK_CHECKPOINT_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped and zipped)
    except Exception as err:  # pickle / zip / weights-only errors all mean: not loadable safely
        with path.open("rb") as f:
            head = f.read(16)
        # torch.save writes a zip archive, or in its legacy format a pickle of protocol 2+ (torch's
        # weights_only reader reads no other pickle): a file that is neither is no checkpoint at all
        if head[:2] != b"PK" and head[:1] != b"\x80":
            what = _describe_head(head, path.stat().st_size)
            raise ValueError(f"{str(path)!r} is not a checkpoint: expected a file written by torch.save (a zip archive "
                             f"such as a Lightning .ckpt, or a pickle of protocol 2+), but {what}") from None
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [type(err).__name__]
        reason = next((ln for ln in lines if "unsupported global" in ln.lower()), lines[-1])
        raise ValueError(f"cannot load {str(path)!r} safely with torch.load(weights_only=True): {reason[:300]}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r} holds a {type(obj).__name__}, not a checkpoint dict")
    return obj


def write_safetensors(path: Path, state_dict: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write ``state_dict`` (contiguous CPU copies) with string ``metadata``, atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    tmp = temp_path_beside(path)  # a short name beside one near the 255-byte limit too
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)  # never leave a half-written file where a good one was
    finally:
        tmp.unlink(missing_ok=True)
