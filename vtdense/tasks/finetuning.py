"""Lightning's backbone fine-tuning callbacks (``BackboneFinetuning``, ``BaseFinetuning``) with the tasks.

Those callbacks freeze ``pl_module.backbone`` in their ``setup`` and, at a later epoch, set its
parameters' ``requires_grad`` again and add them to the optimizer as a new group. The tasks give
them :attr:`~vtdense.tasks.base.BaseTask.backbone` (the vtdense backbone inside the network) and
make two of Lightning's own gaps good:

- **Several processes.** ``DistributedDataParallel`` all-reduces the gradients of the parameters
  that needed a gradient when it wrapped the model, and no other. A backbone unfrozen later then
  trains on each process's own batches alone and the copies drift apart (Lightning issue
  #20340). :func:`sync_unwrapped_grads` averages the gradients of every parameter that trains now
  but was frozen when DDP wrapped the model, after each backward, on every process.
- **Resuming.** A resumed run freezes the backbone again in the callback's ``setup`` and restores
  the optimizer's groups, backbone group included, but only the unfreezing epoch itself sets
  ``requires_grad``: past it the backbone stayed frozen for the rest of the run.
  :func:`train_optimized_params` sets it again for every parameter an optimizer holds.

Sharded training (FSDP) fixes which parameters train when it shards them, so the callbacks are
refused there (:func:`check_finetuning_callbacks`), before the run starts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from vtdense.backbones.base import Backbone

__all__ = ["check_finetuning_callbacks", "trainable_param_ids", "sync_unwrapped_grads", "train_optimized_params",
           "frozen_backbone_param_ids"]


def _finetuning_callbacks(trainer: object) -> list[BaseFinetuning]:
    return [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, BaseFinetuning)]


def check_finetuning_callbacks(trainer: object) -> None:
    """Refuse a ``BaseFinetuning`` callback under a strategy that is not DDP or a single process.

    Raises:
        ValueError: naming the callback and the strategy.
    """
    callbacks = _finetuning_callbacks(trainer)
    strategy = getattr(trainer, "strategy", None)
    if not callbacks or strategy is None or isinstance(strategy, DDPStrategy) or getattr(trainer, "world_size", 1) == 1:
        return
    names = ", ".join(type(cb).__name__ for cb in callbacks)
    raise ValueError(
        f"{names} changes which parameters train during the run, which {type(strategy).__name__} cannot follow: "
        "it fixes them when it shards the model. Train with --trainer.strategy ddp, or freeze with "
        "--model.backbone_kwargs '{frozen_stages: K}' and lower the backbone's rate with --model.backbone_lr_mult"
    )


def trainable_param_ids(module: nn.Module) -> frozenset[int]:
    """Ids of ``module``'s parameters that need a gradient now (what DDP will all-reduce)."""
    return frozenset(id(p) for p in module.parameters() if p.requires_grad)


def sync_unwrapped_grads(module: nn.Module, wrapped: frozenset[int] | None, trainer: object) -> int:
    """Average over the processes the gradients of ``module``'s parameters that need one now but
    were not in ``wrapped`` (the parameters DDP all-reduces). A collective: every process calls it
    after each backward, with the same parameters (a missing gradient counts as zeros). Returns how
    many parameters it averaged (0, and no collective, with one process or outside DDP)."""
    if wrapped is None or not isinstance(getattr(trainer, "strategy", None), DDPStrategy):
        return 0
    world = int(getattr(trainer, "world_size", 1))
    if world < 2 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0
    extra = [p for p in module.parameters() if p.requires_grad and id(p) not in wrapped]
    if not extra:
        return 0
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in extra:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
    return len(extra)


def frozen_backbone_param_ids(module: nn.Module) -> frozenset[int]:
    """Ids of the parameters the vtdense backbones in ``module`` keep frozen (``frozen_stages``)."""
    return frozenset(id(p) for b in module.modules() if isinstance(b, Backbone)
                     for m in b.frozen_modules() for p in m.parameters())


def train_optimized_params(optimizers: Iterable[torch.optim.Optimizer], keep_frozen: frozenset[int]) -> int:
    """Set ``requires_grad`` on every parameter the ``optimizers`` hold but ``keep_frozen``;
    returns how many it set."""
    n = 0
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad and id(p) not in keep_frozen:
                    p.requires_grad_(True)
                    n += 1
    return n
