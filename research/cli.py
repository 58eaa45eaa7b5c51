"""``python -m research``: the demo, the reproduction over seeds and the study, from a checkout of the repository
(``make demo`` runs the demo). They use the package's measurement tools (:mod:`pid_plugins.analysis`) and its command
line's argument types and error form (:mod:`pid_plugins.cli`); the package never imports this folder."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from pid_plugins.cli import (CLIError, _add_import_arg, _command, _Help, _int, _out_folder, _Parser,
                             import_user_modules, run_command)


class _ResearchParser(_Parser):
    NAME = "research"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _check_demo_data(data: str, corpus: str) -> None:
    from pid_plugins.analysis.datasets import IMAGE_SOURCES, TEXT_SOURCES

    if data not in IMAGE_SOURCES and not Path(data).is_dir():
        raise CLIError(f"--data {data!r}: use one of {', '.join(IMAGE_SOURCES)} or a folder of <class>/<image> files")
    if corpus not in TEXT_SOURCES and not Path(corpus).is_file():
        raise CLIError(f"--corpus {corpus!r}: use one of {', '.join(TEXT_SOURCES)} or a path to a text file")


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import language_rows, run_demo, vision_rows

    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = sorted(set(parts) - {"core", "vision", "language"})
    if unknown or not parts:
        raise CLIError(f"--parts takes a comma list of core, vision, language; got {args.parts!r}")
    from pid_plugins.core import PIDConfig

    PIDConfig.preset(args.preset)  # a bad preset fails before anything runs
    _check_demo_data(args.data, args.corpus)
    res = run_demo(args.out, quick=args.quick, parts=parts, seed=args.seed, data=args.data, corpus=args.corpus,
                   preset=args.preset, control_first_layer=args.pid_first_layer == "controlled",
                   log=lambda m: print(m, file=sys.stderr))
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


def _seeded_run_parts(args: argparse.Namespace) -> tuple:
    """The checks ``reproduce`` and ``study`` share, before anything runs: parts, seeds, data; returns the parts."""
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    if not parts or set(parts) - {"vision", "language"}:
        raise CLIError(f"--parts takes a comma list of vision, language; got {args.parts!r}")
    if len(set(args.seeds)) != len(args.seeds):
        raise CLIError(f"--seeds lists a seed twice: {args.seeds}")
    _check_demo_data(args.data, args.corpus)
    return parts


def _cmd_reproduce(args: argparse.Namespace) -> int:
    import json

    from .demo import run_reproduce, write_reproduction_record

    if args.aggregate:
        files = sorted({f.resolve() for d in args.aggregate for f in Path(d).glob("seed*/results.json")})
        if not files:
            raise CLIError(f"no seed*/results.json under {' '.join(args.aggregate)}: give the --out folders of "
                           "earlier `python -m research reproduce` runs")
        per_seed = []
        for f in files:
            try:
                per_seed.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise CLIError(f"cannot read {f} ({exc}): rerun that seed or leave its folder out") from None
        by_seed: dict = {}
        for f, r in zip(files, per_seed):
            by_seed.setdefault(r.get("seed"), []).append((f, r))
        per_seed = []
        for seed, copies in sorted(by_seed.items(), key=lambda kv: str(kv[0])):
            if any(r != copies[0][1] for _, r in copies[1:]):
                raise CLIError(f"seed {seed} has different results in {', '.join(str(f) for f, _ in copies)}: each "
                               "seed counts once; aggregate only one of them")
            if len(copies) > 1:
                print(f"seed {seed}: identical results in {len(copies)} folders, counted once", file=sys.stderr)
            per_seed.append(copies[0][1])
        from .experiments import output_lock

        with output_lock(Path(args.out)):
            write_reproduction_record(per_seed, Path(args.out))  # the budget is read from the results
        print((Path(args.out) / "reproduce.md").read_text())
        return 0
    parts = _seeded_run_parts(args)
    rec = run_reproduce(args.out, seeds=tuple(args.seeds), vision_epochs=args.vision_epochs, lm_steps=args.lm_steps,
                        data=args.data, corpus=args.corpus, parts=parts, log=lambda m: print(m, file=sys.stderr))
    print((Path(args.out) / "reproduce.md").read_text())
    del rec
    return 0


def _cmd_study(args: argparse.Namespace) -> int:
    from .experiments import check_arms, split_arms
    from .study import run_study, write_study_record

    if args.aggregate:
        from .experiments import output_lock

        with output_lock(Path(args.out)):
            write_study_record(args.out)
    else:
        import_user_modules(args.imports)
        arms = split_arms(args.arms)
        try:
            check_arms(arms)
        except ValueError as exc:
            raise CLIError(f"--arms: {exc}") from None
        parts = _seeded_run_parts(args)
        budget = dict(data=args.data, corpus=args.corpus, vision_epochs=args.vision_epochs, patch_size=args.patch_size,
                      train_limit=args.train_limit, test_limit=args.test_limit, pgd_steps=args.pgd_steps,
                      lm_steps=args.lm_steps)
        run_study(args.out, tuple(args.seeds), tuple(args.depths), arms, parts, budget,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
    print((Path(args.out) / "study.md").read_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .study import DEFAULT_BUDGET as B

    parser = _ResearchParser(prog="python -m research", formatter_class=_Help,
                             description="The demo, the reproduction and the study of softmax vs PID measured in the "
                                         "documentation (make demo runs the demo).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    p = _command(sub, "demo", "the main job: softmax vs PID on real data (vision + language), report + plots",
                 "make demo runs it with the defaults.")
    p.add_argument("--out", type=_out_folder, default=Path("demo_out"),
                   help="output folder; trained models are cached there")
    p.add_argument("--quick", action="store_true", help="tiny budgets (under 3 minutes), for smoke tests")
    p.add_argument("--parts", default="core,vision,language", help="comma list of core, vision, language")
    p.add_argument("--data", default="auto", help="images: fashion-mnist, digits or auto (Fashion-MNIST if installed)")
    p.add_argument("--corpus", default="wiki", help="text: wiki (gensim's Wikipedia sample), shakespeare or a file")
    p.add_argument("--seed", type=_int(0), default=0, help="seed of the data order and initial weights")
    p.add_argument("--preset", default="deit", help="gains of the core demo's PID layers")
    p.add_argument("--pid-first-layer", choices=("controlled", "reference"), default="controlled",
                   help="the vision and language PID models' first layer: controlled (eq. 25 as written) "
                        "or reference-only (plain attention, records v^1; better in `python -m research study` here)")
    p.set_defaults(func=_cmd_demo)
    p = _command(sub, "reproduce", "the demo comparison with a larger budget over several seeds (mean +- std)")
    p.add_argument("--out", type=_out_folder, default=Path("reproduce_out"), help="output folder")
    p.add_argument("--seeds", type=_int(0), nargs="+", default=[0, 1, 2], help="seeds, one run each")
    p.add_argument("--vision-epochs", type=_positive_float, default=3.0, help="training epochs of the vision models")
    p.add_argument("--lm-steps", type=_int(1), default=2000, help="training steps of the language models")
    p.add_argument("--parts", default="vision,language", help="comma list of vision, language")
    p.add_argument("--data", default="auto", help="images: fashion-mnist, digits or auto (Fashion-MNIST if installed)")
    p.add_argument("--corpus", default="wiki", help="text: wiki (gensim's Wikipedia sample), shakespeare or a file")
    p.add_argument("--aggregate", nargs="+", metavar="DIR",
                   help="only aggregate the seed*/results.json of earlier runs (e.g. seeds run in parallel) into --out")
    p.set_defaults(func=_cmd_reproduce)
    p = _command(sub, "study", "softmax vs PID variants and other attention methods over seeds and depths",
                 "Arms: softmax, PID (first layer controlled or reference-only), NeuTRENO and any registered attention "
                 "method; paired differences against softmax with 95% t-intervals.")
    p.add_argument("--out", type=_out_folder, default=Path("study_out"), help="output folder")
    p.add_argument("--seeds", type=_int(0), nargs="+", default=[0, 1, 2], help="seeds, one run per arm each")
    p.add_argument("--depths", type=_int(1), nargs="+", default=[6, 12], help="vision model depths")
    p.add_argument("--arms", default="softmax,pid,pid_ref,neutreno",
                   help="comma list starting with softmax: built-in arms (pid, pid_ref, neutreno) and any registered "
                        "attention method as [label=]method[:params], params a JSON object or a preset name, e.g. "
                        "'softmax,pid,p5=pid:{\"lambda_p\": 0.5}'")
    p.add_argument("--parts", default="vision,language", help="comma list of vision, language")
    p.add_argument("--data", default=B["data"], help="images: fashion-mnist, digits or auto")
    p.add_argument("--corpus", default=B["corpus"], help="text: wiki, shakespeare or a file")
    p.add_argument("--vision-epochs", type=_positive_float, default=B["vision_epochs"],
                   help="training epochs of the vision models")
    p.add_argument("--patch-size", type=_int(1), default=B["patch_size"], help="patch size of the vision models")
    p.add_argument("--train-limit", type=_int(1), default=B["train_limit"], help="training images used")
    p.add_argument("--test-limit", type=_int(1), default=B["test_limit"], help="test images used")
    p.add_argument("--pgd-steps", type=_int(1), default=B["pgd_steps"], help="PGD iterations of the robustness check")
    p.add_argument("--lm-steps", type=_int(1), default=B["lm_steps"], help="training steps of the language models")
    _add_import_arg(p)
    p.add_argument("--aggregate", action="store_true", help="only aggregate the results already in --out")
    p.set_defaults(func=_cmd_study)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run a command; a mistake the user can fix prints one ``research: error: ...`` line and returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_command(build_parser().parse_args(argv), _ResearchParser.NAME)
