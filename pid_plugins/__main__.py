"""``python -m pid_plugins``: the ``pid-plugins`` command line (:mod:`pid_plugins.cli`); ``run`` goes straight to
:mod:`pid_plugins.launch`."""
import sys

if sys.argv[1:2] == ["run"]:
    from .launch import main as run_main

    raise SystemExit(run_main(sys.argv[2:]))

from .cli import main  # noqa: E402

raise SystemExit(main())
