"""torchrun worker: the transformers Trainer with DeepSpeed ZeRO-2 and ZeRO-3 (CPU, gloo) for every attention method."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pid_dist_cases as cases


def no_shm_comm_op() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op incompatible: its CPU accelerator would JIT-compile it (about
    125 s on 2 cores, again whenever another venv built it last) though only DeepSpeed inference's tensor
    parallelism calls it; ZeRO trains through torch.distributed either way."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # what comm/torch.py's build_shm_op reads


def run(stage: int, case: tuple, ckpt: Path, out: Path) -> dict:
    import deepspeed
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=cases.HF_PER_RANK, max_steps=cases.HF_STEPS,
        learning_rate=cases.HF_LR, report_to="none", save_strategy="no", logging_steps=1, dataloader_num_workers=0,
        seed=0, disable_tqdm=True, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
        max_grad_norm=cases.HF_MAX_GRAD_NORM, deepspeed=cases.deepspeed_config(stage))
    model = cases.dc_load(case, ckpt)  # after the arguments: under ZeRO-3, built inside deepspeed.zero.Init
    built_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    rows = cases.HFRows()
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params) if stage == 3 else torch.no_grad():
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"rows": rows.seen, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "params": whole, "engine": type(trainer.model_wrapped).__name__, "built_partitioned": built_partitioned,
            "attn_implementation": model.config._attn_implementation}


def main(ckpts: Path, out: Path) -> None:
    no_shm_comm_op()
    runs = {}
    for stage in (2, 3):
        for name, case in cases.deepspeed_cases().items():
            runs[stage, name] = run(stage, case, ckpts / name, out)
            print(f"rank {dist.get_rank()}: ZeRO-{stage} {name} done", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save({"rank": rank, "world": world, "runs": runs}, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
