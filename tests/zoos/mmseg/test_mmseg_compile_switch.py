"""mmengine's compile switch, ``Runner(..., compile=...)`` (``cfg.compile``), for every method (fixed gains,
learnable gains, gain warm-up) in the backbone of the CPU-tiny Segmenter config.

mmengine compiles the model's ``train_step`` (data preprocessing, losses, and the optimizer wrapper's backward and
step), which breaks the graph wherever stock mmseg does (the optimizer step, mmseg's loss code): the method must add
no graph break of its own (the same breaks, by reason, as the stock backbone's run) and no recompilation beyond
stock's (mmseg's data preprocessor recompiles as the data samples change, stock too). The
trained weights equal an eager Runner's from the same weights, data and seed. Every variant passes
``compile=dict(backend="aot_eager")``: mmengine hands the dict to ``torch.compile`` as it hands ``compile=True``'s
empty one, and dynamo and AOT autograd capture the same graphs (forward and backward) for either backend. Inductor's
code for those graphs on this CPU (74 s of the 94 s a ``compile=True`` variant took) is what
tests/zoos/timm/test_timm_compile_switch.py compiles for every method, on the same DeiT blocks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compile_switch import Dynamo, assert_close_state, assert_variant_trained, variants

pytest.importorskip("mmseg")
import pid_plugins.mmseg  # noqa: E402,F401

pytestmark = pytest.mark.xdist_group("mmseg_compile_switch")

TINY_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "mmseg" / \
    "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
ITERS = 3
LAYERS = 2  # the tiny config's backbone depth (the variants' parameters act within it)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from research.mmseg_data import make_ade20k_like

    root = tmp_path_factory.mktemp("ade_tiny")
    make_ade20k_like(root, n_train=4, n_val=1)
    return root


def _runner(data, work_dir, method, cfg, compile_cfg=None):
    from mmengine.config import Config
    from mmengine.runner import Runner

    config = Config.fromfile(str(TINY_CONFIG))
    config.model.backbone.pop("attention_cfg")
    assert config.model.backbone.num_layers == LAYERS
    if method is None:  # the stock backbone: mmseg's own VisionTransformer
        config.model.backbone.pop("attention")
        config.model.backbone.type = "VisionTransformer"
    else:
        config.model.backbone.update(attention=method, attention_cfg=cfg or None)
    config.work_dir = str(work_dir)
    for split in ("train", "val", "test"):
        config[f"{split}_dataloader"].dataset.data_root = str(data)
    config.train_dataloader.batch_size = 2
    config.optim_wrapper.optimizer = dict(type="SGD", lr=0.05, momentum=0.0, weight_decay=0.0)
    config.optim_wrapper.pop("paramwise_cfg", None)
    config.train_cfg.update(max_iters=ITERS, val_interval=100)
    config.param_scheduler = []
    config.default_hooks.checkpoint.interval = 100
    config.randomness = dict(seed=0)
    if compile_cfg is not None:
        config.compile = compile_cfg
    return Runner.from_cfg(config)


def _train(runner):
    """Train; (weights before, weights after, graphs compiled after each iteration)."""
    from mmengine.hooks import Hook
    from torch._dynamo.utils import counters

    graphs = []

    class Graphs(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            graphs.append(counters["stats"]["unique_graphs"])

    runner.register_hook(Graphs(), priority="LOWEST")
    before = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}
    runner.train()
    return before, {k: v.detach().clone() for k, v in runner.model.state_dict().items()}, graphs


@pytest.fixture(scope="module")
def stock_run(data, tmp_path_factory):
    """(graph breaks by reason, graphs compiled after each iteration) of the stock backbone's compiled run, with
    dynamo's eager backend (breaks and recompilations are dynamo's, whatever the backend)."""
    with Dynamo() as dynamo:
        _, _, graphs = _train(_runner(data, tmp_path_factory.mktemp("stock"), None, None, dict(backend="eager")))
        return dynamo.graph_breaks, graphs


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("method,cfg", variants("mmseg-backbone", layers=LAYERS))
def test_runner_compile_trains_like_eager(method, cfg, data, tmp_path, stock_run):
    with Dynamo() as dynamo:
        runner = _runner(data, tmp_path / "compiled", method, cfg, dict(backend="aot_eager"))
        before, got, graphs = _train(runner)
        stock_breaks, stock_graphs = stock_run
        assert dynamo.graph_breaks == stock_breaks  # the method adds no break of its own
        assert len(graphs) == ITERS and graphs == stock_graphs, (graphs, stock_graphs)
    _, want, _ = _train(_runner(data, tmp_path / "eager", method, cfg))
    assert_close_state(got, want, moved_from=before, rtol=1e-5, atol=1e-5)
    assert_variant_trained(runner.model, cfg, before, ITERS)
