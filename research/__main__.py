"""``python -m research``: the demo, reproduce and study commands (:mod:`research.cli`)."""
from .cli import main

raise SystemExit(main())
