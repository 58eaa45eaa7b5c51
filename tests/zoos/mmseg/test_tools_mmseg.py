"""mmseg's own ``tools/test.py`` (shipped in mmsegmentation's wheel, ``mmseg/.mim/tools``) on a PID Segmenter
checkpoint: through ``pid-plugins run`` with a config that does not import the plugin, it builds and tests the PID
model; without the launcher that config does not run; a config of the stock types is told, in mmengine's log, that
the checkpoint carries a method record it does not take."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmseg")
pytestmark = pytest.mark.integration
from tool_cases import ROOT, check, launch  # noqa: E402

TINY_CONFIG = ROOT / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"


def _tools() -> Path:
    import mmseg

    return Path(mmseg.__file__).parent / ".mim" / "tools"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, data options, a PID config without custom_imports, the stock-type config, a PID checkpoint)."""
    import pid_plugins.mmseg  # noqa: F401  (the PID types, to build the checkpoint here)
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    from research.mmseg_data import make_ade20k_like

    folder = tmp_path_factory.mktemp("mmseg_tools")
    make_ade20k_like(folder / "data", n_train=2, n_val=2)
    data = ["--cfg-options"] + [f"{s}_dataloader.dataset.data_root={folder / 'data'}" for s in ("train", "val", "test")]
    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.pop("custom_imports", None)
    cfg.custom_hooks = []  # WeightsOnlyCheckpointHook is the plugin's too
    cfg.dump(str(folder / "pid_no_imports.py"))
    stock = Config.fromfile(str(folder / "pid_no_imports.py"))
    stock.model.backbone.type = "VisionTransformer"
    for key in ("attention", "attention_cfg"):
        stock.model.backbone.pop(key, None)
    stock.dump(str(folder / "stock.py"))
    init_default_scope("mmseg")
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    torch.save({"state_dict": model.state_dict(), "meta": {}}, folder / "pid.pth")
    return folder, data


@pytest.mark.slow
def test_mmseg_test_py_runs_the_pid_config_through_the_launcher(case):
    folder, data = case
    command = ["python", _tools() / "test.py", folder / "pid_no_imports.py", folder / "pid.pth",
               "--work-dir", folder / "work", *data]
    tested = check(launch(command, folder, adapters="mmseg"))
    assert re.search(r"mIoU: \d", tested.stdout + tested.stderr)  # the test metrics were computed
    bare = launch(command, folder, launcher=False)  # no PID types (and, with mmcv-lite, no mmcv.ops: see compat)
    assert bare.returncode != 0 and not re.search(r"mIoU: \d", bare.stdout + bare.stderr), bare.stderr[-2000:]


@pytest.mark.slow
def test_mmseg_test_py_with_the_stock_types_lists_the_method_record(case):
    folder, data = case
    command = ["python", _tools() / "test.py", folder / "stock.py", folder / "pid.pth", "--work-dir",
               folder / "stock_work", *data]
    tested = check(launch(command, folder, adapters="mmseg"))  # the stock types, in a process with the plugin
    log = tested.stdout + tested.stderr
    assert "unexpected key in source state_dict: backbone.pid_plugins_method" in log, log[-3000:]
