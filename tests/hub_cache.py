"""A local Hugging Face Hub cache for tests: fake repos in the cache layout, offline mode on.

``hf_hub_download`` reads ``<cache>/models--{org}--{name}/refs/{revision}`` (a commit hash) and
returns ``snapshots/{hash}/{file}``. With ``HF_HUB_OFFLINE=1`` it never opens a connection, so a
test using this fixture cannot touch the network.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Returns ``add(repo_id, files, revision="main") -> snapshot dir``; ``files`` maps a file
    name to bytes, a dict (written as JSON) or a state dict (``.safetensors`` / ``.bin``)."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read at import by huggingface_hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def add(repo_id: str, files: dict[str, Any], revision: str = "main") -> Path:
        org, name = repo_id.split("/")
        commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
        repo = cache / f"models--{org}--{name}"
        (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)  # refs/pr/3 nests
        (repo / "refs" / revision).write_text(commit)
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for fname, content in files.items():
            path = snap / fname
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            elif fname.endswith(".json"):
                path.write_text(json.dumps(content))
            elif fname.endswith(".safetensors"):
                from safetensors.torch import save_file

                save_file({k: v.contiguous().clone() for k, v in content.items()}, str(path))
            else:
                torch.save(content, path)
        return snap

    return add
