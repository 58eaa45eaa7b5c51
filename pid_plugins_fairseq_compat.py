"""Lets fairseq 0.12.2 and hydra-core 1.0.7 import on Python 3.11+.

Python 3.11 refuses a dataclass field whose default is an unhashable object ("mutable default ... use
default_factory"); fairseq's and hydra's config dataclasses use instances of other (eq=True, so unhashable)
dataclasses as defaults (fairseq issue #5012, fixed after its last release). This gives exactly those
default objects' classes an identity ``__hash__`` while their owner class is being processed, so the
defaults stay shared as on Python 3.10. Only classes defined in ``fairseq``, ``fairseq_cli``, ``hydra``
and ``pid_plugins.fairseq`` are touched; on Python < 3.11 nothing is installed.

Nothing installs it but the user: ``install()`` in a process before fairseq is imported, or, for fairseq's own
commands (``fairseq-train``, ...) and pytest's hydra plugin, which import fairseq or hydra before any plugin code,
from interpreter start, by one command in the environment that has the fairseq extra (``import
pid_plugins.fairseq`` without it stops with an ImportError naming both)::

    python -m pid_plugins_fairseq_compat install     # writes pid_plugins_fairseq_compat.pth into site-packages
    python -m pid_plugins_fairseq_compat uninstall   # removes it; `status` says whether it is there and active

Nothing is written by installing the package: an environment without that command starts its interpreters with
the standard library untouched. Kept free of imports beyond the standard library (the .pth imports it at start).
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import sysconfig

SCOPE = ("fairseq.", "fairseq_cli.", "hydra.", "pid_plugins.fairseq")


def _in_scope(module: str) -> bool:
    return module.startswith(SCOPE) or module in ("fairseq", "fairseq_cli", "hydra")


def python_get_field():
    """Python's own ``dataclasses._get_field`` (the one under the hook once it is installed), or None."""
    current = getattr(dataclasses, "_get_field", None)
    if getattr(current, "_pid_plugins_compat", False) and not hasattr(current, "_pid_plugins_original"):
        # the hook of an earlier pid-plugins (started from its .pth): Python's function is the one it closed over
        cells = dict(zip(current.__code__.co_freevars, current.__closure__ or ()))
        return cells["original"].cell_contents if "original" in cells else current
    return getattr(current, "_pid_plugins_original", current)


def target_holds() -> bool:
    """Whether ``dataclasses._get_field`` is still called as ``(cls, a_name, a_type, ...)``, as the hook calls it
    (Python 3.11 - 3.13). :func:`install` (also run at interpreter start) checks this, and installs nothing otherwise;
    ``pid_plugins.fairseq`` also checks, by calling Python's function, that it still refuses a default whose class is
    unhashable, the rule the hook relaxes (:data:`pid_plugins.fairseq.internals.DATACLASS_FIELD`)."""
    try:
        return list(inspect.signature(python_get_field()).parameters)[:3] == ["cls", "a_name", "a_type"]
    except (TypeError, ValueError):  # not a Python function any more
        return False


def install() -> bool:
    """Install the hook (idempotent). Returns True if it is active; False on Python < 3.11, or when
    ``dataclasses._get_field`` no longer looks as the hook expects (then nothing is installed)."""
    if sys.version_info < (3, 11):
        return False
    original = getattr(dataclasses, "_get_field", None)
    if getattr(original, "_pid_plugins_compat", False):
        return True
    if not target_holds():
        return False

    def _get_field(cls, a_name, a_type, *args, **kwargs):
        if _in_scope(getattr(cls, "__module__", "")):
            default = cls.__dict__.get(a_name, dataclasses.MISSING)
            if isinstance(default, dataclasses.Field):
                default = default.default
            default_cls = type(default)
            if (dataclasses.is_dataclass(default) and not isinstance(default, type)
                    and default_cls.__hash__ is None and _in_scope(default_cls.__module__)):
                default_cls.__hash__ = object.__hash__
        return original(cls, a_name, a_type, *args, **kwargs)

    _get_field._pid_plugins_compat = True
    _get_field._pid_plugins_original = original
    dataclasses._get_field = _get_field
    return True


def pth_path() -> str:
    """Where the start-up hook goes: this interpreter's site-packages (purelib)."""
    return os.path.join(sysconfig.get_paths()["purelib"], PTH)


PTH = "pid_plugins_fairseq_compat.pth"


def main(argv: "list[str] | None" = None) -> int:
    """``python -m pid_plugins_fairseq_compat install|uninstall|status``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("install", "uninstall", "status"):
        print("usage: python -m pid_plugins_fairseq_compat install|uninstall|status\n"
              "install: start the fairseq/hydra Python 3.11 hook in every interpreter of this environment "
              f"(writes {pth_path()})", file=sys.stderr)
        return 2
    path = pth_path()
    if args[0] == "install":
        with open(path, "w") as f:
            f.write("import pid_plugins_fairseq_compat; pid_plugins_fairseq_compat.install()\n")
        print(f"installed {path}: fairseq and hydra import on Python 3.11 from interpreter start")
    elif args[0] == "uninstall":
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}")
        else:
            print(f"not installed ({path} does not exist)")
    else:
        active = getattr(dataclasses._get_field, "_pid_plugins_compat", False)
        print(f"{'installed' if os.path.exists(path) else 'not installed'}: {path}; active in this interpreter: "
              f"{active}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
