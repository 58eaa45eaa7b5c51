"""torchrun worker: a tiny timm PID DeiT under DistributedDataParallel (gloo), each rank on half of every global batch,
run without and with timm's gradient checkpointing and once more with warm-up (the counter a buffer); each rank saves
the runs' final parameters and losses to OUT/rank{rank}.pt."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import pid_dist_cases as cases


def train(rank: int, world: int, grad_checkpointing: bool, warmup_steps: int = 0) -> dict:
    model = cases.timm_model(warmup_steps=warmup_steps)
    model.set_grad_checkpointing(grad_checkpointing)
    model.train()
    ddp = DDP(model)
    opt = cases.timm_optimizer(ddp.parameters())
    per_rank = cases.TIMM_GLOBAL_BATCH // world
    losses = []
    for step in range(cases.TIMM_STEPS):
        x, y = cases.timm_batch(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    return {"losses": losses, "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {mode: train(rank, world, mode == "grad_checkpointing") for mode in ("plain", "grad_checkpointing")}
    runs["warmup"] = train(rank, world, True, warmup_steps=cases.TIMM_WARMUP_STEPS)
    torch.save({"rank": rank, "world": world, "runs": runs}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
