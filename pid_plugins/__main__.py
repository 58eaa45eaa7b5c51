"""``python -m pid_plugins``: the ``pid-plugins`` command line (:mod:`pid_plugins.research.cli`)."""
from .research.cli import main

raise SystemExit(main())
