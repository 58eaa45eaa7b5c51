"""Learnable method parameters in mmseg (issue 34)."""
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmseg")
import pid_plugins.mmseg as pm  # noqa: E402
from method_cases import BUILTIN  # noqa: E402
from zoo_cases import (  # noqa: E402
    MM_TYPES, mm_args, mm_build, mm_inputs,
)

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs" / "mmseg"
TINY_CONFIG = CONFIGS / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
LEARNABLE = {name: dict(attention=name, attention_cfg=dict(learnable=True)) for name, m in BUILTIN.items() if m.learnable}
LEARNED = {name: list(BUILTIN[name].learned) for name in LEARNABLE}
PARTS = ["backbone", "head"]


def part_model(part, method, seed=1, **kw):
    return mm_build("PID" + MM_TYPES[part], mm_args(part), seed, **{**LEARNABLE[method], **kw})


def stock_part(part, seed=0):
    return mm_build(MM_TYPES[part], mm_args(part), seed)


def gains_of(model):
    return {n: p for n, p in model.named_parameters() if ".attention_params." in n}


def with_stock_weights(model, stock):
    """``stock``'s weights into ``model`` (learnable parameters are all a stock state_dict lacks)."""
    result = model.load_state_dict(stock.state_dict(), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) == set(gains_of(model))
    return model


def initial_values(layer):
    return layer.attention_method.make_learned(layer.attention_config).state_dict()


def test_a_learnable_backbone_compiles_fullgraph_and_equals_eager():
    from zoo_cases import mm_compiled

    model = part_model("backbone", "pid")
    with torch.no_grad():
        for i, p in enumerate(gains_of(model).values()):
            p.fill_(0.1 * i - 0.5)  # trained-looking values, apart per layer
    x = mm_inputs("backbone")
    compiled = mm_compiled(model, x, "aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled, model(x)[0], rtol=1e-6, atol=1e-6)


def _pretrained(tmp_path, state_dict, **kw):
    path = tmp_path / "pretrained.pth"
    torch.save({"state_dict": state_dict, "meta": {}}, path)
    return mm_build("PIDVisionTransformer", mm_args("backbone"), 3,
                    init_cfg=dict(type="Pretrained", checkpoint=str(path)), **kw)


@pytest.mark.parametrize("method", LEARNABLE)
def test_softmax_checkpoint_into_a_learnable_backbone_starts_the_gains_at_their_initial_values(tmp_path, method):
    """init_cfg=dict(type='Pretrained') with a stock (softmax) checkpoint."""
    from mmseg.registry import MODELS

    stock = stock_part("backbone")
    path = tmp_path / "vit.pth"
    torch.save({"state_dict": stock.state_dict(), "meta": {}}, path)
    torch.manual_seed(3)
    model = MODELS.build(dict(type="PIDVisionTransformer", **mm_args("backbone"), **LEARNABLE[method],
                              init_cfg=dict(type="Pretrained", checkpoint=str(path))))
    with torch.no_grad():
        for p in gains_of(model).values():
            p.fill_(float("nan"))  # garbage before loading: init_weights must replace it
    model.init_weights()
    model.eval()
    state = model.state_dict()
    for key, value in stock.state_dict().items():
        assert torch.equal(state[key], value), key
    for layer in model.layers:
        for name, value in initial_values(layer).items():
            assert torch.equal(layer.attention_params.state_dict()[name], value), name
    fixed = mm_build("PIDVisionTransformer", mm_args("backbone"), 4, attention=method)
    fixed.load_state_dict(stock.state_dict(), strict=True)
    x = mm_inputs("backbone")
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], fixed(x)[0], rtol=1e-5, atol=1e-6)


