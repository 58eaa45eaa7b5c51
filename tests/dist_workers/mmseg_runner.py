"""torchrun worker: the cpu-tiny PID Segmenter config through mmengine's Runner with launcher='pytorch' on CPU: the gloo
group is made here first (the launcher calls torch.cuda.set_device) and ``model_wrapper_cfg`` sets device_ids=None."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(config: str, data_root: str, work_dir: str, out: Path) -> None:
    from mmengine.config import Config
    from mmengine.runner import Runner

    dist.init_process_group("gloo")
    cfg = Config.fromfile(config)
    cfg.launcher = "pytorch"
    cfg.work_dir = work_dir
    for split in ("train", "val", "test"):
        cfg[f"{split}_dataloader"].dataset.data_root = data_root
    cfg.train_dataloader.batch_size = 2
    cfg.train_cfg.max_iters = 2
    cfg.train_cfg.val_interval = 2
    cfg.param_scheduler[0].end = 2
    cfg.default_hooks.checkpoint.interval = 2
    cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None)
    runner = Runner.from_cfg(cfg)
    runner.train()
    model = runner.model
    torch.save({"rank": dist.get_rank(), "world": dist.get_world_size(), "wrapper": type(model).__name__,
                "backbone": type(model.module.backbone).__name__,
                "sampler": type(runner.train_dataloader.sampler).__name__,
                "state_dict": {k: v.detach().clone() for k, v in model.module.state_dict().items()}},
               out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4], Path(sys.argv[4]))
