"""``python -m pid_plugins.fairseq`` prints the directory to pass to fairseq's ``--user-dir``."""
import os

print(os.path.join(os.path.dirname(__file__), "user_dir", "pid_fairseq"))
