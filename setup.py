"""Ships pid_plugins_fairseq_compat.pth into site-packages (project metadata lives in pyproject.toml).

The .pth line imports pid_plugins_fairseq_compat at interpreter start-up, so stock fairseq-train /
fairseq-eval-lm / fairseq-generate and pytest's hydra plugin import on Python 3.11.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "pid_plugins_fairseq_compat.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
