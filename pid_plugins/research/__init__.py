"""Research tools around the product: the ``pid-plugins`` command line, the demo, the reproduction and study
experiments, offline datasets and the analysis tools (collapse measures, per-layer diagnostics, robustness).

The product (``pid_plugins.core``, the zoo adapters and the catalogue) never imports this package, so the
adapters ship without these tools' dependencies (matplotlib, scikit-learn, corrupt-tta, torchattacks, ...).
Importing ``pid_plugins.research`` imports nothing else; each module imports what it needs.
"""
