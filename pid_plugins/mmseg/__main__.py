"""``python -m pid_plugins.mmseg``: prints the folder of the shipped mmseg configs (one line), for an absolute
``_base_``. :data:`CONFIGS` is set before the package's ``__init__`` imports mmseg, which it skips under this command
(``pid_plugins._entry.finding_main``): no mmseg, mmengine nor deepspeed is imported, so stdout is only the folder."""
from . import CONFIGS

print(CONFIGS)
