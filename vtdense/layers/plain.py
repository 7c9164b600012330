"""Which modules a fused or chunked path may bypass.

The backbones' fast paths read a layer's parameters instead of calling it (LayerNorm fused with
the next projection, GELU fused with ``fc2``, the MViTv2 pooling conv over all heads at once), or
call a block's layers once per chunk of rows (CPU inference). Either is only the same computation
when the layer is exactly the stock PyTorch module and nothing observes its calls. A subclass or a
wrapper (LoRA adapters, a float32 LayerNorm, a tanh GELU, quantised layers), or a forward hook
(feature extraction, activation statistics, pruning masks), must see one call with the whole
tensor, as in timm; these predicates tell the fast paths when to step aside.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["plain_module", "plain_linear", "plain_layer_norm", "plain_gelu", "hooks_below"]


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def plain_module(module: nn.Module, cls: type[nn.Module]) -> bool:
    """Whether ``module`` is exactly a ``cls`` (not a subclass or a wrapper) with no forward hooks
    or pre-hooks of its own, so a fast path may use its parameters instead of calling it."""
    return type(module) is cls and not _hooked(module)


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is exactly an ``nn.Linear`` with no forward hooks (see
    :func:`plain_module`): a fused path may then read its ``weight`` and ``bias``."""
    return plain_module(module, nn.Linear)


def plain_layer_norm(module: nn.Module) -> bool:
    """Whether ``module`` is exactly an ``nn.LayerNorm`` over the last dimension, with no forward
    hooks: a fused path may then apply ``F.layer_norm`` with its parameters."""
    return plain_module(module, nn.LayerNorm) and len(module.normalized_shape) == 1  # type: ignore[arg-type]


def plain_gelu(module: nn.Module) -> bool:
    """Whether ``module`` is exactly an exact-erf ``nn.GELU`` with no forward hooks: a fused path
    may then apply the GELU itself."""
    return plain_module(module, nn.GELU) and module.approximate == "none"  # type: ignore[attr-defined]


def hooks_below(module: nn.Module) -> bool:
    """Whether anything would observe the calls of ``module``'s submodules: a forward hook or
    pre-hook on one of them (``module``'s own hooks excluded: it is still called once), or a
    global module hook. A path that calls the submodules once per chunk must then not run."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any(_hooked(m) for m in module.modules() if m is not module)
