"""torchrun worker: a transformers Llama per ``PIPELINE_METHODS`` case split in 2 stages (``pipeline_stage``) under
``torch.distributed.pipelining`` (GPipe, 2 microbatches, gloo): the logits of a padded batch, then ``PIPELINE_STEPS``
SGD steps."""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import pid_dist_cases as cases
import pid_plugins.hf as ph


def stage_of(case: str, rank: int, world: int, train: bool):
    model = cases.pipeline_llama(case).train(train)
    module = ph.pipeline_stage(model, rank, world)
    return model, module, PipelineStage(module, rank, world, torch.device("cpu"))


def run(case: str, rank: int, world: int) -> dict:
    last = rank == world - 1
    result = {}
    # inference: forward only (no loss_fn), the mask to every stage
    model, module, stage = stage_of(case, rank, world, train=False)
    schedule = ScheduleGPipe(stage, n_microbatches=cases.PIPELINE_MICROBATCHES)
    ids, mask = cases.pipeline_batch(-1)
    with torch.no_grad():
        out = schedule.step(ids, attention_mask=mask) if rank == 0 else schedule.step(attention_mask=mask)
    if last:
        result["logits"] = out.detach().clone()
    # training: GPipe with the loss on the last stage (scale_grads: the mean over the microbatches)
    model, module, stage = stage_of(case, rank, world, train=True)
    schedule = ScheduleGPipe(stage, n_microbatches=cases.PIPELINE_MICROBATCHES, loss_fn=cases.pipeline_loss)
    opt = torch.optim.SGD(module.parameters(), lr=cases.PIPELINE_LR)
    losses = []
    for step in range(cases.PIPELINE_STEPS):
        ids, _ = cases.pipeline_batch(step)
        opt.zero_grad()
        if rank == 0:
            schedule.step(ids)
        else:
            micro = []
            schedule.step(target=ids, losses=micro)
            losses.append(torch.stack(micro).mean().item())
        opt.step()
    result["losses"] = losses
    result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    result["state_fields"] = module.state_fields()
    return result


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs, seconds = {}, {}
    for case in cases.PIPELINE_METHODS:
        start = time.perf_counter()
        runs[case] = run(case, rank, world)
        seconds[case] = time.perf_counter() - start
    torch.save({"rank": rank, "world": world, "runs": runs, "seconds": seconds}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
