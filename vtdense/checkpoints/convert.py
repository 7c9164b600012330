"""Checkpoint interop: translate foreign state dicts to vtdense's own, then load them.

One table of rules per format. Formats are detected from the keys, never from file names:

- ``timm``: timm's ``swin_*`` / ``swinv2_*`` models, classification or ``features_only``
  (``layers_0.`` flattened names). vtdense uses timm's parameter names, so this is mostly a
  filter of classifier weights and non-persistent buffers.
- ``official``: microsoft/Swin-Transformer releases (``model`` wrapper, patch merging at the
  *end* of a stage: ``layers.{i}.downsample`` belongs to vtdense stage ``i + 1``).
- ``torchvision``: ``torchvision.models.swin_t`` & co (``features.{k}...``).
- ``mmdet`` / ``detectron2``: prefixes ``backbone.`` / ``backbone.bottom_up.`` and the output
  norms ``norm{i}``.
- ``mvitv2``: timm names (``stages.{s}.blocks.{j}``); the original facebookresearch/mvit layout
  (``model_state`` wrapper, flat ``blocks.{i}``, ``blocks.{i}.proj``) and detectron2
  (``backbone.bottom_up.``, ``scale{k}_norm``), mapped onto stages through the depths.

- vtdense task checkpoints: the backbone part (``model.encoder.backbone.`` of ``SegmentationTask``,
  ``model.backbone.body.`` of ``DetectionTask``) of a Lightning ``.ckpt``.

Wrappers (``model``, ``state_dict``, ``model_state``, ``module.``) are stripped first. Tables that
depend on the window (V1 bias tables) are resized when the target window differs. Files and Hub
ids are resolved by :mod:`vtdense.checkpoints.hub` and read by :mod:`vtdense.checkpoints.io`;
what a load did is a :class:`~vtdense.checkpoints.report.LoadReport`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import Tensor, nn

from vtdense.checkpoints.adapt import adapt_input_conv
from vtdense.checkpoints.io import SAFETENSORS_CONFIG_KEY, CheckpointError, cut_short, read_checkpoint, write_safetensors
from vtdense.checkpoints.report import LoadReport, active_report, note, note_derived, note_resized

if TYPE_CHECKING:
    from vtdense.checkpoints.hub import HubCheckpoint

__all__ = [
    "CheckpointError",
    "check_checkpoint_source",
    "build_pretrained",
    "LoadReport",
    "convert_state_dict",
    "detect_format",
    "load_backbone",
    "load_pretrained",
    "register_converter",
    "save_backbone",
]

# Buffers some formats persist that vtdense derives itself, and classification-only weights.
_DROP = re.compile(
    r"(relative_position_index|relative_coords_table|attn_mask|\.k_bias$|^head\.|^fc\.|^norm\.|^fc_norm\.|^head_drop|^cls_token$)"
)


def _unwrap(obj: object, source: str) -> dict[str, Tensor]:
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    for key in ("model_state", "state_dict", "model", "module"):
        if isinstance(obj, Mapping) and key in obj and isinstance(obj[key], Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"{source}: not a state dict of tensors (got {type(obj).__name__})")
    sd = dict(obj)
    for prefix in ("module.", "_orig_mod."):
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix) :]: v for k, v in sd.items()}
    return sd


# family name -> converter(state_dict, model) -> vtdense state dict
_CONVERTERS: dict[str, Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]]] = {}


def register_converter(family: str) -> Callable:
    """Register ``fn(state_dict, model) -> state_dict`` for models whose ``family`` is ``family``."""

    def wrap(fn: Callable) -> Callable:
        _CONVERTERS[family] = fn
        return fn

    return wrap


# Lightning checkpoints of vtdense's own tasks: SegmentationTask (SMP encoder), DetectionTask (FPN body);
# then the state dicts of the models alone (``build_segmentor``, ``build_detector``).
_TASK_PREFIXES = ("model.encoder.backbone.", "model.backbone.body.", "encoder.backbone.", "backbone.body.")


def _strip_prefix(sd: dict[str, Tensor], prefixes: tuple[str, ...]) -> dict[str, Tensor]:
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in sd):
            return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def _family(model: nn.Module) -> str:
    from vtdense.backbones.swin import SwinTransformer

    if isinstance(model, SwinTransformer):
        return "swin"
    family = getattr(model, "family", None)
    if family is None:
        raise CheckpointError(f"no checkpoint converter for {type(model).__name__}")
    return family


@register_converter("swin")
def _convert_swin(sd: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    from vtdense.layers.position import centre_bias_table, resize_bias_table

    sd = _strip_prefix(sd, _TASK_PREFIXES + ("backbone.bottom_up.", "backbone.", "encoder.model.", "encoder.", "model."))
    if any(k.startswith("features.") for k in sd):
        sd = _from_torchvision_swin(sd)
    elif any(k.startswith("stages.") for k in sd):
        sd = _from_mmdet_swin(sd)
    sd = {re.sub(r"^layers_(\d+)\.", r"layers.\1.", k): v for k, v in sd.items()}
    if "layers.0.downsample.reduction.weight" in sd:  # official layout: merging ends a stage
        sd = {re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) + 1}.downsample", k): v for k, v in sd.items()}
    # output norms: detectron2 / mmdet ``norm{i}`` (stage index), vtdense ``out_norms.stage{i+1}``
    sd = {re.sub(r"^norm(\d)\.", lambda m: f"out_norms.stage{int(m[1]) + 1}.", k): v for k, v in sd.items()}
    own = model.state_dict()
    built = len(model.layers)
    nominal = _nominal_window([v.shape[0] for k, v in sd.items() if k.endswith("relative_position_bias_table")], tuple(model.window_size))
    out = {}
    for k, v in sd.items():
        if _DROP.search(k):
            continue
        m = re.match(r"layers\.(\d+)\.", k)
        if m and int(m[1]) >= built:
            continue  # stages beyond the last requested output are not built
        if k.startswith("out_norms.") and k not in own:
            continue  # output norms of outputs the model does not emit (or out_norm=False)
        if k.endswith("attn.qkv.bias") and k not in own and k.replace("qkv.bias", "q_bias") in own:
            # one q/k/v bias (torchvision V2, whose k third is zeroed at run time) -> q_bias, v_bias
            q, _, vb = v.chunk(3)
            out[k.replace("qkv.bias", "q_bias")], out[k.replace("qkv.bias", "v_bias")] = q, vb
            for part in ("q_bias", "v_bias"):
                note_derived(k.replace("qkv.bias", part), "a third of the checkpoint's qkv.bias (Swin V2 has no k bias)", v)
            continue
        if k.endswith("relative_position_bias_table") and k in own and own[k].shape != v.shape:
            new = tuple(model.window_size)
            old = _table_window(v.shape[0], nominal)
            if old is None:
                # a flat table does not say which non-square window it was made for (77 rows: 4x6 or 6x4)
                raise CheckpointError(
                    f"{k}: a bias table of {v.shape[0]} rows is not one of a square window ((2w-1)^2 rows), and its "
                    f"row count does not say which non-square window made it; this model's window is "
                    f"{new[0]}x{new[1]}: build the model with the checkpoint's window_size to load it")
            if new == nominal and old != nominal and old[0] <= nominal[0] and old[1] <= nominal[1]:
                # a window shrunk to a small map: the offsets it learned are the centre of the nominal
                # table, where this model reads them at that map size; the offsets it never saw start at 0
                resized = centre_bias_table(v, old, new)
                why = f"Swin V1 bias table of a window shrunk to {old[0]}x{old[1]} in a {nominal[0]}x{nominal[1]} model: placed at the centre of the {new[0]}x{new[1]} table, the offsets it never saw at 0"
            else:
                resized = resize_bias_table(v, old, new)
                why = f"Swin V1 bias table, window {old[0]}x{old[1]} -> {new[0]}x{new[1]} (bicubic)"
            note_resized(k, v, resized, why)
            v = resized
        out[k] = v
    return out


def _rows(window: tuple[int, int]) -> int:
    return (2 * window[0] - 1) * (2 * window[1] - 1)


def _nominal_window(rows: list[int], model_window: tuple[int, int]) -> tuple[int, int] | None:
    """The window a Swin V1 checkpoint was built for: the one its load report knows (a vtdense
    config, a Hub name), else the model's when its largest bias table has that window's row count,
    else the square window of that table (timm sizes a stage's table for a window shrunk to a map
    smaller than the nominal one, so the largest table is the nominal window's)."""
    report = active_report()
    if report is not None and report.source_window is not None:
        return tuple(report.source_window)
    if not rows:
        return None
    if max(rows) == _rows(model_window):
        return model_window
    side = round(max(rows) ** 0.5)
    return ((side + 1) // 2,) * 2 if side * side == max(rows) and side % 2 else None


def _table_window(rows: int, nominal: tuple[int, int] | None) -> tuple[int, int] | None:
    """Which window a V1 bias table of ``rows`` rows was made for: the nominal window, a square
    one, or the one window shrunk from the nominal window (each side at most the nominal one's)
    with that row count; ``None`` where that is not known."""
    if nominal is not None and rows == _rows(nominal):
        return nominal
    side = round(rows**0.5)
    if side * side == rows and side % 2:
        return ((side + 1) // 2,) * 2
    if nominal is None:
        return None
    shrunk = [(h, w) for h in range(1, nominal[0] + 1) for w in range(1, nominal[1] + 1) if _rows((h, w)) == rows]
    return shrunk[0] if len(shrunk) == 1 else None


def _from_torchvision_swin(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """torchvision ``features.0.0`` (conv) ``features.0.2`` (norm), stages at odd indices,
    merging at even ones; ``mlp.0``/``mlp.3`` for fc1/fc2."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"features\.0\.(0|2)\.(.*)", k)
        if m:
            out[f"patch_embed.{'proj' if m[1] == '0' else 'norm'}.{m[2]}"] = v
            continue
        m = re.match(r"features\.(\d+)\.(\d+)\.(.*)", k)
        if m and int(m[1]) % 2 == 1:
            rest = re.sub(r"(^|\.)mlp\.0\.", r"\1mlp.fc1.", m[3])
            rest = re.sub(r"(^|\.)mlp\.3\.", r"\1mlp.fc2.", rest)
            out[f"layers.{int(m[1]) // 2}.blocks.{m[2]}.{rest}"] = v
            continue
        m = re.match(r"features\.(\d+)\.(.*)", k)
        if m:
            out[f"layers.{int(m[1]) // 2}.downsample.{m[2]}"] = v
            continue
        out[k] = v
    return out


def _from_mmdet_swin(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """mmdet/mmseg Swin: ``patch_embed.projection``, ``stages.i.blocks.j.attn.w_msa``,
    ``ffn.layers.0.0``/``ffn.layers.1``, merging at the end of a stage.

    mmdet merges 2x2 neighbours with ``nn.Unfold``, so its ``4C`` axis is channel-major
    (``c * 4 + k``, ``k`` over (0,0),(0,1),(1,0),(1,1)); vtdense concatenates whole neighbours
    (``k * C + c``, ``k`` over (0,0),(1,0),(0,1),(1,1)). The merge weights are permuted back.
    """
    out = {}
    for k, v in sd.items():
        k = k.replace("patch_embed.projection.", "patch_embed.proj.")
        k = k.replace("attn.w_msa.", "attn.").replace("ffn.layers.0.0.", "mlp.fc1.").replace("ffn.layers.1.", "mlp.fc2.")
        m = re.match(r"stages\.(\d+)\.downsample\.(.*)", k)
        if m:
            k = f"layers.{int(m[1]) + 1}.downsample.{m[2]}"
            if m[2] in ("reduction.weight", "norm.weight", "norm.bias"):  # V1 norm is on 4C
                permuted = _unfold_to_concat(v)
                note_derived(f"layers.{int(m[1]) + 1}.downsample.{m[2]}", "4C axis permuted from mmdet's unfold order", v)
                v = permuted
        out[re.sub(r"^stages\.", "layers.", k)] = v
    return out


def _unfold_to_concat(v: Tensor) -> Tensor:
    """Reorder the last (``4C``) axis from unfold order to neighbour-concat order."""
    c4 = v.shape[-1]
    v = v.reshape(*v.shape[:-1], c4 // 4, 4).transpose(-1, -2)  # ..., 4, C
    return v[..., [0, 2, 1, 3], :].reshape(*v.shape[:-2], c4)


# ---------------------------------------------------------------------------------------------
# MViTv2
# ---------------------------------------------------------------------------------------------
# vtdense uses timm's MViTv2 names (``stages.{s}.blocks.{j}``). The original
# facebookresearch/mvit checkpoints (``model_state`` wrapper) and detectron2's ``MViT``
# (``backbone.bottom_up.`` prefix) number blocks flat (``blocks.{i}``) and call the width-changing
# shortcut ``blocks.{i}.proj``; detectron2 also stores the output norms as ``scale{2..5}_norm``.


def _mvitv2_flat_to_staged(sd: dict[str, Tensor], depths: tuple[int, ...], expand_attn: bool) -> dict[str, Tensor]:
    where = [(s, j) for s, d in enumerate(depths) for j in range(d)]
    shortcut = "shortcut_proj_attn" if expand_attn else "shortcut_proj_mlp"
    out = {}
    for k, v in sd.items():
        m = re.match(r"blocks\.(\d+)\.(.*)", k)
        if m:
            i = int(m[1])
            if i >= len(where):
                raise CheckpointError(f"checkpoint block {i} does not exist in a model of depths {depths}")
            s, j = where[i]
            rest = re.sub(r"^proj\.", f"{shortcut}.", m[2])
            k = f"stages.{s}.blocks.{j}.{rest}"
        k = re.sub(r"^scale(\d)_norm\.", lambda n: f"out_norms.stage{int(n[1]) - 1}.", k)
        out[k] = v
    return out


@register_converter("mvitv2")
def _convert_mvitv2(sd: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    from vtdense.layers.position import resize_rel_pos_table

    sd = _strip_prefix(sd, _TASK_PREFIXES + ("backbone.bottom_up.", "backbone.", "model."))
    if any(re.match(r"blocks\.\d+\.", k) for k in sd):
        sd = _mvitv2_flat_to_staged(sd, tuple(model.depths), bool(model.expand_attn))
    own = model.state_dict()
    built = len(model.stages)
    out = {}
    for k, v in sd.items():
        if _DROP.search(k):
            continue
        m = re.match(r"stages\.(\d+)\.", k)
        if m and int(m[1]) >= built:
            continue  # stages beyond the last requested output are not built
        if k.startswith("out_norms.") and k not in own:
            continue  # output norms of outputs the model does not emit (or out_norm=False)
        if re.search(r"\.rel_pos_[hw]$", k) and k in own and own[k].shape[0] != v.shape[0]:
            resized = resize_rel_pos_table(v, own[k].shape[0])  # checkpoint made for another img_size
            note_resized(k, v, resized, "MViTv2 decomposed rel-pos table resampled (linear) for the model's img_size / window")
            if getattr(model.get_submodule(k.rsplit(".", 1)[0]), "window", 0):
                # a windowed block resamples its table again, to its window, at run time
                note(
                    f"MViTv2 windowed blocks' rel-pos tables were resampled to img_size={model.img_size}'s length and are "
                    "resampled again to the window's at run time, so they no longer hold the checkpoint's values: build "
                    "with the checkpoint's img_size to keep them (detectron2's MViTv2 configs keep 224 at any input size)"
                )
            v = resized
        out[k] = v
    return out


_logger = logging.getLogger("vtdense.checkpoints")


def detect_format(state_dict: Mapping[str, Tensor], model: nn.Module) -> str:
    """Name the key layout of an (unwrapped) state dict for ``model``'s family.

    Returns one of ``vtdense``, ``vtdense task checkpoint`` (a Lightning checkpoint of
    ``SegmentationTask`` / ``DetectionTask``), ``vtdense model`` (the state dict of a
    ``build_segmentor`` / ``build_detector`` model), ``timm``, ``timm features_only``, ``official``,
    ``torchvision``, ``mmdet``, ``detectron2``, ``mvit (original)``.
    """
    keys = list(state_dict)

    def has(pattern: str) -> bool:
        rx = re.compile(pattern)
        return any(rx.match(k) for k in keys)

    if has(r"model\.(encoder\.backbone|backbone\.body)\."):
        return "vtdense task checkpoint"
    if has(r"(encoder\.backbone|backbone\.body)\."):
        return "vtdense model"
    if has(r"backbone\.bottom_up\."):
        return "detectron2"
    if _family(model) == "mvitv2":
        if has(r"(model\.)?blocks\.\d+\."):
            return "mvit (original)"
        return "vtdense" if has(r"(backbone\.)?out_norms\.") else "timm"
    if has(r"(backbone\.)?features\.\d"):
        return "torchvision"
    if has(r"backbone\.layers\.\d"):  # an SMP encoder's (VtdenseEncoder), a wrapped timm model's, or
        # the official layout under mmdet's prefix (Swin-Transformer-Object-Detection / -Semantic-Segmentation)
        if "backbone.layers.0.downsample.reduction.weight" in state_dict:
            return "official"
        return "vtdense" if has(r"backbone\.out_norms\.") else "timm"
    if has(r"(backbone\.)?stages\.\d") or has(r"backbone\."):
        return "mmdet"
    if has(r"layers_\d\."):
        return "timm features_only"
    if "layers.0.downsample.reduction.weight" in state_dict:
        return "official"
    if has(r"out_norms\."):
        return "vtdense"
    return "timm"


def convert_state_dict(state_dict: object, model: nn.Module, source: str = "state dict") -> dict[str, Tensor]:
    """Translate a foreign (or vtdense) state dict into ``model``'s key space."""
    sd = _unwrap(state_dict, source)
    return _CONVERTERS[_family(model)](sd, model)


_CLASSIFIER = re.compile(r"^(head\.|fc\.|norm\.|fc_norm\.|head_drop|cls_token$)")
_DERIVED = re.compile(r"(relative_position_index|relative_coords_table|attn_mask|\.k_bias$)")


def _drop_reason(key: str, prefixes_stripped: bool, whole_model: bool = False) -> str:
    """Why ``key`` was not loaded; ``whole_model``: the checkpoint is a vtdense task's or model's
    (its backbone under one of :data:`_TASK_PREFIXES`), so whatever lies outside is a neck or a
    head (RetinaNet's ``head.`` included), not a classifier."""
    bare = re.sub(r"^(backbone\.bottom_up\.|backbone\.|model\.|encoder\.)", "", key)
    if _DERIVED.search(bare):
        return "derived buffer, recomputed by vtdense"
    if whole_model and not key.startswith(_TASK_PREFIXES):
        return "not part of the backbone (neck / head)"
    if _CLASSIFIER.search(bare):
        return "classification head / final norm"
    if prefixes_stripped and key.startswith(
        ("backbone.", "model.", "roi_heads.", "proposal_generator.", "rpn_head.", "roi_head.", "bbox_head.", "mask_head.",
         "decode_head.", "auxiliary_head.", "aux_head.", "neck.")
    ):
        return "not part of the backbone (neck / head)"
    return "stage or output the model does not build"


def _source_windows(report: LoadReport, config: dict | None, hub_config: dict | None) -> None:
    """Fill the report's ``source_window`` and Swin V2 ``source_log_cpb_*`` from the checkpoint's
    vtdense config or its Hub config.json."""
    from vtdense.checkpoints.hub import log_cpb_windows_from_hub_config, window_from_hub_config
    from vtdense.layers.windows import to_2tuple

    if config and "name" in config:
        from vtdense.backbones.registry import create_backbone
        from vtdense.backbones.swin import SwinTransformer, _per_stage_windows

        try:
            with torch.device("meta"):
                built = create_backbone(config["name"], **{k: v for k, v in config.items() if k != "name"})
        except (ValueError, TypeError):
            return
        window = getattr(built, "window_size", None)
        report.source_window = to_2tuple(window) if window else None
        if isinstance(built, SwinTransformer) and built.version == 2:
            fixed = _per_stage_windows(config.get("pretrained_window_size", 0), len(built.depths))
            # not fixed: normalised by the window in use, which is the saved window unless the
            # training images were small enough to shrink it (not recorded: pass it per stage then)
            report.source_log_cpb_windows = [w if w != (0, 0) else tuple(built.window_size) for w in fixed]
            report.source_log_cpb_fixed = any(w != (0, 0) for w in fixed)
        return
    w = window_from_hub_config(hub_config)
    report.source_window = (w, w) if w else None
    log_cpb = log_cpb_windows_from_hub_config(hub_config)
    if log_cpb is not None:
        report.source_log_cpb_windows, report.source_log_cpb_fixed = log_cpb


def _log_cpb_target(report: LoadReport, window: tuple[int, int]) -> list[tuple[int, int]] | None:
    """The ``pretrained_window_size`` (per stage) a Swin V2 of nominal ``window`` needs for the
    checkpoint's Log-CPB coordinates to keep their meaning; ``None`` where 0 (the window in use)
    already does: the checkpoint's windows followed the window in use and ``window`` is its own."""
    windows = report.source_log_cpb_windows
    if windows is None or (not report.source_log_cpb_fixed and tuple(window) == tuple(report.source_window or ())):
        return None
    return list(windows)


def _windows_text(windows: list[tuple[int, int]]) -> str:
    """``8`` / ``(8, 12)`` when every stage has the same window, else ``(12, 12, 12, 6)`` or one
    ``(h, w)`` per stage: as ``pretrained_window_size`` takes them."""
    if len(set(windows)) == 1:
        h, w = windows[0]
        return str(h) if h == w else f"({h}, {w})"
    if all(h == w for h, w in windows):
        return "(" + ", ".join(str(h) for h, _ in windows) + ")"
    return "(" + ", ".join(f"({h}, {w})" for h, w in windows) + ")"


def _windows_option(windows: list[tuple[int, int]]) -> list:
    """``windows`` as a JSON-able ``pretrained_window_size``: ``[h, w]`` when every stage has the
    same, else ``[[h, w], ...]`` per stage."""
    if len(set(windows)) == 1:
        return list(windows[0])
    return [list(w) for w in windows]


def _fit_log_cpb(name: str, options: dict, report: LoadReport) -> dict:
    """``options`` with Swin V2's ``pretrained_window_size`` set from the checkpoint where the
    caller gave none and 0 would change what the checkpoint's Log-CPB coordinates mean (a larger
    window, or a checkpoint that fixed its own, like timm's ``window12to16`` models)."""
    if report.source_log_cpb_windows is None or options.get("pretrained_window_size"):
        return options
    from vtdense.backbones.registry import create_backbone

    with torch.device("meta"):
        probe = create_backbone(name, **options)
    if getattr(probe, "version", None) != 2:
        return options
    target = _log_cpb_target(report, probe.window_size)
    if target is None:
        return options
    stages = len(probe.depths)  # one entry per stage, built or not (a stage the checkpoint lacks takes the last)
    target = (target + target[-1:] * stages)[:stages]
    report.notes.append(f"pretrained_window_size={_windows_text(target)} set from the checkpoint (pass pretrained_window_size to choose another)")
    return {**options, "pretrained_window_size": _windows_option(target)}


def _window_notes(report: LoadReport, model: nn.Module) -> None:
    """Advice on Swin V2's ``pretrained_window_size`` when the checkpoint's windows are known."""
    from vtdense.backbones.swin import SwinTransformer

    if not isinstance(model, SwinTransformer) or model.version != 2 or report.source_log_cpb_windows is None:
        return
    used = [stage.blocks[0].attn.pretrained_window_size for stage in model.layers]
    source = list(report.source_log_cpb_windows)[: len(used)]
    target = _log_cpb_target(report, model.window_size)
    if target is None:
        fits = all(u == (0, 0) or u == s for u, s in zip(used, source))
    else:
        fits = all(u == t for u, t in zip(used, target))
    run = f"{model.window_size[0]}x{model.window_size[1]}"
    src = report.source_window
    trained = f"window {src[0]}x{src[1]}" if src else "its window"
    if fits:
        if src is not None and tuple(src) != tuple(model.window_size):
            report.notes.append(
                f"Swin V2 trained at {trained}, run at {run}: Log-CPB coordinates are normalised by "
                f"pretrained_window_size={_windows_text(source)}, so every offset keeps its meaning (no table to resize; "
                "the MLP extrapolates to the new, larger offsets)"
            )
        return
    if target is not None and not report.source_log_cpb_fixed and all(
        u != (0, 0) and u[0] <= t[0] and u[1] <= t[1] for u, t in zip(used, target)
    ):
        # smaller than the checkpoint's window: right where its training maps shrank the window
        stages = ", ".join(str(i + 1) for i, (u, t) in enumerate(zip(used, target)) if u != t)
        report.notes.append(
            f"Swin V2 trained at {trained}, run at {run} with pretrained_window_size={_windows_text(used)}, smaller "
            f"than the training window at stage(s) {stages}: this keeps the Log-CPB coordinates' meaning if the "
            "training images shrank those stages' windows (window 8 on 128 px shrinks the last one's to 4: "
            f"vtdense.backbones.swin.log_cpb_windows); otherwise pass pretrained_window_size={_windows_text(target)}"
        )
        return
    shown = "0 (the window in use)" if all(u == (0, 0) for u in used) else _windows_text(used)
    report.notes.append(
        f"Swin V2 trained at {trained} with its Log-CPB coordinates normalised by {_windows_text(source)}, but this model "
        f"runs window {run} with pretrained_window_size={shown}: the coordinates will not mean the offsets they meant in "
        f"training; pass pretrained_window_size={_windows_text(target or source)}"
    )


def _source_windows_from_buffers(report: LoadReport, obj: object) -> None:
    """Swin V2 windows from the checkpoint's own Log-CPB buffers (official and torchvision files
    persist them), where neither a vtdense config nor a Hub name gave them."""
    if report.source_log_cpb_windows is not None:
        return
    from vtdense.checkpoints.log_cpb import log_cpb_windows_from_buffers

    try:
        raw = _unwrap(obj, report.source)
    except CheckpointError:
        return  # the load itself says why
    found = log_cpb_windows_from_buffers(raw)
    if found is None:
        return
    in_use, normalising = found
    report.source_log_cpb_windows = normalising
    report.source_log_cpb_fixed = normalising != in_use
    if report.source_window is None:
        report.source_window = (max(h for h, _ in in_use), max(w for _, w in in_use))


def _resolve_source(spec: str | os.PathLike) -> HubCheckpoint:
    """The :class:`~vtdense.checkpoints.hub.HubCheckpoint` a path or Hub id names; not found is a
    :class:`CheckpointError` with the resolver's message."""
    from vtdense.checkpoints.hub import HubError, resolve_checkpoint

    try:
        return resolve_checkpoint(spec)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    except HubError as e:
        raise CheckpointError(str(e)) from e


def check_checkpoint_source(spec: str | os.PathLike) -> Path:
    """Find the file a path or Hub id names, and check that it is whole, without reading its
    tensors: what a run checks before it starts, so that a misspelt or cut-short
    ``backbone_weights`` is one error at start-up instead of a traceback once training begins. A
    Hub id is fetched into the Hub cache here (the later load reads it from there).

    Returns:
        The local file.

    Raises:
        CheckpointError: the file or Hub id is not found, or the file is cut short (names it).
    """
    path = _resolve_source(spec).path
    damage = cut_short(path)
    if damage is not None:
        raise CheckpointError(f"cannot read checkpoint {path}: {damage}")
    return path


def _read_source(state_dict_or_path: object, report: LoadReport) -> object:
    """Resolve a path / Hub id and read it; fills the report's source fields."""
    if not isinstance(state_dict_or_path, (str, os.PathLike)):
        _source_windows_from_buffers(report, state_dict_or_path)
        return state_dict_or_path
    where = _resolve_source(state_dict_or_path)
    file = read_checkpoint(where.path)  # (checks that the file is whole)
    report.container = file.container
    report.source_config = file.vtdense_config or where.config
    _source_windows(report, file.vtdense_config, where.config)
    _source_windows_from_buffers(report, file.obj)
    return file.obj


def load_pretrained(
    model: nn.Module,
    state_dict_or_path: str | os.PathLike | Mapping[str, Tensor],
    *,
    strict: bool = True,
    log: bool = True,
) -> LoadReport:
    """Load a checkpoint of any supported format into a vtdense backbone.

    Args:
        model: a vtdense backbone.
        state_dict_or_path: a state dict (or a checkpoint dict wrapping one); a local file
            (safetensors, torch ``.pth``/``.pt``/``.ckpt``/``.bin``, detectron2 ``.pkl``; the
            container is recognised from the content); or a Hugging Face Hub id such as
            ``"timm/swin_tiny_patch4_window7_224.ms_in1k"`` (``hf-hub:`` prefix optional), fetched
            through ``huggingface_hub`` (its cache, ``HF_HUB_OFFLINE`` and token apply).
        strict: raise :class:`CheckpointError` listing missing and unexpected keys when the
            checkpoint does not fit (output norms absent from classification checkpoints are
            tolerated and keep their initialisation). A model built with ``in_chans`` other than
            3 takes an RGB checkpoint's patch embedding ``(C, 3, p, p)`` adapted as timm does it,
            into ``(C, in_chans, p, p)``: summed over RGB for 1 channel, else RGB repeated
            cyclically and scaled by ``3 / in_chans`` (listed under ``resized``).
        log: log :meth:`LoadReport.summary` on the ``vtdense.checkpoints`` logger (INFO).

    Returns:
        A :class:`LoadReport`: the ``(missing, unexpected)`` key lists (empty under ``strict``
        unless tolerated) with what was mapped, resized and dropped as attributes.

    Raises:
        CheckpointError: file or Hub id not found, unreadable or unsafe file, or (``strict``) a
            checkpoint that does not fit; the message names the file or id.
    """
    source = str(state_dict_or_path) if isinstance(state_dict_or_path, (str, os.PathLike)) else "state dict"
    report = LoadReport(source)
    obj = _read_source(state_dict_or_path, report)
    return _load_read(model, obj, report, strict=strict, log=log)


def _load_read(model: nn.Module, obj: object, report: LoadReport, *, strict: bool = True, log: bool = True) -> LoadReport:
    """:func:`load_pretrained` of a checkpoint already read into ``obj`` (its source fields in ``report``)."""
    source = report.source
    report.model_name = type(model).__name__
    raw = _unwrap(obj, source)
    report.format = "vtdense" if report.source_config and "name" in report.source_config else detect_format(raw, model)
    origin: dict[int, list[str]] = {}  # a tensor may be stored under several keys
    for key, value in raw.items():
        origin.setdefault(id(value), []).append(key)
    own = model.state_dict()
    with report:
        sd = _CONVERTERS[_family(model)](raw, model)
        _adapt_input_channels(sd, own)
    shape_errors = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in sd.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    tolerated = [k for k in missing if k.startswith("out_norms.")]
    hard_missing = [k for k in missing if k not in tolerated]
    if strict and (hard_missing or unexpected or shape_errors):
        lines = [f"checkpoint {source} does not fit {type(model).__name__}:"]
        if hard_missing:
            lines.append(f"  missing keys ({len(hard_missing)}): {', '.join(hard_missing[:20])}{' ...' if len(hard_missing) > 20 else ''}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}{' ...' if len(unexpected) > 20 else ''}")
        if shape_errors:
            lines.append(f"  shape mismatches ({len(shape_errors)}): {'; '.join(shape_errors[:10])}")
        hint = _family_hint(raw, own)
        if hint:
            lines.append(f"  {hint}")
        raise CheckpointError("\n".join(lines))
    fitting = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fitting, strict=False)

    used = set()
    aliases: dict[str, str] = {}  # another key of a loaded tensor -> the key it was loaded under
    for k, v in fitting.items():
        src = _source_key(origin.get(id(v)), k)
        if src is not None:  # loaded as it is (resized and derived tensors are listed apart)
            report.loaded.append((src, k))
            used.add(src)
            aliases.update((other, src) for other in origin[id(v)] if other != src)
    stripped = any(k.startswith(("backbone.", "model.", "encoder.")) for k in raw)
    whole_model = any(k.startswith(_TASK_PREFIXES) for k in raw)
    misfit = {_source_key(origin.get(id(v)), k) for k, v in sd.items() if k in own and own[k].shape != v.shape}  # strict=False
    report.dropped.extend(
        (k, "shape does not fit the model's tensor" if k in misfit
         else f"the same tensor as {aliases[k]}, loaded" if k in aliases
         else _drop_reason(k, stripped, whole_model))
        for k, v in raw.items()
        if k not in used and id(v) not in report.consumed
    )
    report.missing.extend(missing)
    report.unexpected.extend(unexpected)
    _window_notes(report, model)
    if log:
        _logger.info("%s", report.summary())
    return report


_INPUT_CONV = "patch_embed.proj.weight"  # every family's first layer


def _adapt_input_channels(sd: dict[str, Tensor], own: Mapping[str, Tensor]) -> None:
    """An RGB checkpoint loaded into a backbone built with another ``in_chans``: its patch
    embedding adapted in place of ``sd`` as timm's ``adapt_input_conv`` does (summed for 1 channel,
    else repeated cyclically and scaled by ``3 / in_chans``); any other misfit is left to the caller."""
    weight, target = sd.get(_INPUT_CONV), own.get(_INPUT_CONV)
    if weight is None or target is None or weight.shape == target.shape:
        return
    in_chans = target.shape[1]
    try:
        adapted = adapt_input_conv(_INPUT_CONV, weight, target.shape, in_chans)
    except ValueError:
        return  # no RGB form of this model's conv: the strict check names the mismatch
    sd[_INPUT_CONV] = adapted
    how = "summed over RGB" if in_chans == 1 else f"RGB repeated cyclically, scaled by 3/{in_chans}"
    note_resized(_INPUT_CONV, weight, adapted, f"in_chans={in_chans} from an RGB checkpoint: {how}")


# keys only one family has: (family, what to build, key pattern)
_FAMILY_KEYS = (
    ("a Swin V2", "a swinv2_* backbone", re.compile(r"(cpb_mlp|logit_scale)")),
    ("a Swin V1", "a swin_* backbone (Swin V1)", re.compile(r"relative_position_bias_table")),
    ("an MViTv2", "an mvitv2_* backbone", re.compile(r"(rel_pos_h|pool_q|pool_k)")),
)


def _family_hint(raw: Mapping[str, Tensor], own: Mapping[str, Tensor]) -> str | None:
    """One line naming the family a checkpoint that does not fit was made for, where its keys say
    so and the model is of another (a Swin V1 file loaded into a Swin V2 backbone)."""
    def families(keys: object) -> list[tuple[str, str]]:
        return [(name, build) for name, build, pattern in _FAMILY_KEYS if any(pattern.search(k) for k in keys)]

    theirs, ours = families(raw), families(own)
    if len(theirs) != 1 or theirs == ours:
        return None
    name, build = theirs[0]
    return f"the checkpoint's keys are those of {name} model: load it into {build}"


def _source_key(keys: list[str] | None, target: str) -> str | None:
    """Which of the checkpoint keys holding one tensor (``keys``) it was loaded from into model key
    ``target``: the one naming ``target`` (itself, or with a prefix), else the first."""
    if not keys:
        return None
    for key in keys:
        if key == target or key.endswith("." + target):
            return key
    return keys[0]


def save_backbone(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save a backbone made by ``create_backbone`` as safetensors, its config in the metadata.

    :func:`load_backbone` rebuilds it without knowing the options; any safetensors reader gets
    the weights (the config is the JSON string under the ``vtdense_backbone`` metadata key).
    The file is written whatever its suffix (``.safetensors`` is the natural one).

    Raises:
        ValueError: a model not made by ``create_backbone``, or a config that is not JSON.
    """
    import json

    from vtdense import __version__

    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} was not made by vtdense.create_backbone; save its state_dict instead")
    try:
        text = json.dumps(dict(config))
    except TypeError as e:
        raise ValueError(f"backbone config {config!r} cannot be stored as JSON: {e}") from e
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, model.state_dict(), {SAFETENSORS_CONFIG_KEY: text, "format": "pt", "vtdense_version": __version__})
    return path


def load_backbone(path: str | os.PathLike, **overrides: object) -> nn.Module:
    """Rebuild a backbone written by :func:`save_backbone` (safetensors, or the ``.pth`` files
    of vtdense < 0.1); ``path`` may also be a Hub id.

    ``overrides`` change its options, e.g. a larger ``window_size`` for fine-tuning: Swin V1
    bias tables are resized, MViTv2 tables resampled, and a Swin V2 run at another window
    gets the ``pretrained_window_size`` its Log-CPB coordinates were normalised by (the saved
    one, else the saved window) unless the overrides set it, so they keep their meaning. A
    Swin V2 whose training images were small enough to shrink a stage's window (window 8 on
    128 px shrinks the last stage's to 4) was normalised by the shrunk window there, which the
    file does not record: pass ``pretrained_window_size`` per stage then
    (:func:`vtdense.backbones.swin.log_cpb_windows` computes it). The returned model's
    ``load_report`` attribute is the :class:`LoadReport`.
    """
    from vtdense.backbones.registry import create_backbone

    report = LoadReport(str(path))
    obj = _read_source(path, report)
    if not report.source_config or "name" not in report.source_config:
        raise CheckpointError(f"{path} was not written by vtdense.save_backbone; use load_pretrained on a created backbone")
    config = dict(report.source_config)
    name = config.pop("name")
    options = {**config, **overrides}
    if "pretrained_window_size" not in overrides:
        options = _fit_log_cpb(name, options, report)
    model = create_backbone(name, **options)
    state = obj["state_dict"] if isinstance(obj, dict) and "state_dict" in obj else obj
    loaded = _load_read(model, state, report, log=False)
    loaded.format = "vtdense"
    _logger.info("%s", loaded.summary())
    model.load_report = loaded
    return model


def build_pretrained(name: str, pretrained: object, build: Callable[..., nn.Module], overrides: dict) -> nn.Module:
    """``build(**options)`` loaded from ``pretrained`` (what :func:`vtdense.create_backbone` does
    with weights). The checkpoint is read first, so that a Swin V2 built without
    ``pretrained_window_size`` gets the one its Log-CPB coordinates were normalised by where 0
    would change their meaning (a file or Hub checkpoint of another window, or timm's
    ``window12to16`` models, which fix ``(12, 12, 12, 6)``); the report says so."""
    source = str(pretrained) if isinstance(pretrained, (str, os.PathLike)) else "state dict"
    report = LoadReport(source)
    obj = _read_source(pretrained, report)
    options = overrides if "pretrained_window_size" in overrides else _fit_log_cpb(name, overrides, report)
    model = build(**options)
    model.config = {"name": name, **options}  # what save_backbone needs to rebuild it
    model.load_report = _load_read(model, obj, report)
    return model
