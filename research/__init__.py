"""The experiments beside the package (as timm keeps ``train.py`` beside ``timm``): the demo, the reproduction over
seeds and the study (``python -m research demo|reproduce|study`` from the repository root; ``make demo``), their
experiment drivers, and the loaders of the weights and data only they and the tests use (SmolLM2, MiniLM, a tiny
ADE20K-like set). Not part of the ``pid-plugins`` wheel; ``pid_plugins`` never imports it.

Importing ``research`` imports nothing else; each module imports what it needs.
"""
