"""What :func:`vtdense.load_pretrained` did with a checkpoint: mapped, resized, dropped."""

from __future__ import annotations

import contextvars
import re
from typing import Any

__all__ = ["LoadReport", "active_report", "note_resized", "note_derived"]

_ACTIVE: contextvars.ContextVar["LoadReport | None"] = contextvars.ContextVar("vtdense_load_report", default=None)


def _shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


class LoadReport(tuple):
    """The ``(missing, unexpected)`` pair :func:`vtdense.load_pretrained` has always returned,
    with the details of the load as attributes (so ``missing, unexpected = load_pretrained(...)``
    keeps working).

    Attributes:
        source: the path or Hub id given (``"state dict"`` for an in-memory dict).
        container: ``safetensors``, ``torch``, ``detectron2-pkl`` or ``state dict``.
        format: the detected key layout: ``vtdense``, ``timm``, ``timm features_only``,
            ``official``, ``torchvision``, ``mmdet``, ``detectron2``, ``mvit (original)``.
        loaded: ``(checkpoint key, model key)`` of every tensor loaded as it is.
        resized: ``(model key, old shape, new shape, why)`` of every table resampled.
        derived: ``(model key, why)`` of tensors rebuilt from checkpoint tensors (split, permuted).
        dropped: ``(checkpoint key, why)`` of tensors not loaded.
        missing: model keys the checkpoint lacks (kept at their initialisation).
        unexpected: converted keys the model does not have.
        source_config: the checkpoint's own config (vtdense metadata or the Hub ``config.json``).
        source_window: the window the checkpoint was trained with, where known.
        source_log_cpb_windows: Swin V2: per stage, the window the checkpoint's Log-CPB
            coordinates were normalised by in training, where known (the
            ``pretrained_window_size`` that keeps their meaning at another window).
        source_log_cpb_fixed: whether the checkpoint's model fixed those windows with its own
            ``pretrained_window_size`` (else they followed the window in use).
        notes: advice (e.g. Swin V2's ``pretrained_window_size``).
    """

    def __new__(cls, source: str = "state dict") -> "LoadReport":
        report = super().__new__(cls, ([], []))
        report.source = source
        report.container = "state dict"
        report.format = "unknown"
        report.loaded: list[tuple[str, str]] = []
        report.resized: list[tuple[str, tuple[int, ...], tuple[int, ...], str]] = []
        report.derived: list[tuple[str, str]] = []
        report.dropped: list[tuple[str, str]] = []
        report.source_config: dict[str, Any] | None = None
        report.source_window: tuple[int, int] | None = None
        report.source_log_cpb_windows: list[tuple[int, int]] | None = None
        report.source_log_cpb_fixed = False
        report.notes: list[str] = []
        report.model_name = ""
        report.consumed: set[int] = set()  # ids of checkpoint tensors used to derive model tensors
        return report

    @property
    def missing(self) -> list[str]:
        return self[0]

    @property
    def unexpected(self) -> list[str]:
        return self[1]

    def __enter__(self) -> "LoadReport":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._token)

    def summary(self, examples: int = 3) -> str:
        """A few human-readable lines: what was mapped, resized, dropped and why."""
        renamed = [(a, b) for a, b in self.loaded if a != b]
        lines = [
            f"checkpoint {self.source} ({self.container}, {self.format} layout) -> {self.model_name}: "
            f"{len(self.loaded)} tensors loaded as they are ({len(renamed)} renamed), {len(self.resized)} resized, "
            f"{len(self.derived)} derived, {len(self.dropped)} dropped"
        ]
        if renamed:
            lines.append("  renamed, e.g. " + "; ".join(f"{a} -> {b}" for a, b in renamed[:examples]))
        shapes = {}
        for key, old, new, why in self.resized:
            shapes.setdefault(why, (old, new))
        for key, why in _group([(k, w) for k, _, _, w in self.resized]):
            old, new = shapes[why]
            lines.append(f"  resized {key}: {why}; e.g. {old} -> {new}")
        for key, why in _group(self.derived):
            lines.append(f"  derived {key}: {why}")
        for key, why in _group(self.dropped):
            lines.append(f"  dropped {key}: {why}")
        if self.missing:
            lines.append(f"  kept initialisation (not in checkpoint): {', '.join(_compress(self.missing))}")
        if self.unexpected:
            lines.append(f"  not in the model: {', '.join(_compress(self.unexpected))}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    __repr__ = tuple.__repr__


def _compress(keys: list[str], limit: int = 6) -> list[str]:
    out = keys[:limit]
    return out + [f"... ({len(keys) - limit} more)"] if len(keys) > limit else out


def _group(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Collapse ``layers.0.blocks.1.x`` style keys sharing a reason into one pattern line."""
    groups: dict[tuple[str, str], int] = {}
    for key, why in items:
        pattern = re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", key))
        groups[(pattern, why)] = groups.get((pattern, why), 0) + 1
    return [(f"{p} (x{n})" if n > 1 else p, why) for (p, why), n in groups.items()]


def active_report() -> LoadReport | None:
    """The report of the load in progress (converters read its ``source_window``); ``None`` outside a load."""
    return _ACTIVE.get()


def note_resized(key: str, old: Any, new: Any, why: str) -> None:
    """Called by converters when they resample checkpoint tensor ``old`` into ``new`` for model
    key ``key`` (no-op outside a load)."""
    report = _ACTIVE.get()
    if report is not None:
        report.resized.append((key, _shape(old.shape), _shape(new.shape), why))
        report.consumed.add(id(old))


def note_derived(key: str, why: str, source: Any = None) -> None:
    """Called by converters when model key ``key`` is computed from checkpoint tensor ``source``."""
    report = _ACTIVE.get()
    if report is not None:
        report.derived.append((key, why))
        if source is not None:
            report.consumed.add(id(source))


def note(text: str) -> None:
    """Called by converters to add advice to the report (no-op outside a load; a repeated note
    is kept once)."""
    report = _ACTIVE.get()
    if report is not None and text not in report.notes:
        report.notes.append(text)
