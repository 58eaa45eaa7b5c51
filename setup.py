"""Lists the packages (metadata: pyproject.toml).

Packages are discovered, not listed by hand: every folder under ``pid_plugins/`` (namespace discovery, so the
fairseq ``--user-dir`` folder ``pid_plugins/fairseq/user_dir``, which has no ``__init__.py``, is included),
plus ``pid_plugins.registry`` (the top-level ``registry/`` folder) and ``pid_plugins.mmseg.configs`` (the shipped
mmseg configs, ``configs/mmseg/``), both mapped in pyproject.toml. The experiments beside the package
(``research/``: demo, reproduce, study) are not packaged.

Nothing is installed that runs at interpreter start: the fairseq Python 3.11 hook is an opt-in command
(``python -m pid_plugins_fairseq_compat install``, see that module).
"""
from setuptools import find_namespace_packages, setup

PACKAGES = find_namespace_packages(include=["pid_plugins", "pid_plugins.*"], exclude=["*.__pycache__"])

setup(packages=PACKAGES + ["pid_plugins.registry", "pid_plugins.mmseg.configs"])
