"""The catalogue of PID model variants and presets, as data.

Installed as the package ``pid_plugins.registry`` (see pyproject.toml) and read through
``importlib.resources`` by :mod:`pid_plugins.catalogue`. One TOML file per zoo declares its variants;
``presets.toml`` declares the paper's gains. This is the one place a PID variant is declared.
"""
