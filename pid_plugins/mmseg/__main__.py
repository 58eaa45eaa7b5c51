"""``python -m pid_plugins.mmseg``: prints the folder of the shipped mmseg configs, for an absolute ``_base_``."""
from . import CONFIGS

print(CONFIGS)
