"""The shipped mmseg configs, installed as ``pid_plugins.mmseg.configs`` (see pyproject.toml).

Their folder is :data:`pid_plugins.mmseg.CONFIGS` (``python -m pid_plugins.mmseg`` prints it): inherit one with an
absolute ``_base_`` (mmengine joins a config's ``_base_`` to its own folder, and an absolute path stays as it is).
"""
