"""No checkpoint load path runs pickled code, with and without TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1: a file whose object
would create a marker when unpickled is refused, saying why, in a fresh process (mmseg's paths: test_mmseg.py;
transformers folders: test_hf.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pyexec import run_python_c

ENV_SETTINGS = [pytest.param({}, id="default"), pytest.param({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, id="forced")]


class Evil:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_checkpoint(path: Path, marker: Path, payload=None) -> Path:
    state = dict(payload or {})
    state["evil"] = Evil(marker)
    torch.save(state, path)
    return path


def python(code: str, env_extra: dict, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    env.update(env_extra)
    # the run's own environment: python -c forked from tests/pyexec.py's zygote (the zoos imported, pid_plugins
    # never: the probes' own imports register the plugin, as in a user's fresh interpreter); another environment
    # (the variable set): a fresh interpreter, as a zygote of its own would be started for this one call
    return run_python_c(code, cwd=cwd, env=env, timeout=600, fork=None if not env_extra else False)


def test_the_marker_works(tmp_path):
    """The payload really runs when a file is unpickled without protection (so the tests below can fail)."""
    marker = tmp_path / "pwned"
    path = evil_checkpoint(tmp_path / "evil.pt", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


# each probe loads the evil file one way and prints a JSON line {"path": ..., "error": ...}
PROBES = {
    "timm pretrained file": (
        "import timm, pid_plugins.timm\n"
        "timm.create_model('pid_deit_tiny_patch16_224', pretrained=True, pretrained_cfg_overlay=dict(file=EVIL))\n"
    ),
    "timm load_checkpoint": (
        "import timm, pid_plugins.timm\n"
        "timm.models.load_checkpoint(timm.create_model('pid_deit_tiny_patch16_224'), EVIL)\n"
    ),
    "analysis load_weights": (
        "import timm, pid_plugins.timm\nfrom pid_plugins.analysis.models import load_weights\n"
        "load_weights(timm.create_model('pid_deit_tiny_patch16_224'), EVIL)\n"
    ),
    "analysis mmseg config --checkpoint": (
        "from pathlib import Path\nfrom pid_plugins.analysis.models import load_model\n"
        "load_model(str(Path(REPO) / 'configs/mmseg/segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py'), "
        "checkpoint=EVIL)\n"
    ),
    "fairseq load_pid_lm": (
        "import pid_plugins.fairseq as pf\npf.load_pid_lm(EVIL, DATA)\n"
    ),
    "fairseq checkpoint_utils": (
        "import pid_plugins.fairseq\nfrom fairseq import checkpoint_utils\ncheckpoint_utils.load_checkpoint_to_cpu(EVIL)\n"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("env_extra", ENV_SETTINGS)
def test_python_load_paths_refuse_pickled_code(tmp_path, env_extra):
    marker = tmp_path / "pwned"
    evil = evil_checkpoint(tmp_path / "evil.pth", marker, {"model": {"w": torch.zeros(2)}})
    data = tmp_path / "data-bin"
    data.mkdir()
    (data / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(10)))
    repo = Path(__file__).resolve().parents[2]
    code = ["import json, sys", f"EVIL, DATA, REPO = {str(evil)!r}, {str(data)!r}, {str(repo)!r}", "out = {}"]
    for name, probe in PROBES.items():
        code += [
            "try:",
            *("    " + line for line in probe.splitlines()),
            f"    out[{name!r}] = 'loaded'",
            "except Exception as exc:",
            f"    out[{name!r}] = type(exc).__name__ + ': ' + str(exc)",
            f"out[{name!r} + ' marker'] = __import__('os').path.exists({str(marker)!r})",
        ]
    code.append("print('RESULT ' + json.dumps(out))")
    proc = python("\n".join(code), env_extra, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert not marker.exists()
    for name in PROBES:
        assert out[f"{name} marker"] is False, name
        error = out[name]
        assert error != "loaded", name
        # the error says what was refused: torch's weights-only message naming the blocked global
        assert "posix.system" in error or "os.system" in error, (name, error)
    assert out["fairseq load_pid_lm"].startswith("UnsafeCheckpointError: refused to load")
    assert "whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says" in out["fairseq checkpoint_utils"]


@pytest.fixture
def data_bin(tiny_fairseq_data_bin):
    """A binarised corpus for fairseq-train to start on (the session's tiny one, tests/conftest.py)."""
    return tiny_fairseq_data_bin


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("env_extra", ENV_SETTINGS)
def test_fairseq_train_refuses_a_pickled_checkpoint(tmp_path, env_extra, data_bin):
    """fairseq-train --finetune-from-model through --user-dir (fairseq's own CLI and checkpoint_utils)."""
    import pid_plugins.fairseq as pf

    marker = tmp_path / "pwned"
    evil = evil_checkpoint(tmp_path / "evil.pt", marker, {"model": {}, "args": None, "cfg": None})
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    env.update(env_extra)
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "fairseq-train"), str(data_bin), "--task", "language_modeling", "--user-dir",
         pf.USER_DIR, "--arch", "transformer_lm_pid", "--decoder-layers", "1", "--decoder-embed-dim", "16",
         "--decoder-ffn-embed-dim", "16", "--decoder-attention-heads", "2", "--tokens-per-sample", "16",
         "--max-tokens", "64", "--optimizer", "adam", "--lr", "0.001", "--max-update", "1", "--cpu",
         "--num-workers", "0", "--save-dir", str(tmp_path / "ck"), "--finetune-from-model",
         str(evil)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "UnsafeCheckpointError: refused to load" in proc.stderr
    assert not marker.exists()


def test_fairseq_safe_load_keeps_namespace_args(tmp_path):
    """Checkpoints from before fairseq's hydra configs carry ``args`` as an argparse.Namespace: still loadable."""
    import argparse

    from pid_plugins.fairseq.checkpoint import safe_torch_load

    path = tmp_path / "old.pt"
    torch.save({"args": argparse.Namespace(arch="transformer_lm_pid", pid_beta=0.3), "model": {"w": torch.ones(2)}},
               path)
    state = safe_torch_load(str(path), map_location="cpu")
    assert state["args"].pid_beta == 0.3 and torch.equal(state["model"]["w"], torch.ones(2))
