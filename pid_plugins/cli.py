"""``pid-plugins``: ``list``, ``presets``, ``diagnose``, ``attack``, ``doctor`` and ``run``."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence


class CLIError(ValueError):
    """A mistake in the command line: printed as one ``pid-plugins: error: ...`` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one ``NAME: error: ...`` line."""

    NAME = "pid-plugins"

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.NAME}: error: {message} (see `{self.prog} --help`)\n")


def _int(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value

    return parse


def _number_list(lo: float, hi: float, what: str,
                 parse: Callable[[str], float] = float) -> Callable[[str], List[float]]:
    """An argparse type: a comma list of finite numbers in [lo, hi] ("none" or "" = empty list)."""

    def parse_list(text: str) -> List[float]:
        if text.strip().lower() in ("", "none"):
            return []
        values = []
        for item in text.split(","):
            try:
                value = parse(item.strip())
            except (ValueError, ZeroDivisionError):
                raise argparse.ArgumentTypeError(f"cannot read {item.strip()!r} as {what}") from None
            if not (math.isfinite(value) and lo <= value <= hi):
                raise argparse.ArgumentTypeError(f"{what} must be finite and in [{lo:g}, {hi:g}], got {item.strip()}")
            values.append(value)
        return values

    return parse_list


def _fraction(text: str) -> float:
    num, sep, den = text.partition("/")  # 3/255 or 0.0118
    return float(num) / (float(den) if sep else 1.0)


_EPS = "an eps (e.g. 3/255 or 0.0118)"


def _eps(text: str) -> float:
    values = _number_list(0.0, 1.0, _EPS, _fraction)(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"give one eps in [0, 1], e.g. 3/255; got {text!r}")
    return values[0]


def _severities(text: str) -> List[int]:
    values = _number_list(1, 5, "a corruption severity (1..5)")(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"severities are whole numbers 1..5, got {text}")
    return [int(v) for v in values]


def _json_object(text: str, expected: str, null: bool = False) -> Optional[dict]:
    """``text`` as a JSON object (``null``: None allowed too), else an argparse error saying ``expected``."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected {expected} ({exc})") from None
    if not isinstance(value, dict) and not (null and value is None):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _attention_cfg(text: str) -> object:
    """An argparse type: a method's parameters, a JSON object of overrides (``null``: none) or a preset name."""
    if text.isidentifier() and text not in ("null", "true", "false"):
        return text
    return _json_object(text, "a JSON object or a preset name, e.g. '{\"lambda_p\": 0.5}'", null=True)


def _import_and_check_attention(args: argparse.Namespace) -> None:
    """Import the --import modules, then check each --attention name against the methods registered now."""
    from .core import SOFTMAX, get_method
    import_user_modules(args.imports)
    for name in args.attention or []:
        if name != SOFTMAX:
            try:
                get_method(name)
            except ValueError as exc:
                raise CLIError(f"--attention: {exc}{_IMPORT_HINT}") from None
    if args.attention_cfg and not args.attention:
        raise CLIError("--attention-cfg gives a method's parameters: name the method with --attention")


_IMPORT_HINT = "; a method your own module registers: --import MODULE (a dotted name or a .py file)"


