"""Checkpoints by name: Hugging Face Hub ids resolved through ``huggingface_hub``.

A string given as weights is, in this order:

1. an existing local file: used as is;
2. a Hub id: ``org/repo`` (``timm/swin_tiny_patch4_window7_224.ms_in1k``), optionally
   ``org/repo@revision`` (a pull request's ``refs/pr/<n>`` too), or with an explicit prefix
   ``hf-hub:org/repo[@revision][/file/in/repo]`` (timm's spelling; ``hf://`` works too). A name
   that looks like a file (a checkpoint suffix, a path with more than one ``/``, or one starting
   with ``.``, ``/`` or ``~``) is taken as a missing local file instead.

Hub files are fetched with ``hf_hub_download``, so its cache (``HF_HOME`` / ``HF_HUB_CACHE``),
offline mode (``HF_HUB_OFFLINE=1``: cache only, no network) and token (``HF_TOKEN`` or
``huggingface-cli login``) apply. In a repo without an explicit file, ``model.safetensors`` is
preferred, then ``pytorch_model.bin``; ``config.json`` is read when present, for the report.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

__all__ = ["HubCheckpoint", "HubError", "WEIGHT_FILES", "is_hub_id", "log_cpb_windows_from_hub_config", "resolve_checkpoint",
           "window_from_hub_config"]

#: Files tried, in order, in a Hub repo given without an explicit file.
WEIGHT_FILES: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin", "model.pth", "model_final.pkl")

_PREFIXES = ("hf-hub:", "hf://")
_FILE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".pkl", ".pyth", ".tar", ".npz")
#: ``refs/<kind>/<name>`` revisions, which continue past two ``/``: ``refs/pr/3``, ``refs/convert/parquet``.
_REF_KINDS = ("pr", "convert", "heads", "tags")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class HubError(ValueError):
    """A Hub id that cannot be resolved (the message names the id)."""


@dataclass
class HubCheckpoint:
    """A resolved checkpoint location.

    Attributes:
        path: local file to read.
        source: what the user gave (path or Hub id), for messages.
        repo_id: the Hub repo, ``None`` for a local file.
        config: the repo's ``config.json`` (timm writes ``architecture`` and ``pretrained_cfg``), if any.
    """

    path: Path
    source: str
    repo_id: str | None = None
    config: dict[str, Any] | None = None


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` (not an existing file) names a Hub repo rather than a local file."""
    if spec.startswith(_PREFIXES):
        return True
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(_FILE_SUFFIXES):
        return False
    return bool(_REPO_ID.match(spec))


def _split(spec: str) -> tuple[str, str | None, str | None]:
    """``hf-hub:org/repo@rev/sub/file`` -> (``org/repo``, ``rev``, ``sub/file``)."""
    for p in _PREFIXES:
        if spec.startswith(p):
            spec = spec[len(p) :]
    parts = spec.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise HubError(f"{spec!r} is not a Hugging Face Hub id (expected org/repo)")
    name, _, revision = parts[1].partition("@")
    revision = unquote(revision)  # huggingface_hub's own hf:// paths spell refs/pr/3 as refs%2Fpr%2F3
    rest = parts[2:]
    if revision == "refs" and rest and rest[0] in _REF_KINDS:
        # the Hub's pull-request and conversion refs hold slashes: refs/pr/<n>, refs/convert/<name>
        if len(rest) < 2 or not rest[1]:
            raise HubError(f"{spec!r}: revision '{revision}/{'/'.join(rest)}' is incomplete (expected e.g. refs/pr/3)")
        revision, rest = "/".join([revision, *rest[:2]]), rest[2:]
    filename = "/".join(rest) or None
    return f"{parts[0]}/{name}", revision or None, filename


def resolve_checkpoint(spec: str | os.PathLike) -> HubCheckpoint:
    """Turn a local path or Hub id into a local file (see the module docstring).

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        HubError: a Hub id whose weights are not in the cache (offline) or on the Hub; the
            message names the id, the files tried and the cache directory.
    """
    path = Path(os.path.expanduser(str(spec)))
    text = str(spec)
    if path.is_file():
        return HubCheckpoint(path, text)
    if not isinstance(spec, str) or not is_hub_id(text):
        raise FileNotFoundError(f"checkpoint file not found: {text}")
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError as e:  # pragma: no cover - a dependency of vtdense
        raise HubError(f"{text!r} looks like a Hub id but huggingface_hub is not installed: {e}") from e
    repo_id, revision, filename = _split(text)
    candidates = (filename,) if filename else WEIGHT_FILES
    found: Path | None = None
    try:
        for name in candidates:
            try:
                found = Path(hf_hub_download(repo_id, name, revision=revision))
                break
            except EntryNotFoundError:  # includes "not in the local cache" when offline
                continue
    except Exception as e:  # noqa: BLE001 - repo not found, gated, bad revision: one clear error
        raise HubError(f"cannot fetch Hub checkpoint {text!r} (repo {repo_id}): {type(e).__name__}: {e}") from e
    if found is None:
        how = "HF_HUB_OFFLINE=1, so only the cache was searched" if constants.HF_HUB_OFFLINE else "nor downloadable"
        raise HubError(
            f"Hub checkpoint {text!r}: none of {', '.join(candidates)} is in the Hub cache "
            f"{constants.HF_HUB_CACHE} for repo {repo_id} ({how})"
        )
    config = None
    try:
        config_path = hf_hub_download(repo_id, "config.json", revision=revision)
        config = json.loads(Path(config_path).read_text())
    except Exception:  # noqa: BLE001 - config.json is optional and only informs the report
        config = None
    return HubCheckpoint(found, text, repo_id, config)


def window_from_hub_config(config: dict[str, Any] | None) -> int | None:
    """The window a timm Swin checkpoint was trained with, from its ``config.json`` (``None`` if unknown)."""
    if not config:
        return None
    for key in ("architecture", "model_name"):
        m = re.search(r"window(\d+)(?:to(\d+))?", str(config.get(key, "")))
        if m:
            return int(m[2] or m[1])  # "window12to24": fine-tuned to 24
    return None


def log_cpb_windows_from_hub_config(config: dict[str, Any] | None) -> tuple[list[tuple[int, int]], bool] | None:
    """For a timm Swin V2 checkpoint, from the name in its ``config.json``: per stage, the window
    its Log-CPB coordinates were normalised by in training, and whether the model fixed them
    (``True``: timm builds ``swinv2_*_window{A}to{B}_{P}to{Q}`` with ``pretrained_window_sizes``
    from its window-``A``, ``P``-px pre-training) or they follow the window in use (``False``:
    ``swinv2_*_window{A}_{P}``, trained at window ``A`` on ``P`` px, windows shrunk to small maps).
    ``None`` for other names."""
    from vtdense.backbones.swin import log_cpb_windows  # lazy: checkpoints import the backbones

    if not config:
        return None
    for key in ("architecture", "model_name"):
        name = str(config.get(key, ""))
        m = re.search(r"swinv2_.*window(\d+)(to\d+)?_(\d+)(?:to\d+)?", name)
        if m:
            return log_cpb_windows(int(m[1]), int(m[3])), m[2] is not None
    return None
