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

Wrappers (``model``, ``state_dict``, ``model_state``, ``module.``) are stripped first. Tables that
depend on the window (V1 bias tables) are resized when the target window differs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

__all__ = [
    "CheckpointError",
    "convert_state_dict",
    "load_backbone",
    "load_pretrained",
    "register_converter",
    "save_backbone",
]

# Buffers some formats persist that vtdense derives itself, and classification-only weights.
_DROP = re.compile(
    r"(relative_position_index|relative_coords_table|attn_mask|\.k_bias$|^head\.|^fc\.|^norm\.|^fc_norm\.|^head_drop|^cls_token$)"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


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
    from vtdense.layers.position import resize_bias_table

    sd = _strip_prefix(sd, ("backbone.bottom_up.", "backbone.", "encoder.model.", "encoder."))
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
    out = {}
    for k, v in sd.items():
        if _DROP.search(k):
            continue
        if k.endswith("attn.qkv.bias") and k not in own and k.replace("qkv.bias", "q_bias") in own:
            # one q/k/v bias (torchvision V2, whose k third is zeroed at run time) -> q_bias, v_bias
            q, _, vb = v.chunk(3)
            out[k.replace("qkv.bias", "q_bias")], out[k.replace("qkv.bias", "v_bias")] = q, vb
            continue
        if k.endswith("relative_position_bias_table") and k in own and own[k].shape != v.shape:
            new = model.window_size
            old_side = int(round(v.shape[0] ** 0.5))
            old = ((old_side + 1) // 2, (old_side + 1) // 2)
            v = resize_bias_table(v, old, new)
        out[k] = v
    return out


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
                v = _unfold_to_concat(v)
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

    sd = _strip_prefix(sd, ("backbone.bottom_up.", "backbone.", "model."))
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
            v = resize_rel_pos_table(v, own[k].shape[0])  # checkpoint made for another img_size
        out[k] = v
    return out


def convert_state_dict(state_dict: object, model: nn.Module, source: str = "state dict") -> dict[str, Tensor]:
    """Translate a foreign (or vtdense) state dict into ``model``'s key space."""
    sd = _unwrap(state_dict, source)
    return _CONVERTERS[_family(model)](sd, model)


def load_pretrained(
    model: nn.Module, state_dict_or_path: str | os.PathLike | Mapping[str, Tensor], *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load a checkpoint of any supported format into a vtdense backbone.

    Args:
        model: a vtdense backbone.
        state_dict_or_path: a state dict, a checkpoint dict wrapping one, or a ``.pth``/``.pt``/
            ``.ckpt``/``.safetensors`` file.
        strict: raise :class:`CheckpointError` listing missing and unexpected keys when the
            checkpoint does not fit (output norms absent from classification checkpoints are
            tolerated and keep their initialisation).

    Returns:
        ``(missing, unexpected)`` key lists (empty under ``strict`` unless tolerated).
    """
    source = "state dict"
    obj: object = state_dict_or_path
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        path = Path(state_dict_or_path)
        source = str(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint file not found: {path}")
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                obj = load_file(str(path))
            else:
                obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the file name
            raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    sd = convert_state_dict(obj, model, source)
    own = model.state_dict()
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
        raise CheckpointError("\n".join(lines))
    fitting = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fitting, strict=False)
    return missing, unexpected


def save_backbone(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save a backbone made by ``create_backbone`` with its config, so :func:`load_backbone`
    rebuilds it without knowing the options (the file is a plain ``torch.save`` dict)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} was not made by vtdense.create_backbone; save its state_dict instead")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"vtdense_backbone": dict(config), "state_dict": model.state_dict()}, tmp)
    tmp.replace(path)  # never leave a half-written file where a good one was
    return path


def load_backbone(path: str | os.PathLike, **overrides: object) -> nn.Module:
    """Rebuild a backbone written by :func:`save_backbone` (``overrides`` change its options,
    e.g. a larger ``window_size`` for fine-tuning; tables are resized as needed)."""
    from vtdense.backbones.registry import create_backbone

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file name
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(obj, dict) or "vtdense_backbone" not in obj:
        raise CheckpointError(f"{path} was not written by vtdense.save_backbone; use load_pretrained on a created backbone")
    config = dict(obj["vtdense_backbone"])
    name = config.pop("name")
    model = create_backbone(name, **{**config, **overrides})
    load_pretrained(model, obj["state_dict"])
    return model
