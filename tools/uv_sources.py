"""Print the uv options that give uv the package sources pip is configured with.

uv reads no pip configuration, and pip's (``pip.conf`` files and ``PIP_*`` variables) is where a machine names its
local indexes and wheel folders: on this project's machines, the ones that hold torch's builds. The Makefile passes
these options to ``uv pip install``: the same indexes and find-links, and pip's rule of taking the best match from
any of them (``--index-strategy unsafe-best-match``; every version is pinned in constraints.txt), so uv installs the
files pip would. Prints nothing but the strategy when pip has no such configuration.
"""
from __future__ import annotations

import shlex
import subprocess
import sys

#: pip option -> uv option
OPTIONS = {"index-url": "--default-index", "extra-index-url": "--index", "find-links": "--find-links"}


def uv_options(pip_config: str) -> list[str]:
    """uv options from ``pip config list`` output (``scope.name='value'`` lines; a value may hold several
    space-separated entries). As in pip, the environment's value of an option replaces the files', and a file listed
    later replaces an earlier one."""
    found: dict[str, dict[str, list[str]]] = {}
    for line in pip_config.splitlines():
        key, sep, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if sep and name in OPTIONS:
            found.setdefault(name, {})[scope] = " ".join(shlex.split(value)).split()
    options = ["--index-strategy", "unsafe-best-match"]
    for name, flag in OPTIONS.items():
        scopes = found.get(name, {})
        values = scopes.get(":env:") or (list(scopes.values())[-1] if scopes else [])
        for value in dict.fromkeys(values[-1:] if name == "index-url" else values):  # one default index
            options += [flag, value]
    return options


if __name__ == "__main__":
    # no pip, or a configuration pip cannot read: only the strategy (uv then uses PyPI alone)
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    config = proc.stdout if proc.returncode == 0 else ""
    print(shlex.join(uv_options(config)))
