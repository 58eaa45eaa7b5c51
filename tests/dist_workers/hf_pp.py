"""torchrun worker: transformers' own pipeline parallelism (``DistributedConfig(pp_size=2)``, gloo) for every
``PP_CASES`` case: the methods with cross-layer state are refused while built, on every rank, before any stage
communicates; Twicing runs (logits, greedy generation)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pid_dist_cases as cases
import pid_plugins.hf  # noqa: F401  (registers the methods with transformers)
from pid_plugins.core import get_method


def main(model_dir: str, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, mask = cases.pipeline_batch(-1)
    runs = {}
    for case, (name, params) in cases.PP_CASES.items():
        config = AutoConfig.from_pretrained(model_dir)
        setattr(config, name, params)  # the method's parameters: config.<method>
        run = {}
        try:  # refused while the model is built, on every rank, before any stage communicates
            model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, attn_implementation=name,
                                                         distributed_config=DistributedConfig(pp_size=world)).eval()
            run["owned_layers"] = sorted({n.split(".")[2] for n, _ in model.named_parameters()
                                          if n.startswith("model.layers.")})
            with torch.no_grad():
                run["logits"] = model(ids, attention_mask=mask).logits.clone()
                if not get_method(name).state_fields and not params:  # Twicing at its preset: greedy generation
                    run["generated"] = model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4,
                                                      do_sample=False, pad_token_id=0).clone()
        except ValueError as exc:
            run["refused"] = str(exc)
        runs[case] = run
        dist.barrier()  # both ranks reached the end of the case (a refusal on one rank only would hang here)
    torch.save({"rank": rank, "world": world, "runs": runs}, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
