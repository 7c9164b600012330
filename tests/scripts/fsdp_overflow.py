"""fp16 under FSDP2 with the sharded grad scaler, on 2 CPU processes (gloo).

Used by ``tests/test_distributed.py``. Step 1 gives rank 1 alone an infinite loss: both ranks
must skip it (the scaler's overflow check is reduced over ranks), keep their weights and halve the
scale. Step 2 is finite and must update the weights. Writes one record per rank to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import vtdense  # noqa: E402
from vtdense.strategies import fsdp_precision_plugin, shard_blocks  # noqa: E402


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def worker(rank: int, out: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=4)
    shard_blocks(model)
    scaler = fsdp_precision_plugin("16-mixed", "cpu").scaler
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(rank))
    record: dict = {"rank": rank, "scale_before": float(scaler.get_scale())}
    # patch merging's reduction is called as a module (the block linears run fused functions)
    linear = next(m for n, m in model.named_modules() if n.endswith("downsample.reduction"))
    linear.register_forward_hook(lambda m, i, o: record.__setitem__("autocast_dtype", str(o.dtype)))
    for step in range(2):
        before = _full(model)
        with torch.autocast("cpu", dtype=torch.float16):
            feats = model(x)
            loss = sum(v.float().mean() for v in feats.values())
        if step == 0 and rank == 1:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        after = _full(model)
        same = all(torch.equal(a, b) for a, b in zip(before, after))
        if step == 0:
            record["unchanged_after_overflow"] = same
            record["scale_after_overflow"] = float(scaler.get_scale())
        else:
            record["changed_after_good_step"] = not same
    record["finite"] = all(torch.isfinite(p).all().item() for p in after)
    record["checksum"] = sum(float(p.double().sum()) for p in after)
    records = [None, None]
    dist.all_gather_object(records, record)
    if rank == 0:
        Path(out).write_text(json.dumps(records))
    dist.barrier()
    # Leave without tearing the process group down: gloo's teardown after FSDP2 occasionally aborts
    # one process ("terminate called without an active exception", SIGABRT) once all the work
    # above is done and written. Both ranks have passed the barrier, so nothing is in flight.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    out = sys.argv[1]
    init = f"file://{Path(out).resolve().parent / 'pg_store'}"
    mp.spawn(worker, args=(out, init), nprocs=2)
