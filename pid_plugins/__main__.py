"""``python -m pid_plugins``: the ``pid-plugins`` command line (:mod:`pid_plugins.cli`)."""
from .cli import main

raise SystemExit(main())
