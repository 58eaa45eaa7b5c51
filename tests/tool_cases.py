"""Shared by the after-training tests (tests/zoos/*/test_tools_*.py): :func:`launch` runs ``python -m pid_plugins run
[--adapters ...] -- COMMAND`` in a fresh offline process with this checkout first on ``PYTHONPATH``; :func:`tools_env`
is ``.cache/tools-env`` (``make tools-env``: lm-eval and TRL), whose absence skips, quoting the failed install."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS_ENV = ROOT / ".cache" / "tools-env"
BIN = Path(sys.executable).parent

#: the characters of the tiny tokenizer (one token each) after its special tokens
CHARS = " abcdefghijklmnopqrstuvwxyz.,"


def tools_env() -> Path:
    """``.cache/tools-env`` once ``make tools-env`` has installed it; a skip naming why otherwise."""
    if (TOOLS_ENV / ".installed").is_file():
        return TOOLS_ENV
    failed = TOOLS_ENV.with_name("tools-env.failed")
    if failed.is_file():
        pytest.skip("lm-eval / TRL did not install (make tools-env): " + failed.read_text()[-1500:])
    pytest.skip("lm-eval / TRL are not installed: run `make tools-env` (constraints-tools.txt into .cache/tools-env)")


def env(extra_path: Sequence[Path] = (), **overrides: str) -> Dict[str, str]:
    """The environment a user's shell would have: this checkout importable, the venv's (and ``extra_path``'s
    ``bin/``) commands on PATH, offline, quiet."""
    environ = dict(os.environ)
    for name in ("PYTHONPATH", "PID_PLUGINS_ADAPTERS"):
        environ.pop(name, None)
    environ["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(ROOT)])
    environ["PATH"] = os.pathsep.join([*(str(p / "bin") for p in extra_path), str(BIN), environ.get("PATH", "")])
    environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   WANDB_DISABLED="true", HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1", PYTHONWARNINGS="ignore")
    environ.update(overrides)
    return environ


def launch(command: Sequence[str], cwd: Path, adapters: Optional[str] = None, extra_path: Sequence[Path] = (),
           timeout: float = 600, launcher: bool = True, **overrides: str) -> subprocess.CompletedProcess:
    """``pid-plugins run [--adapters A] -- command`` (or the bare command with ``launcher=False``) in ``cwd``."""
    prefix = [sys.executable, "-m", "pid_plugins", "run", *(["--adapters", adapters] if adapters else []), "--"]
    cmd = [*(prefix if launcher else []), *map(str, command)]
    environ = env(extra_path, HF_HOME=str(cwd / "hf_home"), HF_DATASETS_CACHE=str(cwd / "hf_datasets"), **overrides)
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


def save_tokenizer(folder: Path):
    """A character-level fast tokenizer (no downloads), saved into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.save_pretrained(folder)
    return tok


def save_pid_llama(folder: Path):
    """A tiny PID Llama (random weights, large enough init that PID and softmax differ clearly), saved with
    ``save_pretrained`` beside its tokenizer; returns the model (eval)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf  # noqa: F401

    tok = save_tokenizer(folder)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    model.save_pretrained(folder)
    return model


def hf_pair(folder: Path):
    """(the checkpoint loaded as saved with the plugin: PID, the same weights as stock SDPA: softmax), eval."""
    from transformers import AutoModelForCausalLM

    import pid_plugins.hf  # noqa: F401

    pid = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert pid.config._attn_implementation == "pid"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plugin warns that the folder records a method: that is the point here
        softmax = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return pid, softmax


def read_json(path: Path):
    return json.loads(Path(path).read_text())
