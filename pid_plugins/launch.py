"""``pid-plugins run -- COMMAND``: the command ``exec``'d with :mod:`pid_plugins.launch_site` first on
``PYTHONPATH`` and the adapters named in ``PID_PLUGINS_ADAPTERS``."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

from .launch_site.sitecustomize import ADAPTERS, ENV_VAR, HERE as SITE_DIR

__all__ = ["ADAPTERS", "ENV_VAR", "SITE_DIR", "LaunchError", "default_adapters", "parse_adapters", "environment",
           "resolve_command", "run", "main"]

USAGE = "pid-plugins run [--adapters NAME[,NAME...]] [--] COMMAND [ARGS...]"

HELP = f"""usage: {USAGE}

Run a command with the zoo adapters in every Python process it starts (COMMAND's own interpreter, and workers that
accelerate launch or torchrun start): each imports an adapter right after its zoo. Nothing outside the command changes.

options:
  --adapters NAMES  comma list of {', '.join(ADAPTERS)} (default: every adapter whose zoo is installed here)
  -h, --help        show this help and exit

example: pid-plugins run -- lm_eval --model hf --model_args pretrained=DIR --tasks TASK
"""


class LaunchError(ValueError):
    """A mistake in ``pid-plugins run``'s command line (no command, unknown adapter, command not found)."""


def default_adapters() -> List[str]:
    """Every adapter whose zoo is installed in this interpreter (found without importing it)."""
    return [name for name, (_, zoo) in ADAPTERS.items() if importlib.util.find_spec(zoo) is not None]


def parse_adapters(text: str) -> List[str]:
    """``"hf,timm"`` -> ``["hf", "timm"]``, each known and its zoo installed."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise LaunchError(f"--adapters needs at least one of {', '.join(ADAPTERS)}")
    unknown = [n for n in names if n not in ADAPTERS]
    if unknown:
        raise LaunchError(f"unknown adapter {', '.join(map(repr, unknown))} in --adapters (known: "
                          f"{', '.join(ADAPTERS)})")
    missing = [n for n in names if importlib.util.find_spec(ADAPTERS[n][1]) is None]
    if missing:
        raise LaunchError("; ".join(f"the {n} adapter needs {ADAPTERS[n][1]}, which is not installed in "
                                    f"{sys.executable}" for n in missing))
    return list(dict.fromkeys(names))


def environment(adapters: Sequence[str], base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``base`` (default: ``os.environ``) with :data:`SITE_DIR` first on ``PYTHONPATH`` and ``adapters`` named."""
    env = dict(os.environ if base is None else base)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *rest])
    env[ENV_VAR] = ",".join(adapters)
    return env


def resolve_command(command: Sequence[str], env: Mapping[str, str]) -> str:
    """The executable ``command[0]`` names: a path, or a name looked up on the command's ``PATH``."""
    if not command:
        raise LaunchError(f"no command to run; usage: {USAGE}")
    program = command[0]
    if os.sep in program or (os.altsep and os.altsep in program):
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise LaunchError(f"command not found: {program} (no executable file there)")
        return program
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise LaunchError(f"command not found: {program} (not on PATH)")
    return found


def run(command: Sequence[str], adapters: Optional[Sequence[str]] = None) -> NoReturn:
    """Replace this process with ``command``, run with ``adapters`` (on Windows: a child, its exit code returned)."""
    env = environment(list(default_adapters() if adapters is None else adapters))
    program = resolve_command(command, env)
    sys.stdout.flush(), sys.stderr.flush()
    if os.name == "nt":  # pragma: no cover
        raise SystemExit(subprocess.call([program, *command[1:]], env=env))
    os.execve(program, list(command), env)


def parse_args(argv: Sequence[str]) -> Tuple[Optional[List[str]], List[str], bool]:
    """``[--adapters NAMES] [--] COMMAND ...`` -> (adapters or None for the default, command, help asked)."""
    argv = list(argv)
    adapters: Optional[List[str]] = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return adapters, argv[i + 1:], False
        if arg in ("-h", "--help"):
            return adapters, [], True
        if arg == "--adapters" or arg.startswith("--adapters="):
            if "=" not in arg and i + 1 >= len(argv):
                raise LaunchError("--adapters needs a value, e.g. --adapters hf,timm")
            adapters = parse_adapters(arg.split("=", 1)[1] if "=" in arg else argv[i + 1])
            i += 1 if "=" in arg else 2
            continue
        if arg.startswith("-"):
            raise LaunchError(f"unknown option {arg!r}; put the command after `--`: {USAGE}")
        return adapters, argv[i:], False
    return adapters, [], False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``pid-plugins run ...`` (``argv`` without ``run``); returns 2 with one error line for a mistake."""
    try:
        adapters, command, wants_help = parse_args(sys.argv[1:] if argv is None else argv)
        if wants_help:
            print(HELP, end="")
            raise SystemExit(0)
        run(command, adapters)
    except LaunchError as exc:
        print(f"pid-plugins run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
