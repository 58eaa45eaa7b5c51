"""``python -m pid_plugins.fairseq``."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fairseq")
import pid_plugins.fairseq as pf  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
README = ROOT / "README.md"


def users_env() -> dict:
    """This environment as a user's shell has it: no ``DS_ACCELERATOR``, this venv's commands first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_python_m_prints_only_the_user_dir_and_imports_neither_fairseq_nor_deepspeed():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pid_plugins.fairseq"], cwd=ROOT,
                          env=users_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and proc.stdout == lines[0] + "\n", proc.stdout
    assert Path(lines[0]).is_dir() and (Path(lines[0]) / "__init__.py").is_file()
    assert Path(lines[0]).samefile(pf.USER_DIR)
    imported = {m.group(1) for m in re.finditer(r"^import time:[^|]*\|[^|]*\|\s*([\w.]+)\s*$", proc.stderr, re.M)}
    assert "pid_plugins.fairseq" in imported  # -X importtime did list the imports
    assert not {name for name in imported if name.split(".")[0] in ("fairseq", "deepspeed")}


def readme_fairseq_train() -> str:
    """The README's first ``fairseq-train`` command (its fairseq section's bash block), continuation lines joined."""
    section = README.read_text().split("\n## fairseq\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    command = block.replace("\\\n", " ")
    (line,) = [ln for ln in command.splitlines() if ln.startswith("fairseq-train data-bin/x ")][:1]
    return re.sub(r"\s+", " ", line).strip()


@pytest.mark.integration
@pytest.mark.slow
def test_the_readmes_fairseq_train_command_runs_as_written(tmp_path, tiny_fairseq_data_bin):
    """Through bash, as written, on the tiny corpus (for ``data-bin/x``) and a two-update tiny model (for ``...``),
    with deepspeed installed and no DS_ACCELERATOR; the checkpoint holds the README's gains."""
    pytest.importorskip("deepspeed", reason="the defect this guards against needs deepspeed installed")
    command = readme_fairseq_train()
    assert '--user-dir "$(python -m pid_plugins.fairseq)"' in command and command.endswith(" ..."), command
    gains = json.loads(re.search(r"--attention-cfg '([^']*)'", command).group(1))
    tiny = ("--decoder-layers 2 --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-attention-heads 4 "
            "--tokens-per-sample 16 --max-tokens 128 --optimizer adam --lr 0.001 --max-update 2 --cpu "
            "--num-workers 0 --save-dir ck --no-epoch-checkpoints")
    command = command.replace("data-bin/x", str(tiny_fairseq_data_bin), 1)[:-len("...")] + tiny
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=users_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "model: PIDTransformerLanguageModel" in proc.stdout + proc.stderr
    import torch

    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert json.loads(state["cfg"]["model"]["attention_cfg"]) == gains
    assert state["cfg"]["common"]["user_dir"] == pf.USER_DIR or Path(state["cfg"]["common"]["user_dir"]).samefile(
        pf.USER_DIR)
