"""Distributed strategies tuned for vtdense models.

``--trainer.strategy fsdp`` in a vtdense recipe builds :func:`fsdp_strategy`: Lightning's own
:class:`~lightning.pytorch.strategies.FSDPStrategy` with every transformer block (Swin, Swin V2,
MViTv2) as its own FSDP unit and, by default, activation checkpointing of those blocks through
the strategy. Everything else (the FSDP implementation, the launcher, precision plugins,
checkpoint gathering) is Lightning's.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from vtdense.backbones.mvitv2 import MultiScaleBlock
from vtdense.backbones.swin import SwinBlock

__all__ = ["TRANSFORMER_BLOCKS", "VtdenseFSDPStrategy", "fsdp_strategy"]

#: The block classes FSDP wraps as units and activation checkpointing recomputes.
TRANSFORMER_BLOCKS: frozenset[type[nn.Module]] = frozenset({SwinBlock, MultiScaleBlock})


class VtdenseFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP with vtdense's block-level wrapping (a subclass only so it can be named).

    Note: Lightning rejects ``FSDPStrategy`` with ``accelerator="cpu"`` up front; this subclass
    reaches torch's own check instead, which also needs an accelerator (FSDP does not shard on
    the CPU).
    """


def fsdp_strategy(activation_checkpointing: bool = True, **kwargs: Any) -> VtdenseFSDPStrategy:
    """FSDP with one unit per transformer block.

    Args:
        activation_checkpointing: recompute each block's activations in the backward pass
            (through the strategy, ``activation_checkpointing_policy``).
        kwargs: any other :class:`~lightning.pytorch.strategies.FSDPStrategy` argument
            (``sharding_strategy``, ``cpu_offload``, ``state_dict_type``, ...); they win over the defaults.

    Returns:
        The strategy, with ``use_orig_params=True`` so the tasks' per-parameter optimiser groups
        (no weight decay on norms, biases and position tables) keep working on sharded parameters.
    """
    options: dict[str, Any] = {"auto_wrap_policy": set(TRANSFORMER_BLOCKS), "use_orig_params": True}
    if activation_checkpointing:
        options["activation_checkpointing_policy"] = set(TRANSFORMER_BLOCKS)
    options.update(kwargs)
    return VtdenseFSDPStrategy(**options)
