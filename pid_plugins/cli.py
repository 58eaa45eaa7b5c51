"""``pid-plugins``: list the PID variants across zoos, show presets, diagnose collapse, attack, run the demo."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence


def _cmd_list(args: argparse.Namespace) -> int:
    from .catalogue import ZOOS, get_model_entry, list_models

    names = list_models(args.pattern, zoo=args.zoo)
    if not names:
        print(f"no PID models match {args.pattern!r}" + (f" in zoo {args.zoo}" if args.zoo else ""))
        return 0
    rows = [("name", "zoo", "base", "preset")]
    for name in names:
        e = get_model_entry(name)
        rows.append((e.name, e.zoo, e.base, e.preset + (f" {e.gains}" if e.gains else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from .catalogue import load_presets

    print(f"{'preset':<10} {'lambda_p':>8} {'lambda_i':>8} {'lambda_d':>8} {'beta':>6}")
    for name, g in load_presets().items():
        print(f"{name:<10} {g['lambda_p']:>8} {g['lambda_i']:>8} {g['lambda_d']:>8} {g['beta']:>6}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import language_rows, run_demo, vision_rows

    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = sorted(set(parts) - {"core", "vision", "language"})
    if unknown or not parts:
        raise ValueError(f"--parts takes a comma list of core, vision, language; got {args.parts!r}")
    from .core import PIDConfig

    PIDConfig.preset(args.preset)  # a bad preset fails before anything runs
    res = run_demo(args.out, quick=args.quick, parts=parts, seed=args.seed, data=args.data, corpus=args.corpus,
                   preset=args.preset, log=lambda m: print(m, file=sys.stderr))
    if "core" in res:
        fixed, stack = res["core"]["fixed_attention"], res["core"]["attention_stack"]
        print(f"core: fixed attention, rank after {len(fixed['softmax']['numerical_rank']) - 1} layers: softmax "
              f"{fixed['softmax']['numerical_rank'][-1]}, PID {fixed['pid']['numerical_rank'][-1]}; attention stack, "
              f"mean cosine after 12 blocks: softmax {stack['softmax']['mean_cosine'][-1]:.3f}, "
              f"PID {stack['pid']['mean_cosine'][-1]:.3f}")
    for part, rows in (("vision", vision_rows), ("language", language_rows)):
        if part in res:
            table = rows(res[part])
            w = max(len(r[0]) for r in table)
            print(f"\n{part} ({res[part].get('data', res[part]['spec'].get('corpus', ''))})")
            print(f"  {'':<{w}}  {'softmax':>16}  {'PID':>16}")
            for a, b, c in table:
                print(f"  {a:<{w}}  {b:>16}  {c:>16}")
    print(f"\nwrote {args.out}/report.md (with PNGs and demo.json) in {res['seconds']:.0f} s")
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    import json

    from .demo import run_reproduce, write_reproduction_record

    if args.aggregate:
        files = sorted(f for d in args.aggregate for f in Path(d).glob("seed*/results.json"))
        if not files:
            raise ValueError(f"no seed*/results.json under {args.aggregate}")
        per_seed = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["seed"])
        write_reproduction_record(per_seed, Path(args.out))  # the budget is read from the results
        print((Path(args.out) / "reproduce.md").read_text())
        return 0
    rec = run_reproduce(args.out, seeds=tuple(args.seeds), vision_epochs=args.vision_epochs, lm_steps=args.lm_steps,
                        data=args.data, corpus=args.corpus, parts=tuple(args.parts.split(",")),
                        log=lambda m: print(m, file=sys.stderr))
    print((Path(args.out) / "reproduce.md").read_text())
    del rec
    return 0


def _json_kwargs(text: Optional[str]) -> dict:
    import json

    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model-kwargs must be a JSON object, e.g. '{{\"num_classes\": 10}}': {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--model-kwargs must be a JSON object")
    return value


def _floats(text: str, what: str) -> list:
    from .analysis.robustness import parse_eps

    if text.strip().lower() in ("", "none"):
        return []
    return [parse_eps(t) if what == "eps" else float(t) for t in text.split(",")]


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from .analysis.run import run_diagnose

    report = run_diagnose(
        args.model, args.data, args.out, checkpoints=args.checkpoint or (), model_kwargs=_json_kwargs(args.model_kwargs),
        num_samples=args.num_samples, batch_size=args.batch_size, seq_len=args.seq_len, passes=args.passes,
        layer_stack=args.layer_stack, seed=args.seed, log=lambda m: print(m, file=sys.stderr),
    )
    print(f"{'model':<40} {'layers':>6} {'cos first':>9} {'cos last':>9} {'E last':>7} {'erank last':>10}")
    for label, r in report["models"].items():
        print(f"{label:<40} {r['num_layers']:>6} {r['mean_cosine'][0]:>9.3f} {r['mean_cosine'][-1]:>9.3f} "
              f"{r['consensus_distance'][-1]:>7.3f} {r['effective_rank'][-1]:>10.2f}")
    print(f"wrote {args.out}/diagnose.json and {args.out}/diagnose.png")
    return 0


def _cmd_attack(args: argparse.Namespace) -> int:
    from .analysis.robustness import DEFAULT_CORRUPTIONS, parse_eps
    from .analysis.run import run_attack

    attacks = [a for a in args.attacks.lower().split(",") if a and a != "none"]
    if args.corruptions == "all":
        from corrupt_tta import corruption_dict

        corruptions = sorted(corruption_dict)
    elif args.corruptions == "none":
        corruptions = []
    elif args.corruptions == "default":
        corruptions = list(DEFAULT_CORRUPTIONS)
    else:
        corruptions = args.corruptions.split(",")
    baseline = None
    if args.baseline is not None:
        if args.baseline not in args.model:
            raise ValueError(f"--baseline {args.baseline!r} must be one of the --model names {args.model}")
        baseline = args.model.index(args.baseline)
    image_options = dict(
        attacks=attacks, eps=parse_eps(args.eps), eps_sweep=_floats(args.eps_sweep, "eps") or None,
        pgd_steps=args.pgd_steps, spsa_iters=args.spsa_iters, noise_sigmas=_floats(args.noise, "float"),
        corruptions=corruptions, severities=[int(s) for s in args.severities.split(",")],
    )
    report = run_attack(
        args.model, args.data, args.out, checkpoints=args.checkpoint or (), model_kwargs=_json_kwargs(args.model_kwargs),
        baseline=baseline, num_samples=args.num_samples, batch_size=args.batch_size, seq_len=args.seq_len,
        seed=args.seed, image_options=image_options, rates=_floats(args.rates, "float"),
        log=lambda m: print(m, file=sys.stderr),
    )
    for label, r in report["models"].items():
        if report["kind"] == "image":
            parts = [f"clean {100 * r['clean']['top1']:.1f}%"]
            for a in ("fgsm", "pgd", "spsa"):
                if a in r:
                    parts.append(f"{a.upper()} {100 * r[a]['top1'][-1]:.1f}%")
            if "corruptions" in r:
                parts.append(f"mean corruption error {100 * r['corruptions']['mean_corruption_error']:.1f}%")
                if "mce_vs_baseline" in r["corruptions"]:
                    parts.append(f"mCE {r['corruptions']['mce_vs_baseline']:.1f}")
        else:
            parts = [f"ppl@{100 * x:g}% {p:.2f}" for x, p in zip(r["substitution_rate"], r["perplexity"])]
        print(f"{label}: " + ", ".join(parts))
    print(f"wrote {args.out}/attack.json and {args.out}/attack.png")
    return 0


def _add_model_args(p: argparse.ArgumentParser, samples: int, batch: int) -> None:
    p.add_argument("--model", action="append", required=True,
                   help="registry/timm name, transformers folder or mmseg config; repeat to compare models")
    p.add_argument("--checkpoint", action="append", help="local weights for each --model, in order")
    p.add_argument("--model-kwargs", help="JSON kwargs for building named models, e.g. '{\"num_classes\": 10}'")
    p.add_argument("--data", required=True,
                   help="images: fashion-mnist, digits, auto or a <class>/<image> folder; text: wiki, shakespeare or a .txt file")
    p.add_argument("--num-samples", type=int, default=samples, help="images, or token blocks of text")
    p.add_argument("--batch-size", type=int, default=batch)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per text block")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pid-plugins", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list the PID model variants declared in the registry")
    p.add_argument("pattern", nargs="?", default="*", help="glob on the name, e.g. 'pid_deit*'")
    p.add_argument("--zoo", choices=["timm", "hf", "mmseg", "fairseq"], default=None)
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("presets", help="show the paper's gains")
    p.set_defaults(func=_cmd_presets)
    p = sub.add_parser("diagnose", help="per-layer token collapse and attention sparsity of models, JSON + PNG")
    _add_model_args(p, 64, 16)
    p.add_argument("--passes", type=int, default=20, help="repeated passes of the layer stack (0 = skip)")
    p.add_argument("--layer-stack", help="dotted path of the layer stack (default: found automatically)")
    p.add_argument("--out", default="diagnose_out")
    p.set_defaults(func=_cmd_diagnose)
    p = sub.add_parser("attack", help="robustness: attacks, noise, corruptions (images); noisy perplexity (LMs)")
    _add_model_args(p, 256, 64)
    p.add_argument("--baseline", help="the --model the mCE is relative to")
    p.add_argument("--attacks", default="fgsm,pgd", help="comma list of fgsm, pgd, spsa (or none)")
    p.add_argument("--eps", default="3/255", help="l_inf budget in [0, 1] pixels (PGD/FGSM without a sweep, SPSA)")
    p.add_argument("--eps-sweep", default="", help="comma list of eps for FGSM/PGD, e.g. 1/255,2/255,3/255,4/255")
    p.add_argument("--pgd-steps", type=int, default=20)
    p.add_argument("--spsa-iters", type=int, default=5)
    p.add_argument("--noise", default="0.02,0.05,0.1,0.2", help="Gaussian noise sigmas (or none)")
    p.add_argument("--corruptions", default="default", help="default, all, none or a comma list of corrupt-tta names")
    p.add_argument("--severities", default="1,2,3,4,5")
    p.add_argument("--rates", default="0,0.05,0.1,0.2", help="token substitution rates (language models)")
    p.add_argument("--out", default="attack_out")
    p.set_defaults(func=_cmd_attack)
    p = sub.add_parser("demo", help="the main job: softmax vs PID on real data (vision + language), report + plots")
    p.add_argument("--out", default="demo_out", help="output directory (default: demo_out); trained models are cached there")
    p.add_argument("--quick", action="store_true", help="tiny budgets (under 3 minutes), for smoke tests")
    p.add_argument("--parts", default="core,vision,language", help="comma list of core, vision, language")
    p.add_argument("--data", default="auto", help="images: fashion-mnist, digits or auto (Fashion-MNIST if installed)")
    p.add_argument("--corpus", default="wiki", help="text: wiki (gensim's Wikipedia sample), shakespeare or a file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="deit", help="gains of the core demo's PID layers")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("reproduce", help="the demo comparison with a larger budget over several seeds (mean +- std)")
    p.add_argument("--out", default="reproduce_out")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--vision-epochs", type=float, default=3.0)
    p.add_argument("--lm-steps", type=int, default=2000)
    p.add_argument("--parts", default="vision,language")
    p.add_argument("--data", default="auto")
    p.add_argument("--corpus", default="wiki")
    p.add_argument("--aggregate", nargs="+", metavar="DIR",
                   help="only aggregate the seed*/results.json of earlier runs (e.g. seeds run in parallel) into --out")
    p.set_defaults(func=_cmd_reproduce)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pid-plugins: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
