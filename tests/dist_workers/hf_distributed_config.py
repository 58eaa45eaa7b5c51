"""torchrun worker: transformers' ``from_pretrained(..., distributed_config=DistributedConfig(...))`` on 2 CPU ranks
with the methods' learnable parameters."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import pid_dist_cases as cases


def whole(model) -> dict:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def main(kind: str, ckpts: Path, out: Path) -> None:
    import pid_plugins
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    table = cases.TP_CASES if kind == "tp" else cases.FSDP_LEARNABLE_CASES
    runs = {}
    for case_name, case in table.items():
        config = DistributedConfig(tp_size=world) if kind == "tp" else DistributedConfig(fsdp_size=world)
        model = cases.dc_load(case, ckpts / case_name, config)
        loaded = whole(model)
        half = cases.DC_BATCH // world
        rows = slice(None) if kind == "tp" else slice(rank * half, (rank + 1) * half)
        losses = cases.dc_train(model, cases.DC_STEPS[kind], rows)
        runs[case_name] = {
            "loaded": loaded, "params": whole(model), "losses": losses,
            "dtensors": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
            "plan": {k: v for k, v in (getattr(model, "tp_plan", None) or {}).items() if "attention_params" in k},
            # each rank's own copy (tensor parallelism replicates them): the ranks must agree
            "gains": {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in model.named_parameters() if ".attention_params." in n},
        }
        print(f"rank {rank}: {kind} {case_name} done", flush=True)
        dist.barrier()
    torch.save({"rank": rank, "world": world, "runs": runs, "plugin": pid_plugins.__file__}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
