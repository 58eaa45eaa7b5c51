"""torchrun / accelerate worker: a few transformers Trainer steps of a tiny PID Llama (CPU, gloo, offline); each rank
saves its final parameters and what it saw to OUT/rank{rank}.pt."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pid_dist_cases as cases


FSDP = dict(
    fsdp="full_shard auto_wrap",
    fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                 "reshard_after_forward": True, "cpu_ram_efficient_loading": False, "activation_checkpointing": False},
    gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
)


def main(out: Path, fsdp: bool = False, learnable: bool = False) -> None:
    from transformers import Trainer, TrainingArguments

    from pid_plugins.core.pid import PIDMethod  # the PID method's rule, once per layer

    calls = []
    original = PIDMethod.update

    def counting_update(self, params, out, *args, **kwargs):  # the PID rule runs inside the Trainer's DDP forward/backward
        calls.append(out.shape[0])
        return original(self, params, out, *args, **kwargs)

    PIDMethod.update = counting_update
    model = cases.llama_model(layers=cases.HF_FSDP_LAYERS if fsdp else 2, learnable=learnable)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    calls.clear()  # the Trainer's calls only (building the first method model runs the adapter's probes)
    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=cases.HF_PER_RANK, max_steps=cases.HF_STEPS,
        learning_rate=cases.HF_LR,
        report_to="none", use_cpu=True, ddp_backend="gloo", save_strategy="no", logging_steps=1,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, lr_scheduler_type="constant", optim="sgd",
        weight_decay=0.0, max_grad_norm=cases.HF_MAX_GRAD_NORM,
        **(FSDP if fsdp else {}),
    )
    rows = cases.HFRows()
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    result = trainer.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped = type(trainer.model_wrapped).__name__
    from torch.distributed.tensor import DTensor

    def whole(t):  # FSDP2 keeps each parameter as a DTensor shard
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    torch.save({"rank": rank, "world": world, "wrapped": wrapped, "pid_calls": calls, "rows": rows.seen,
                "attn_implementation": model.config._attn_implementation,
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                "train_loss": result.training_loss, "global_step": trainer.state.global_step,
                "init": init, "state_dict": {k: whole(v) for k, v in model.state_dict().items()}, "sharded": sharded},
               out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), fsdp="fsdp" in sys.argv[2:], learnable="learnable" in sys.argv[2:])
