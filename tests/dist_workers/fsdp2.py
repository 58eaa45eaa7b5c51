"""torchrun worker: FSDP2 per-layer sharding (``fully_shard`` on every layer, then the model) of a method model of every
zoo, on gloo."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import pid_dist_cases as cases


def run(name: str, mode: str, rank: int, world: int, workdir: Path) -> dict:
    reshard, checkpointing = cases.FSDP_MODES[mode]
    model, layers, batch, forward = cases.build_fsdp_case(name, workdir, checkpointing)
    if mode == "ddp":
        wrapped = DistributedDataParallel(model)
        model_forward = forward
        forward = lambda m, b: model_forward(wrapped, b)  # noqa: E731  (the wrapper's forward: gradient sync)
    else:
        for layer in layers(model):
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    # the optimizer takes the sharded parameters, so it is made before the forward (with
    # reshard_after_forward=False the module holds the unsharded ones from the forward to the backward)
    opt = torch.optim.SGD(model.parameters(), lr=cases.FSDP_LR)
    out = forward(model, cases.rank_slice(batch(), rank, world))
    opt.zero_grad()
    cases.fsdp_loss(out).backward()
    opt.step()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in model.named_parameters()}
    sharded = sum(isinstance(p, DTensor) for p in model.parameters()) if mode != "ddp" else len(params)
    dtensors = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    # the learnable method parameters' gradients (averaged over the ranks), whole: small next to the parameters, so
    # compared on their own
    gain_grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                  for n, p in model.named_parameters() if ".attention_params." in n and p.grad is not None}
    return {"out": out.detach().clone(), "params": params, "sharded": sharded, "dtensors": dtensors,
            "gain_grads": gain_grads}


def main(out: Path, names: tuple = cases.FSDP_CASES) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = out / f"work{rank}"
    workdir.mkdir(exist_ok=True)
    runs = {}
    for name in names:
        for mode in cases.case_modes(name, workdir):
            runs[name, mode] = run(name, mode, rank, world, workdir)
            print(f"rank {rank}: {name} {mode} done", flush=True)
    torch.save({"rank": rank, "world": world, "runs": runs}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *([tuple(sys.argv[2].split(","))] if len(sys.argv) > 2 else []))
