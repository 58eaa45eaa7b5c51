"""``python -m pid_plugins.<adapter>`` printing a path: whether the adapter's package is being imported only to find
its ``__main__``, so that it can stop before importing its zoo. Standard library only."""
import sys


def finding_main(package_name: str) -> bool:
    """Whether this import is ``python -m <package_name>`` looking for its ``__main__`` (``sys.argv[0]`` is still
    ``"-m"``): such a command prints only a path, so the package stops before importing its zoo (whose import may
    print DeepSpeed's accelerator line on stdout)."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(sys, "orig_argv", []))[1:]
    for i, arg in enumerate(argv):  # the interpreter's options end at -m MODULE (or -mMODULE)
        if arg.startswith("-m"):
            return (arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")) == package_name
    return False