def test_fixed_and_timm_learnable_checkpoints_into_a_learnable_backbone(tmp_path):
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    fixed = mm_build("PIDVisionTransformer", mm_args("backbone"), 5)
    model = _pretrained(tmp_path, fixed.state_dict(), attention_cfg=dict(learnable=True))
    for layer in model.layers:
        assert all(torch.equal(layer.attention_params.state_dict()[k], v) for k, v in initial_values(layer).items())
    args = mm_args("backbone")
    torch.manual_seed(0)
    deit = timm.create_model("pid_deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=3,
                             num_heads=3, attention_cfg=dict(preset="segmenter", learnable=True))
    with torch.no_grad():
        for i, blk in enumerate(deit.blocks):
            blk.attn.attention_params.lambda_p_raw.fill_(0.1 * i - 0.5)
    model = _pretrained(tmp_path, deit.state_dict(), attention_cfg=dict(learnable=True), patch_bias=True)
    assert args["num_layers"] == len(deit.blocks)
    for i, blk in enumerate(deit.blocks):
        for name, value in blk.attn.attention_params.state_dict().items():
            assert torch.equal(model.layers[i].attention_params.state_dict()[name], value), (i, name)
    learnable = mm_build("PIDVisionTransformer", mm_args("backbone"), 5, attention_cfg=dict(learnable=True))
    with pytest.raises(ValueError, match=r"unexpected keys \['layers.0.attention_params.lambda_d_raw'"):
        _pretrained(tmp_path, learnable.state_dict())


def _segmentor_cfg(config=TINY_CONFIG, method="pid"):
    from mmengine.config import Config

    cfg = Config.fromfile(str(config))
    cfg.model.backbone.pop("attention_cfg")  # the shipped PID preset: replaced, not merged with another method's
    cfg.model.backbone.update(attention=LEARNABLE[method]["attention"], attention_cfg=LEARNABLE[method]["attention_cfg"])
    cfg.model.decode_head.update(type="PIDSegmenterMaskTransformerHead", num_layers=2, **LEARNABLE[method])
    return cfg


def _build_segmentor(cfg, seed=0):
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    torch.manual_seed(seed)
    model = MODELS.build(cfg.model)
    model.init_weights()
    return model


def _decay_by_name(model, optim_wrapper):
    decay = {}
    for group in optim_wrapper.optimizer.param_groups:
        for p in group["params"]:
            decay[id(p)] = group["weight_decay"]
    return {n: decay[id(p)] for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("segmenter_pid-deit-*_mask_8xb1-*.py")), ids=lambda p: p.name)
def test_every_shipped_config_keeps_attention_params_out_of_weight_decay(config):
    from mmengine.config import Config

    cfg = Config.fromfile(str(config))
    assert cfg.optim_wrapper.paramwise_cfg.custom_keys == {"attention_params": {"decay_mult": 0.0}}
    assert cfg.optim_wrapper.type == "OptimWrapper" and cfg.optim_wrapper.optimizer.type == "SGD"  # mmseg's, merged


@pytest.mark.parametrize("method", LEARNABLE)
def test_the_optim_wrapper_built_from_the_shipped_config_puts_the_gains_in_no_decay_groups(method):
    from mmengine.optim import build_optim_wrapper

    cfg = _segmentor_cfg(method=method)
    model = _build_segmentor(cfg)
    gains = set(gains_of(model))
    assert {n.split(".")[0] for n in gains} == {"backbone", "decode_head"} and len(gains) == 4 * len(LEARNED[method])
    assert all(d == 0.0 for d in _decay_by_name(model, build_optim_wrapper(model, cfg.optim_wrapper)).values())
    cfg.optim_wrapper.optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.05)
    decay = _decay_by_name(model, build_optim_wrapper(model, cfg.optim_wrapper))
    assert {n for n, d in decay.items() if d == 0.0} == gains
    assert {d for n, d in decay.items() if n not in gains} == {0.05}
    cfg.optim_wrapper.pop("paramwise_cfg")  # without the setting the gains would decay too
    assert set(_decay_by_name(model, build_optim_wrapper(model, cfg.optim_wrapper)).values()) == {0.05}


