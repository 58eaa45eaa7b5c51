"""mmseg checkpoint loading never runs pickled code (init_cfg, load_from, resume), whatever the environment says."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmseg")
import pid_plugins.mmseg  # noqa: E402,F401
from pyexec import run_python_c, run_python_script  # noqa: E402
from pid_plugins.mmseg.checkpoint import UnsafeCheckpointError, WeightsOnlyCheckpointHook, weights_only_schemes  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
ENVS = [pytest.param({}, id="default"), pytest.param({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, id="force-no-wo")]


class Payload:
    """Writes ``marker`` when unpickled by a plain unpickler."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


class _Ref:
    def __init__(self, reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce


def getattr_escape(marker):
    """Reaches ``exec`` with nothing but ``getattr`` and torch's own allowed ``_rebuild_from_type_v2``."""
    builtins = _Ref((getattr, (getattr, "__self__")))
    exec_fn = _Ref((getattr, (builtins, "exec")))
    code = f"open({str(marker)!r}, 'w').write('code ran')"
    return _Ref((torch._tensor._rebuild_from_type_v2, (exec_fn, torch.Tensor, (code,), {})))


def backbone_weights():
    from mmseg.models.backbones import VisionTransformer

    vit = VisionTransformer(img_size=(32, 32), patch_size=16, embed_dims=24, num_layers=1, num_heads=2)
    return vit.state_dict()


@pytest.fixture
def evil(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": backbone_weights(), "meta": {"x": Payload(marker)}}, path)
    return path, marker


def test_the_payload_is_armed(evil, monkeypatch):
    """Guards the tests below: a plain torch.load with the variable set does run the payload."""
    path, marker = evil
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning, match="forcing weights_only=False"):
        torch.load(path)
    assert marker.read_text() == "code ran"


@pytest.mark.parametrize("env", ENVS)
def test_init_cfg_pretrained_refuses_pickled_code(evil, env, monkeypatch):
    from mmseg.registry import MODELS

    path, marker = evil
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    model = MODELS.build(dict(type="PIDVisionTransformer", img_size=(32, 32), patch_size=16, embed_dims=24,
                              num_layers=1, num_heads=2, init_cfg=dict(type="Pretrained", checkpoint=str(path))))
    with pytest.raises(UnsafeCheckpointError, match="refused to load checkpoint .*weights_only=True"):
        model.init_weights()
    assert not marker.exists()


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("entry", ["_load_checkpoint", "load_checkpoint", "CheckpointLoader"])
def test_mmengine_loaders_refuse_pickled_code(evil, env, entry, monkeypatch):
    """What Runner.load_checkpoint / Runner.resume (load_from, --resume, tools/test.py) call."""
    from mmengine.runner import checkpoint as mm

    path, marker = evil
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    calls = {
        "_load_checkpoint": lambda: mm._load_checkpoint(str(path), map_location="cpu"),
        "load_checkpoint": lambda: mm.load_checkpoint(torch.nn.Linear(1, 1), str(path), map_location="cpu"),
        "CheckpointLoader": lambda: mm.CheckpointLoader.load_checkpoint(str(path), map_location="cpu"),
    }
    with weights_only_schemes(), pytest.raises(UnsafeCheckpointError, match="Payload|exec"):
        calls[entry]()
    assert not marker.exists()


@pytest.mark.parametrize("env", ENVS)
def test_http_checkpoints_are_weights_only_too(evil, env, tmp_path, monkeypatch):
    """init_cfg/load_from may name a URL: downloaded by torch.hub and loaded weights-only."""
    import functools
    import http.server
    import threading

    from mmengine.runner import checkpoint as mm

    path, marker = evil
    torch.save({"state_dict": {"w": torch.arange(3.0)}}, path.parent / "good.pth")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)  # the server is local
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(path.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with weights_only_schemes():
            base = f"http://127.0.0.1:{server.server_address[1]}"
            good = mm._load_checkpoint(f"{base}/good.pth", map_location="cpu")
            assert torch.equal(good["state_dict"]["w"], torch.arange(3.0))
            with pytest.raises(UnsafeCheckpointError, match="refused to load checkpoint 'http"):
                mm._load_checkpoint(f"{base}/evil.pth", map_location="cpu")
    finally:
        server.shutdown()
    assert not marker.exists()


@pytest.mark.slow
def test_import_leaves_mmengine_and_torch_as_they_were():
    """``import pid_plugins.mmseg`` changes neither mmengine's CheckpointLoader table nor torch's safe globals (in a
    ``python -c`` forked from tests/pyexec.py's zygote: mmengine and mmseg imported, pid_plugins not)."""
    script = (
        "import torch\n"
        "from mmengine.runner.checkpoint import CheckpointLoader\n"
        "before = dict(CheckpointLoader._schemes), list(torch.serialization.get_safe_globals())\n"
        "import pid_plugins.mmseg\n"
        "after = dict(CheckpointLoader._schemes), list(torch.serialization.get_safe_globals())\n"
        "print(before == after, sorted({f.__module__ for f in after[0].values()}))\n"
    )
    proc = run_python_c(script, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "True ['mmengine.runner.checkpoint']"


def test_the_hook_scopes_weights_only_loading_to_the_run(evil, monkeypatch):
    """Between the runner's before_run and after_run every scheme is ours; after it, mmengine's table exactly."""
    from mmengine.runner.checkpoint import CheckpointLoader, _load_checkpoint

    path, marker = evil
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    stock = dict(CheckpointLoader._schemes)
    assert {f.__module__ for f in stock.values()} == {"mmengine.runner.checkpoint"}
    hook = WeightsOnlyCheckpointHook()
    hook.before_run(runner=None)
    try:
        assert {f.__module__ for f in CheckpointLoader._schemes.values()} == {"pid_plugins.mmseg.checkpoint"}
        with pytest.raises(UnsafeCheckpointError):
            _load_checkpoint(str(path), map_location="cpu")
    finally:
        hook.after_run(runner=None)
    assert CheckpointLoader._schemes == stock and not marker.exists()
    from mmengine.logging import HistoryBuffer

    buffer = HistoryBuffer()
    buffer.update(0.5)
    torch.save({"hub": buffer}, path.parent / "hub.pth")
    with pytest.raises(Exception, match="HistoryBuffer"):
        torch.load(path.parent / "hub.pth", weights_only=True)
    assert isinstance(pid_plugins.mmseg.checkpoint.load_checkpoint(str(path.parent / "hub.pth"))["hub"], HistoryBuffer)


@pytest.mark.slow
def test_allow_listed_getattr_cannot_reach_exec(tmp_path, monkeypatch):
    """mmengine checkpoints need builtins.getattr; ours resolves only HistoryBuffer's statistic methods."""
    marker = tmp_path / "marker"
    path = tmp_path / "escape.pth"
    torch.save({"x": getattr_escape(marker)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeCheckpointError, match="only HistoryBuffer's statistic methods"):
        pid_plugins.mmseg.checkpoint.load_checkpoint(str(path))
    assert not marker.exists()
    armed = ("import torch, sys; torch.serialization.add_safe_globals([getattr]); "
             "torch.load(sys.argv[1], weights_only=True)")
    subprocess.run([sys.executable, "-c", armed, str(path)], capture_output=True, timeout=300)
    assert marker.read_text() == "code ran"


def test_safe_globals_are_exactly_what_a_runner_checkpoint_needs(tmp_path):
    """A Runner checkpoint (saved by mmengine, with numpy logs in its message hub) loads weights-only."""
    import numpy as np
    from mmengine.logging import HistoryBuffer, MessageHub

    from pid_plugins.mmseg.checkpoint import SAFE_GLOBALS

    hub = MessageHub.get_instance("pid-plugins-test")
    hub.update_scalar("train/loss", np.float64(0.5))
    hub.update_scalar("train/lr", 0.1)
    path = tmp_path / "hub.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, "message_hub": hub.state_dict(),
                "meta": {"seed": np.int64(3), "iter": 4}}, path)
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    registered = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    assert names <= registered, names - registered
    loaded = pid_plugins.mmseg.checkpoint.load_checkpoint(str(path))
    buffer = loaded["message_hub"]["log_scalars"]["train/loss"]
    assert isinstance(buffer, HistoryBuffer) and buffer.current() == 0.5
    assert loaded["meta"]["seed"] == 3


def run_tool(tool, *args, env_extra=None):
    """``python tools/<tool> args``."""
    import mmseg

    script = Path(mmseg.__file__).parent / ".mim" / "tools" / tool
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    return run_python_script(script, *args, env={**env, **(env_extra or {})}, timeout=600,
                             fork=None if not env_extra else False)


@pytest.fixture(scope="module")
def ade_tiny(tmp_path_factory):
    from research.mmseg_data import make_ade20k_like

    data = tmp_path_factory.mktemp("ade_tiny")
    make_ade20k_like(data, n_train=8, n_val=2)
    return ["--cfg-options"] + [f"{s}_dataloader.dataset.data_root={data}" for s in ("train", "val", "test")]


@pytest.mark.integration
@pytest.mark.slow
def test_mmseg_tools_refuse_pickled_code_with_the_variable_set(evil, ade_tiny, tmp_path):
    """tools/test.py (load_from) and tools/train.py --resume, with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1."""
    path, marker = evil
    force = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    tested = run_tool("test.py", TINY_CONFIG, path, "--work-dir", tmp_path / "test", *ade_tiny, env_extra=force)
    resumed = run_tool("train.py", TINY_CONFIG, "--work-dir", tmp_path / "train", "--resume", *ade_tiny,
                       f"load_from={path}", env_extra=force)
    for proc in (tested, resumed):
        assert proc.returncode != 0
        assert "UnsafeCheckpointError: refused to load checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.integration
@pytest.mark.slow
def test_mmseg_tools_train_resume_test_with_default_torch_loading(ade_tiny, tmp_path):
    """The whole cycle on our config with torch's default loading (no variable): mmengine's classes load."""
    work = tmp_path / "work"
    trained = run_tool("train.py", TINY_CONFIG, "--work-dir", work, *ade_tiny, "train_cfg.max_iters=2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (work / "iter_2.pth").is_file()
    resumed = run_tool("train.py", TINY_CONFIG, "--work-dir", work, "--resume", *ade_tiny, "train_cfg.max_iters=3")
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "local_weights_only backend" in log
    assert "resumed epoch: 0, iter: 2" in log and "Iter(train) [3/3]" in log
    tested = run_tool("test.py", TINY_CONFIG, work / "iter_3.pth", "--work-dir", tmp_path / "test", *ade_tiny)
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "mIoU" in tested.stdout + tested.stderr
