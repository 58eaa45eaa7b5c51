"""PID in Segmenter's mask-transformer decoder."""
from pathlib import Path

import pytest
import torch

from zoo_cases import MM_TYPES, assert_equal_or_both_none, mm_args, mm_build, mm_with_cp_runs
from zoo_cases import weights as zc_weights

pytest.importorskip("mmseg")
import pid_plugins.mmseg  # noqa: E402,F401
from pid_plugins import PIDConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
HEAD = dict(in_channels=48, channels=48, num_classes=5, num_layers=2, num_heads=3, embed_dims=48,
            dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))


def build(type="PIDSegmenterMaskTransformerHead", seed=0, **kw):
    from mmseg.registry import MODELS

    torch.manual_seed(seed)
    head = MODELS.build(dict(type=type, **HEAD, **kw))
    head.init_weights()
    head.eval()
    return head


def features(dtype=torch.float32):
    return [torch.randn(2, 48, 4, 4, generator=torch.Generator().manual_seed(1), dtype=dtype)]


def test_default_is_the_stock_head():
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    head = build()
    assert head.attention_config is None and all(type(layer) is TransformerEncoderLayer for layer in head.layers)
    stock = build(type="SegmenterMaskTransformerHead")
    assert list(head.state_dict()) == list(stock.state_dict())
    with torch.no_grad():
        assert torch.equal(head(features()), stock(features()))


def test_head_arguments():
    assert build(attention="pid").attention_config == PIDConfig.preset("segmenter")
    assert build(attention="pid", attention_cfg="deit").attention_config == PIDConfig.preset("deit")
    assert build(attention="pid", attention_cfg=dict(lambda_p=0.1)).attention_config == PIDConfig.preset("segmenter",
                                                                                             lambda_p=0.1)
    with pytest.raises(ValueError, match="PIDSegmenterMaskTransformerHead: unknown attention method 'linear'"):
        build(attention="linear")
    assert build(attention_cfg="deit").attention_method is None  # the head's default is softmax: parameters are inert


@pytest.mark.parametrize("part, cfg", [("backbone", dict(control_first_layer=False)), ("head", dict(learnable=True))])
def test_with_cp_is_exact_and_the_first_layers_gains_get_zero_gradients(part, cfg):
    """with_cp=True equals with_cp=False bit for bit (the backbone with its first layer plain); beta = 1 (preset
    segmenter): the head's first layer's error beta v - v is 0, so its gains get zero gradients, the others not."""
    def build():
        return mm_build("PID" + MM_TYPES[part], mm_args(part), attention="pid", attention_cfg=dict(preset="segmenter",
                                                                                               **cfg))
    model, (ref, ckpt) = mm_with_cp_runs(part, build)
    assert sum(g is not None for g in ref) > 10
    assert_equal_or_both_none(ckpt, ref)
    gains = {n: g for (n, _), g in zip(model.named_parameters(), ref[2:]) if ".attention_params." in n}
    assert len(gains) == (6 if cfg.get("learnable") else 0)
    assert all((g.abs().max() == 0) == n.startswith("layers.0.") for n, g in gains.items()), gains


@pytest.mark.slow
def test_config_round_trip_and_a_training_step(tmp_path):
    """The option in a config: dumped, reloaded, built into the whole Segmenter; checkpoints stay stock-shaped."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample
    from mmengine.structures import PixelData

    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.model.decode_head.update(type="PIDSegmenterMaskTransformerHead", attention="pid",
                                 attention_cfg=dict(preset="segmenter", lambda_p=0.3))
    cfg.dump(str(tmp_path / "pid_head.py"))
    reloaded = Config.fromfile(str(tmp_path / "pid_head.py"))
    assert reloaded.model.decode_head.attention_cfg == dict(preset="segmenter", lambda_p=0.3)
    init_default_scope("mmseg")
    model = MODELS.build(reloaded.model)
    model.init_weights()
    assert model.decode_head.attention_config == PIDConfig.preset("segmenter", lambda_p=0.3)
    assert model.backbone.attention_config == PIDConfig.preset("segmenter")  # a separate group with its own gains
    stock = MODELS.build(Config.fromfile(str(TINY_CONFIG)).model)
    assert list(zc_weights(model.state_dict())) == list(zc_weights(stock.state_dict()))  # + the head's record
    model.train()
    sample = SegDataSample(gt_sem_seg=PixelData(data=torch.randint(0, 150, (1, 64, 64))))
    sample.set_metainfo(dict(img_shape=(64, 64), pad_shape=(64, 64)))
    losses = model(torch.randn(2, 3, 64, 64), [sample, sample], mode="loss")
    loss = sum(v for k, v in losses.items() if "loss" in k)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.decode_head.layers.parameters())
