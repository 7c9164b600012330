"""Distributed strategies tuned for vtdense models.

``--trainer.strategy fsdp`` in a vtdense recipe builds :func:`fsdp_strategy`: fully sharded data
parallel training through PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), run by
Lightning's own :class:`~lightning.pytorch.strategies.ModelParallelStrategy` (launcher, process
group, device mesh, sharded state-dict gathering, checkpointing). vtdense only decides *what* is
sharded: every transformer block (Swin, Swin V2, MViTv2) is its own FSDP unit, the rest of the
model (stems, necks, heads) is the root unit, and by default each block's activations are
recomputed in the backward pass.

FSDP2 keeps parameter names and plain ``nn.Module`` types, so the tasks' per-parameter optimiser
groups, layer-wise decay and checkpoints work unchanged, and it runs on the CPU with gloo as well
as on GPUs with NCCL (the test suite trains with it on 2 CPU processes). Checkpoints are gathered
into one ordinary ``.ckpt`` file on rank 0 (``save_distributed_checkpoint=False``), which loads in
one process, under DDP or under FSDP again.

Precision: ``32-true`` and ``bf16-mixed`` use Lightning's own plugins (autocast over the gathered
float32 parameters, so the numbers match DDP). ``16-mixed``, which Lightning's model-parallel
strategy does not offer, is built by :func:`fsdp_precision_plugin` as Lightning's
:class:`~lightning.pytorch.plugins.precision.MixedPrecision` with torch's ``ShardedGradScaler``:
the overflow check is reduced over all ranks, so every rank skips the same steps.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from vtdense.backbones.mvitv2 import MultiScaleBlock
from vtdense.backbones.swin import SwinBlock

__all__ = ["TRANSFORMER_BLOCKS", "VtdenseFSDPStrategy", "fsdp_strategy", "fsdp_precision_plugin", "shard_blocks", "trainer_options"]

#: The block classes FSDP shards as units and activation checkpointing recomputes.
TRANSFORMER_BLOCKS: tuple[type[nn.Module], ...] = (SwinBlock, MultiScaleBlock)


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_blocks(
    module: nn.Module, mesh: Any = None, *, units: list[nn.Module] | None = None, activation_checkpointing: bool = True,
    reshard_after_forward: bool = True,
) -> list[nn.Module]:
    """Apply FSDP2 to ``module``: one unit per transformer block, then one per entry module.

    Args:
        module: the model (or LightningModule) holding vtdense backbones.
        mesh: the 1-D data-parallel device mesh (``None``: the default process group).
        units: the modules whose ``forward`` the caller runs (each becomes an FSDP unit that owns
            the parameters outside the blocks); ``None``: ``[module]``. A task whose step calls
            several parts of its network (encoder, decoder, head) names each of them.
        activation_checkpointing: recompute every block in the backward pass (through the
            backbones' own ``grad_checkpointing`` of their stages, so parameter names stay).
        reshard_after_forward: free the gathered block weights after the forward (ZeRO-3); ``False``
            keeps them until the backward (ZeRO-2-like, more memory, fewer all-gathers).

    Returns:
        The transformer blocks made FSDP units (empty if ``module`` was already sharded: the call
        is idempotent).
    """
    from torch.distributed.fsdp import fully_shard

    units = [module] if units is None else [u for u in units if u is not None]
    if any(_is_sharded(m) for m in module.modules()):
        return []
    blocks = [m for m in module.modules() if isinstance(m, TRANSFORMER_BLOCKS)]
    if activation_checkpointing:
        for m in module.modules():  # the Swin and MViTv2 stages: they run their blocks under checkpoint
            if hasattr(m, "grad_checkpointing") and isinstance(getattr(m, "blocks", None), nn.Module):
                m.grad_checkpointing = True
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return blocks


class VtdenseFSDPStrategy(ModelParallelStrategy):
    """Lightning's model-parallel strategy as pure FSDP2 data parallelism over all processes.

    Every process holds a shard of every block; the data-parallel mesh spans all nodes and
    devices (no tensor parallelism). The LightningModule is sharded in its ``configure_model``
    hook (the vtdense tasks call :meth:`shard`), as Lightning's model-parallel strategy requires.

    Args:
        activation_checkpointing: recompute each transformer block in the backward pass.
        reshard_after_forward: see :func:`shard_blocks`.
        save_distributed_checkpoint: ``False`` (default) gathers one full ``.ckpt`` on rank 0;
            ``True`` writes Lightning's sharded checkpoint folder (one file per rank).
        kwargs: any other :class:`~lightning.pytorch.strategies.ModelParallelStrategy` argument
            (``process_group_backend``, ``timeout``).
    """

    def __init__(
        self, activation_checkpointing: bool = True, reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = False, **kwargs: Any,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # Pure data parallelism: one FSDP group over every process of every node.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def shard(self, module: nn.Module, units: list[nn.Module] | None = None) -> list[nn.Module]:
        """Shard ``module`` over the data-parallel mesh (idempotent); see :func:`shard_blocks`."""
        return shard_blocks(module, self.device_mesh["data_parallel"], units=units,
                            activation_checkpointing=self.activation_checkpointing,
                            reshard_after_forward=self.reshard_after_forward)

    def _sync_norm_buffers(self) -> None:
        """Give every rank rank 0's batch-norm statistics, as DDP's buffer broadcast does.

        FSDP shards parameters only; without this, each rank's BatchNorm running statistics (in
        the UPerNet/FPN decoders) drift apart, evaluation differs by rank, and the checkpoint holds
        rank 0's. A collective: every rank calls it at the start of every training step and of
        every validation / test run.
        """
        if self.world_size < 2 or self.model is None:
            return
        for m in self.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                for buf in (m.running_mean, m.running_var, m.num_batches_tracked):
                    if buf is not None:
                        torch.distributed.broadcast(buf, src=0)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_norm_buffers()
        return super().training_step(*args, **kwargs)

    def on_validation_start(self) -> None:
        # statistics do not change in evaluation: once, before its first step, is enough
        super().on_validation_start()
        self._sync_norm_buffers()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._sync_norm_buffers()

    def setup(self, trainer: pl.Trainer) -> None:
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.precision == "16-mixed":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            if not isinstance(self.precision_plugin.scaler, ShardedGradScaler):
                raise ValueError("FSDP with precision '16-mixed' needs the ShardedGradScaler of vtdense.strategies."
                                 "fsdp_precision_plugin (ranks must agree on skipped steps)")
        super().setup(trainer)


def fsdp_precision_plugin(precision: str, accelerator: str) -> MixedPrecision | None:
    """The precision plugin FSDP needs for ``precision``, or ``None`` where Lightning's own flag works.

    ``16-mixed`` gets fp16 autocast with torch's ``ShardedGradScaler``, whose overflow check is
    all-reduced so that every rank skips the same step. Built for the accelerator in use, the CPU
    included (where Lightning's own flag would quietly switch to bf16).
    """
    if str(precision) not in ("16-mixed", "16"):
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    device = "cpu" if accelerator == "cpu" else "cuda"
    return MixedPrecision("16-mixed", device, scaler=ShardedGradScaler(device=device))


def fsdp_strategy(activation_checkpointing: bool = True, **kwargs: Any) -> VtdenseFSDPStrategy:
    """FSDP2 with one unit per transformer block (see :class:`VtdenseFSDPStrategy`).

    Args:
        activation_checkpointing: recompute each block's activations in the backward pass.
        kwargs: any other :class:`VtdenseFSDPStrategy` argument.
    """
    return VtdenseFSDPStrategy(activation_checkpointing=activation_checkpointing, **kwargs)


def trainer_options(config: dict[str, Any]) -> dict[str, Any]:
    """Trainer keyword arguments with ``strategy="fsdp"`` turned into vtdense's FSDP.

    ``precision="16-mixed"`` becomes :func:`fsdp_precision_plugin` in ``plugins``; other
    strategies and precisions pass through untouched.
    """
    if config.get("strategy") != "fsdp":
        return config
    config = {**config, "strategy": fsdp_strategy()}
    acc = config.get("accelerator") or "auto"
    accelerator = ("cpu" if acc == "cpu" else "cuda") if isinstance(acc, str) and acc != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    plugin = fsdp_precision_plugin(str(config.get("precision")), accelerator)
    if plugin is not None:
        plugins = config.get("plugins") or []
        config["plugins"] = [*(plugins if isinstance(plugins, list) else [plugins]), plugin]
        config["precision"] = None
    return config