def import_user_modules(specs: Sequence[str]) -> List[str]:
    """Import each ``--import`` module (a ``.py`` path or a dotted name), in order; returns their names."""
    import importlib
    import os
    names = []
    for spec in specs:
        path = Path(spec)
        if spec.endswith(".py") or os.sep in spec or (os.altsep and os.altsep in spec):
            if not path.is_file():
                raise CLIError(f"--import {spec!r}: no such .py file; give a path to a Python file or a dotted module "
                               "name importable from the current directory or PYTHONPATH")
            names.append(_import_file(path.resolve(), spec))
            continue
        if not all(part.isidentifier() for part in spec.split(".")):
            raise CLIError(f"--import {spec!r}: not a dotted module name (e.g. my_methods or pkg.methods) or a path to "
                           "a .py file")
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m`: modules in the current directory are importable
        try:
            importlib.import_module(spec)
        except Exception as exc:  # the module is missing, or the user's module raised: name it and what it raised
            name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            if name is not None and spec.startswith(name) and spec[len(name):][:1] in ("", "."):
                raise CLIError(f"--import {spec!r}: no module named {name!r} on the current directory or "
                               "PYTHONPATH; give a dotted module name importable from there or a path to a .py "
                               "file") from None
            raise CLIError(f"--import {spec!r}: importing it failed: {type(exc).__name__}: {exc}") from exc
        names.append(spec)
    return names


def _import_file(path: Path, spec: str) -> str:
    """Run the file ``path`` as the module named after it (once: a module of that name from this file is kept)."""
    import importlib.util
    name = path.stem if path.stem.isidentifier() else "user_module"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return name
        import hashlib  # another module owns the name: keep it, load this file under a name of its own
        name = f"_pid_plugins_import_{name}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CLIError(f"--import {spec!r}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    sys.path.insert(0, str(path.parent))  # its own sibling imports, as `python file.py` would see them
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise CLIError(f"--import {spec!r}: importing it failed: {type(exc).__name__}: {exc}") from exc
    return name


def _out_folder(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder: name a new or existing folder")
    return path


def _cmd_list(args: argparse.Namespace) -> int:
    from .catalogue import get_model_entry, list_models
    names = list_models(args.pattern, zoo=args.zoo)
    if not names:
        print(f"no PID models match {args.pattern!r}" + (f" in zoo {args.zoo}" if args.zoo else ""))
        return 0
    rows = [("name", "zoo", "base", "preset")]
    for name in names:
        e = get_model_entry(name)
        rows.append((e.name, e.zoo, e.base, (e.preset or "-") + (f" {e.gains}" if e.gains else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from .core import PIDConfig, get_method, list_methods
    print(f"{'preset':<10} {'lambda_p':>8} {'lambda_i':>8} {'lambda_d':>8} {'beta':>6}")
    for name, g in PIDConfig.PRESETS.items():
        print(f"{name:<10} {g['lambda_p']:>8} {g['lambda_i']:>8} {g['lambda_d']:>8} {g['beta']:>6}")
    for method in list_methods():
        presets = getattr(get_method(method).config_type, "PRESETS", {})
        if method == "pid" or not presets:
            continue
        print(f"\n{method}")
        for name, fields in presets.items():
            print(f"  {name:<10} " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from .analysis.run import run_diagnose
    _import_and_check_attention(args)
    report = run_diagnose(args, log=lambda m: print(m, file=sys.stderr))
    w = max([40, *(len(label) for label in report["models"])])
    m = max([16, *(len(r["method"]) for r in report["models"].values())])
    print(f"{'model':<{w}} {'method':<{m}} {'layers':>6} {'cos first':>9} {'cos last':>9} {'E last':>7} "
          f"{'erank last':>10}")
    for label, r in report["models"].items():
        print(f"{label:<{w}} {r['method']:<{m}} {r['num_layers']:>6} {r['mean_cosine'][0]:>9.3f} "
              f"{r['mean_cosine'][-1]:>9.3f} {r['consensus_distance'][-1]:>7.3f} {r['effective_rank'][-1]:>10.2f}")
    print(f"wrote {args.out}/diagnose.json and {args.out}/diagnose.png")
    return 0


def _cmd_attack(args: argparse.Namespace) -> int:
    from .analysis.robustness import DEFAULT_CORRUPTIONS
    from .analysis.run import run_attack
    _import_and_check_attention(args)
    args.attacks = [a.strip() for a in args.attacks.lower().split(",") if a.strip() and a.strip() != "none"]
    unknown = sorted(set(args.attacks) - {"fgsm", "pgd", "spsa"})
    if unknown:
        raise CLIError(f"--attacks: unknown {', '.join(unknown)}; choose from fgsm, pgd, spsa (or none)")
    named = {"all": None, "default": list(DEFAULT_CORRUPTIONS), "none": []}
    corruptions = named.get(args.corruptions, [c.strip() for c in args.corruptions.split(",") if c.strip()])
    if corruptions is None or corruptions:
        try:
            from corrupt_tta import corruption_dict
        except ImportError:
            raise CLIError("corruptions need corrupt-tta: pip install -c constraints.txt corrupt-tta, or give "
                           "--corruptions none") from None
        corruptions = sorted(corruption_dict) if corruptions is None else corruptions
        unknown = sorted(set(corruptions) - set(corruption_dict))
        if unknown:
            raise CLIError(f"--corruptions: unknown {', '.join(unknown)}; choose from "
                           f"{', '.join(sorted(corruption_dict))}")
    if args.baseline is not None and args.baseline not in args.model:
        raise CLIError(f"--baseline {args.baseline!r} must be one of the --model names {args.model}")
    args.corruptions, args.baseline = corruptions, None if args.baseline is None else args.model.index(args.baseline)
    report = run_attack(args, log=lambda m: print(m, file=sys.stderr))
    for label, r in report["models"].items():
        if report["kind"] == "image":
            parts = [f"clean {100 * r['clean']['top1']:.1f}%"]
            parts += [f"{a.upper()} {100 * r[a]['top1'][-1]:.1f}%" for a in ("fgsm", "pgd", "spsa") if a in r]
            if "corruptions" in r:
                parts.append(f"mean corruption error {100 * r['corruptions']['mean_corruption_error']:.1f}%")
                if "mce_vs_baseline" in r["corruptions"]:
                    parts.append(f"mCE {r['corruptions']['mce_vs_baseline']:.1f}")
        else:
            parts = [f"ppl@{100 * x:g}% {p:.2f}" for x, p in zip(r["substitution_rate"], r["perplexity"])]
        print(f"{label} ({r['method']}): " + ", ".join(parts))
    print(f"wrote {args.out}/attack.json and {args.out}/attack.png")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default after its help text."""


#: the adapters whose zoo internals ``doctor`` checks: (adapter, the distribution it needs)
DOCTOR_ZOOS = (("hf", "transformers"), ("timm", "timm"), ("mmseg", "mmsegmentation"), ("fairseq", "fairseq"))


def _doctor_internals(adapter: str) -> tuple:
    """The internals ``pid_plugins.<adapter>`` reads (importing the adapter)."""
    if adapter == "hf":
        from .hf import internals
    elif adapter == "timm":
        from .timm import internals
    elif adapter == "mmseg":
        from .mmseg import internals
    else:
        from .fairseq import internals
    return internals.INTERNALS


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .versions import TESTED, check_version, doctor, installed_version, tested_range
    failed = 0
    for adapter, zoo in DOCTOR_ZOOS:
        version = installed_version(zoo)
        if version is None:
            print(f"{zoo}: not installed (pid_plugins.{adapter} not checked)")
            continue
        inside = check_version(zoo, version)
        print(f"{zoo} {version}: {'within' if inside else 'OUTSIDE'} the tested range {tested_range(zoo)}"
              if zoo in TESTED else f"{zoo} {version}")
        for internal, problem in doctor(_doctor_internals(adapter)):
            kind = "check and probe" if internal.probe is not None else "check"
            if problem is not None and internal.optional:
                print(f"  absent  {internal.name} ({kind}; known to hold in {internal.versions}: what needs it is "
                      f"refused under {zoo} {version})")
                continue
            print(f"  {'ok     ' if problem is None else 'CHANGED'} {internal.name} ({kind})")
            if problem is not None:
                failed += 1
                print(f"          {internal.message(problem)}")
    print(f"pid-plugins doctor: {failed} internal(s) changed" if failed else "pid-plugins doctor: every internal holds")
    return 1 if failed else 0


def _command(sub: argparse._SubParsersAction, name: str, summary: str, details: str = "",
             func: Optional[Callable[[argparse.Namespace], int]] = None) -> argparse.ArgumentParser:
    """A subcommand with its one-line summary, its description and the function that runs it."""
    description = f"{summary[0].upper()}{summary[1:]}.{' ' + details if details else ''}"
    p = sub.add_parser(name, help=summary, description=description, formatter_class=_Help)
    p.set_defaults(func=func)
    return p


def _add_model_args(p: argparse.ArgumentParser, samples: int, batch: int, out: str) -> None:
    p.add_argument("--model", action="append", required=True, help="registry/timm name, transformers folder or "
                   "mmseg config (mmengine runs it: give only configs you trust); repeat to compare models")
    p.add_argument("--checkpoint", action="append", help="local weights (.safetensors or a torch file, read with "
                   "weights_only=True) for each --model, in order")
    p.add_argument("--model-kwargs", type=lambda t: _json_object(t, "a JSON object, e.g. '{\"num_classes\": 10}'"),
                   default={}, help="JSON kwargs for models built by name, e.g. '{\"num_classes\": 10}' "
                   "(transformers folders and mmseg configs carry their own)")
    p.add_argument("--attention", action="append", metavar="METHOD", help="build the models with this attention: "
                   "softmax or a registered method; once for every --model or once per --model, in order")
    p.add_argument("--attention-cfg", action="append", type=_attention_cfg, metavar="JSON", help="parameters for "
                   "each --attention: a JSON object of overrides of its default preset, a preset name, or null")
    _add_import_arg(p)
    p.add_argument("--data", required=True, help="images: fashion-mnist, digits, auto or a <class>/<image> folder; "
                                                 "text: wiki, shakespeare or a .txt file")
    p.add_argument("--num-samples", type=_int(1), default=samples, help="images, or token blocks of text (>= 1)")
    p.add_argument("--batch-size", type=_int(1), default=batch, help="inputs per forward pass")
    p.add_argument("--seq-len", type=_int(2), default=128, help="tokens per text block (>= 2)")
    p.add_argument("--seed", type=_int(0), default=0, help="seed of the sample drawn from --data")
    p.add_argument("--out", type=_out_folder, default=Path(out), help="output folder (must not exist)")


def _add_import_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import this module first (a dotted name or a .py file), so that the attention methods it "
                        "registers can be named by --attention / --arms; repeatable")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = _Parser(prog="pid-plugins", formatter_class=_Help, description="PID-controlled attention (PIDformer, "
                     "ICML 2024) and its sibling methods in timm, transformers, mmsegmentation and fairseq: list the "
                     "model variants, show the presets, measure token collapse and robustness of models, and run a "
                     "command with the zoo adapters.")
    parser.add_argument("--version", action="version", version=f"pid-plugins {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    p = _command(sub, "list", "list the PID model variants declared in the registry",
                 "One line per variant: its name, zoo, base model and preset.", _cmd_list)
    p.add_argument("pattern", nargs="?", default="*", help="glob on the name, e.g. 'pid_deit*'")
    p.add_argument("--zoo", choices=["timm", "hf", "mmseg", "fairseq"], default=None,
                   help="only this zoo's variants (default: every zoo)")
    _command(sub, "presets", "show the paper's gains",
             "The PID presets (lambda_p, lambda_i, lambda_d, beta) of registry/presets.toml, by name.", _cmd_presets)
    p = _command(sub, "diagnose", "per-layer token collapse and attention sparsity of models, JSON + PNG",
                 func=_cmd_diagnose)
    _add_model_args(p, 64, 16, "diagnose_out")
    p.add_argument("--passes", type=_int(0), default=20, help="repeated passes of the layer stack (0 = skip)")
    p.add_argument("--layer-stack", help="dotted path of the layer stack (default: found automatically)")
    p = _command(sub, "attack", "robustness: attacks, noise, corruptions (images); noisy perplexity (LMs)",
                 func=_cmd_attack)
    _add_model_args(p, 256, 64, "attack_out")
    p.add_argument("--baseline", help="the --model the mCE is relative to (default: the first)")
    p.add_argument("--attacks", default="fgsm,pgd", help="comma list of fgsm, pgd, spsa (or none)")
    p.add_argument("--eps", type=_eps, default=3 / 255,
                   help="l_inf budget in [0, 1] pixels (PGD/FGSM without a sweep, SPSA), e.g. 3/255")
    p.add_argument("--eps-sweep", type=_number_list(0.0, 1.0, _EPS, _fraction),
                   default=[], help="comma list of eps in [0, 1] for FGSM/PGD, e.g. 1/255,2/255,3/255,4/255")
    p.add_argument("--pgd-steps", type=_int(1), default=20, help="PGD iterations")
    p.add_argument("--spsa-iters", type=_int(1), default=5, help="SPSA iterations")
    p.add_argument("--noise", type=_number_list(0.0, math.inf, "a noise sigma (>= 0)"),
                   default=[0.02, 0.05, 0.1, 0.2], help="Gaussian noise sigmas >= 0 (or none)")
    p.add_argument("--corruptions", default="default", help="default, all, none or a comma list of corrupt-tta names")
    p.add_argument("--severities", type=_severities, default=[1, 2, 3, 4, 5], help="comma list of 1..5")
    p.add_argument("--rates", type=_number_list(0.0, 1.0, "a substitution rate (0..1)"),
                   default=[0.0, 0.05, 0.1, 0.2], help="token substitution rates in [0, 1] (language models)")
    _command(sub, "doctor", "check the installed zoos' internals the adapters read (for a new zoo release)",
             "Every internal of every installed zoo: its check (types, signatures, source text) and, where it has "
             "one, its probe (the zoo's part and the method's compared on tiny models). Exit 1 if one changed.",
             _cmd_doctor)
    _command(sub, "run", "run a command with the zoo adapters in every Python process it starts",
             "pid-plugins run [--adapters hf,timm,...] -- COMMAND ARGS... (see `pid-plugins run --help`)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; a mistake the user can fix prints one ``pid-plugins: error: ...`` line and returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from .launch import main as run_main
        return run_main(argv[1:])
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace, name: str = _Parser.NAME) -> int:
    """Run a parsed command; a mistake the user can fix is one ``NAME: error: ...`` line and 2."""
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{name}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
