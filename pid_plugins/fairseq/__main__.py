"""``python -m pid_plugins.fairseq`` prints the directory to pass to fairseq's ``--user-dir``, and nothing else.

The path is this file's neighbour: no fairseq (nor deepspeed, which fairseq imports) is imported to know it, and the
package's ``__init__`` skips the adapter under this command (``pid_plugins._entry.finding_main``), so whatever is
installed, stdout is that one line (``--user-dir "$(python -m pid_plugins.fairseq)"``).
"""
import os

print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_dir", "pid_fairseq"))
