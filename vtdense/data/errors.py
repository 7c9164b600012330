"""Bad samples: the error a dataset raises for one unusable file, skipping it at load time, and the skip report.

Datasets check what is cheap at construction (annotation files, ids, that files exist) and raise one
error naming the file, id or option before training starts. What only decoding shows (an image that
is corrupt or truncated, a label map that disagrees with its image) turns up at load time, possibly
hours into a run. There the dataset skips the sample instead of killing the run: it loads the next
loadable index in its place (so batch sizes and the sample order stay deterministic), logs one
warning naming the file with a running count, and records it.

Records are plain dicts (``file``, ``image_id``, ``annotation_id``, ``reason``, ``when``) kept in
the dataset's ``skipped`` list. DataLoader workers are separate processes, so records made there do
not reach the main process's list; when the dataset's ``skip_file`` is set (see
:func:`write_skip_report`), every process also appends its load-time records to that file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "SKIP_REPORT_NAME",
    "BadSampleError",
    "SkipOnBadSample",
    "append_skip_record",
    "read_skip_report",
    "skip_record",
    "write_skip_report",
]

logger = logging.getLogger(__name__)

#: File name of the skip report in a run directory (one JSON object per line).
SKIP_REPORT_NAME = "skipped.jsonl"

T = TypeVar("T")


class BadSampleError(ValueError):
    """One image or label map cannot be used; the message names the file and its id.

    Args:
        message: The full message.
        file: The offending file.
        image_id: The image id (COCO) or ``None``.
    """

    def __init__(self, message: str, *, file: str | os.PathLike[str], image_id: Any = None) -> None:
        super().__init__(message)
        self.file = str(file)
        self.image_id = image_id


def skip_record(
    file: str | os.PathLike[str],
    reason: str,
    *,
    image_id: Any = None,
    annotation_id: Any = None,
    when: str = "load",
) -> dict[str, Any]:
    """One skip-report entry.

    Args:
        file: The image, label map or annotation file concerned.
        reason: Why it was skipped (the warning's text).
        image_id: COCO image id, if any.
        annotation_id: COCO annotation id, if an annotation was dropped.
        when: ``"start-up"`` (found while building the dataset) or ``"load"`` (while loading a sample).

    Returns:
        ``{"file", "image_id", "annotation_id", "reason", "when"}``.
    """
    return {"file": str(file), "image_id": image_id, "annotation_id": annotation_id, "reason": reason, "when": when}


def write_skip_report(records: Iterable[dict[str, Any]], run_dir: str | os.PathLike[str]) -> Path:
    """Write ``records`` to ``run_dir/skipped.jsonl`` (one JSON object per line) and return its path.

    The file is replaced atomically (written beside it, then renamed), so a kill never leaves half
    a report. Call it on one process only (rank 0); it runs no collective. To have load-time skips
    from every DataLoader worker appended to the same file, set each dataset's ``skip_file`` to the
    returned path before its DataLoader starts its workers::

        path = write_skip_report(train_ds.skipped + val_ds.skipped, run_dir)
        train_ds.skip_file = val_ds.skip_file = path

    Args:
        records: Skip records (see :func:`skip_record`).
        run_dir: The run directory (created if missing).

    Returns:
        The report's path (written even when there are no records, so its absence means "not checked").
    """
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SKIP_REPORT_NAME
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_skip_report(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a skip report (lines that are not JSON, e.g. cut by a kill, are ignored)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def append_skip_record(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append one record to a skip report unless the same file and reason are listed already.

    One short ``write`` in append mode, so lines from several worker processes do not interleave.
    """
    path = Path(path)
    key = (record.get("file"), record.get("reason"))
    with open(path, "a", encoding="utf-8") as f:
        if fcntl is not None:  # the check and the write as one step among processes (DataLoader workers)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if any((r.get("file"), r.get("reason")) == key for r in read_skip_report(path)):
                return
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


class SkipOnBadSample:
    """Mixin for map-style datasets: skip samples that raise :class:`BadSampleError` at load time.

    The dataset sets ``self.skipped`` (list of records), ``self.skip_file`` (``None`` or a report
    path) and ``self.on_bad_sample`` (``"skip"`` or ``"error"``) and calls
    :meth:`_load_or_substitute` from ``__getitem__``.
    """

    skipped: list[dict[str, Any]]
    skip_file: str | os.PathLike[str] | None
    on_bad_sample: str

    def _init_skipping(self, on_bad_sample: str) -> None:
        if on_bad_sample not in ("skip", "error"):
            raise ValueError(f"on_bad_sample must be 'skip' or 'error', got {on_bad_sample!r}")
        self.on_bad_sample = on_bad_sample
        self.skipped = []
        self.skip_file = None
        self._bad_indices: set[int] = set()
        self._num_load_skips = 0

    def _load_or_substitute(self, index: int, load: Callable[[int], T], size: int) -> T:
        """``load(index)``, or, when it raises :class:`BadSampleError`, the next index that loads.

        The substitute depends only on ``index`` and on which files are bad, so the order of samples
        stays deterministic. Each bad index warns once per process and is not decoded again.
        """
        for k in range(size):
            j = (index + k) % size
            if j in self._bad_indices:
                continue
            try:
                return load(j)
            except BadSampleError as e:
                if self.on_bad_sample == "error":
                    raise
                self._bad_indices.add(j)
                self._num_load_skips += 1
                record = skip_record(e.file, str(e), image_id=e.image_id, when="load")
                self.skipped.append(record)
                logger.warning(
                    "skipped a sample (%d so far in this process; a substitute is loaded in its place): %s",
                    self._num_load_skips, e,
                )
                if self.skip_file is not None:
                    try:
                        append_skip_record(self.skip_file, record)
                    except OSError as err:  # a report that cannot be written must not stop training
                        logger.warning("could not append to the skip report %s: %s", self.skip_file, err)
        first = next((r for r in self.skipped if r["when"] == "load"), None)
        raise BadSampleError(
            f"{type(self).__name__}: none of its {size} samples could be loaded; "
            f"first problem: {first['reason'] if first else 'unknown'}",
            file=first["file"] if first else "",
        )
