"""``python -m pid_plugins.fairseq`` prints the directory for fairseq's ``--user-dir`` (importing no fairseq)."""
import os

print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_dir", "pid_fairseq"))
