"""Ships pid_plugins_fairseq_compat.pth into site-packages and lists the packages (metadata: pyproject.toml).

Packages are discovered, not listed by hand: every folder under ``pid_plugins/`` (namespace discovery, so the
fairseq ``--user-dir`` folder ``pid_plugins/fairseq/user_dir``, which has no ``__init__.py``, is included),
plus ``pid_plugins.registry`` (the top-level ``registry/`` folder, mapped in pyproject.toml).

The .pth line imports pid_plugins_fairseq_compat at interpreter start-up, so stock fairseq-train /
fairseq-eval-lm / fairseq-generate and pytest's hydra plugin import on Python 3.11.
"""
import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

PTH = "pid_plugins_fairseq_compat.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


PACKAGES = find_namespace_packages(include=["pid_plugins", "pid_plugins.*"], exclude=["*.__pycache__"])

setup(packages=PACKAGES + ["pid_plugins.registry"], cmdclass={"build_py": BuildPyWithPth})
