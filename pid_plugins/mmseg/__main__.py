"""``python -m pid_plugins.mmseg``: prints the folder of the shipped mmseg configs (:data:`pid_plugins.mmseg.CONFIGS`),
for an absolute ``_base_`` in a config of your own."""
from . import CONFIGS

print(CONFIGS)
