"""File-writing helpers shared by every layer (no vtdense imports)."""

from __future__ import annotations

import secrets
from pathlib import Path

__all__ = ["temp_path_beside"]

_NAME_MAX = 255  # bytes in one file name on ext4, xfs, btrfs, APFS and NTFS (UTF-16 units there)


def temp_path_beside(path: Path) -> Path:
    """A fresh name in ``path``'s folder for a temporary file that is renamed onto ``path`` once
    written (an atomic write): ``.<name>.<12 hex digits>.tmp``, or ``.<12 hex digits>.tmp`` where
    ``path``'s name is too long to take the additions (a name near the file system's 255-byte
    limit). The file is not created; open it with mode ``"xb"`` so that a name taken meanwhile fails."""
    token = secrets.token_hex(6)
    name = f".{path.name}.{token}.tmp"
    if len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX:
        name = f".{token}.tmp"
    return path.with_name(name)