def _batch(n=2, seed=5):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        sample = SegDataSample(gt_sem_seg=PixelData(data=torch.randint(0, 150, (1, 64, 64), generator=g)))
        sample.set_metainfo(dict(img_shape=(64, 64), pad_shape=(64, 64)))
        samples.append(sample)
    return torch.rand(n, 3, 64, 64, generator=g) * 255, samples


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return model.encode_decode(model.data_preprocessor({"inputs": list(x)}, False)["inputs"],
                                   [dict(img_shape=(64, 64))] * len(x))


@pytest.mark.parametrize("method", LEARNABLE)
def test_gains_get_gradients_and_train_through_mmengines_optim_wrapper(method):
    from mmengine.optim import build_optim_wrapper

    cfg = _segmentor_cfg(method=method)
    cfg.optim_wrapper.optimizer = dict(type="AdamW", lr=1e-2, weight_decay=0.05)
    model = _build_segmentor(cfg)
    model.train()
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    before = {n: p.detach().clone() for n, p in gains_of(model).items()}
    x, samples = _batch()
    losses = model(model.data_preprocessor({"inputs": list(x), "data_samples": samples}, True)["inputs"],
                   samples, mode="loss")
    loss, _ = model.parse_losses(losses)
    wrapper.backward(loss)
    for name, p in gains_of(model).items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    moved = [n for n, p in gains_of(model).items() if p.grad.abs().max() > 0]
    assert len(moved) >= len(before) - 2 * len(LEARNED[method]) > 0
    wrapper.step()
    wrapper.zero_grad()
    after = gains_of(model)
    assert all(not torch.equal(after[n], before[n]) for n in moved)


def test_runner_trains_the_gains_and_its_checkpoint_reloads_weights_only(tmp_path):
    """mmengine's Runner on the tiny config with learnable gains in backbone and head (AdamW with weight decay)."""
    from mmengine.runner import Runner
    from mmengine.runner.checkpoint import load_checkpoint as mm_load_checkpoint

    from pid_plugins.mmseg.checkpoint import load_checkpoint, weights_only_schemes
    from research.mmseg_data import make_ade20k_like

    data = tmp_path / "ade_tiny"
    make_ade20k_like(data, n_train=4, n_val=1)
    cfg = _segmentor_cfg()
    cfg.work_dir = str(tmp_path / "work")
    for split in ("train", "val", "test"):
        cfg[f"{split}_dataloader"].dataset.data_root = str(data)
    cfg.train_dataloader.batch_size = 2
    cfg.optim_wrapper.optimizer = dict(type="AdamW", lr=1e-2, weight_decay=0.05)
    cfg.train_cfg.update(max_iters=2, val_interval=100)
    cfg.param_scheduler = []
    cfg.default_hooks.checkpoint.interval = 2
    cfg.randomness = dict(seed=0)
    runner = Runner.from_cfg(cfg)
    initial = {n: p.detach().clone() for n, p in gains_of(runner.model).items()}
    runner.train()
    trained = runner.model
    first = {n for n in initial if ".layers.0." in n}  # beta = 1: zero error, zero gradients at each group's start
    assert len(first) == 6 and len(initial) == 12
    for name, p in gains_of(trained).items():
        assert torch.equal(p, initial[name]) == (name in first), name
    x, _ = _batch(seed=9)
    want = _logits(trained, x)

    path = Path(cfg.work_dir) / "iter_2.pth"
    checkpoint = load_checkpoint(str(path), map_location="cpu")  # weights_only=True
    fresh = _build_segmentor(_segmentor_cfg(), seed=1)
    assert (_logits(fresh, x) - want).abs().max() > 1e-4
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    assert torch.equal(_logits(fresh, x), want)
    again = _build_segmentor(_segmentor_cfg(), seed=2)
    with weights_only_schemes():
        mm_load_checkpoint(again, str(path), map_location="cpu", strict=True)
    assert torch.equal(_logits(again, x), want)
    for name, p in gains_of(again).items():
        assert torch.equal(p, gains_of(trained)[name]), name
