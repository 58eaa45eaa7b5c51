"""mmsegmentation adapter: PID ViT backbone for Segmenter, configs, checkpoints, mmseg's own tools."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmseg")
import pid_plugins.mmseg as pm  # noqa: E402
from pid_plugins import PIDConfig  # noqa: E402
from pid_plugins.mmseg.compat import STANDIN_NAME  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p for p in (REPO / "configs" / "mmseg").glob("*.py") if p.name != "__init__.py")  # the package marker
TINY_CONFIG = REPO / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
ARGS = dict(img_size=(64, 64), patch_size=16, embed_dims=48, num_layers=3, num_heads=3, drop_path_rate=0.0,
            final_norm=True, with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6))


def build(**kw):
    from mmseg.registry import MODELS

    model = MODELS.build(dict(type="PIDVisionTransformer", **{**ARGS, **kw}))
    model.eval()
    return model


def stock_backbone(seed=0):
    from mmseg.models.backbones import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(**ARGS)
    model.init_weights()
    model.eval()
    return model


def images(n=2):
    return torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def test_mmcv_ext_standin_raises_a_clear_error_when_called():
    import mmcv

    ext = sys.modules[STANDIN_NAME]
    assert ext.__spec__.loader is None
    with pytest.raises(RuntimeError, match="mmcv op 'roi_align_forward' needs the compiled mmcv"):
        ext.roi_align_forward()
    assert pm.install_mmcv_ext_standin() is True  # idempotent
    assert mmcv.__version__ == "2.1.0"


def test_gains_from_config_arguments():
    from mmengine.config import ConfigDict

    assert build().attention_config == PIDConfig.preset("segmenter")
    assert build(attention_cfg=dict(preset="deit")).attention_config == PIDConfig.preset("deit")
    assert build(attention_cfg="deit").attention_config == PIDConfig.preset("deit")  # a preset name, as on the timm side
    assert build(attention_cfg=PIDConfig(0.1, 0.2, 0.3, 0.4)).attention_config == PIDConfig(0.1, 0.2, 0.3, 0.4)
    assert build(attention_cfg=ConfigDict(lambda_p=0.2)).attention_config == PIDConfig.preset("segmenter", lambda_p=0.2)
    assert build(attention_cfg=dict(preset="deit", beta=0.5)).attention_config == PIDConfig.preset("deit", beta=0.5)
    assert build(attention_cfg=dict(control_first_layer=False)).attention_config == PIDConfig.preset(
        "segmenter", control_first_layer=False)
    with pytest.raises(ValueError, match="unknown PID preset 'nope'"):
        build(attention_cfg="nope")
    with pytest.raises(ValueError, match="must be a PIDConfig, a dict, a preset name"):
        build(attention_cfg=0.5)
    assert build(attention_cfg=dict(lambda_p=0.2, beta=0.5)).attention_config.gains == (0.2, 0.3, 0.05, 0.5)
    for removed in (dict(pid=dict(lambda_p=0.2)), dict(lambda_p=0.2), dict(beta=0.5)):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(removed))}'"):
            build(**removed)
    assert build(attention="softmax").attention_config is None
    with pytest.raises(ValueError, match="PIDVisionTransformer: unknown attention method 'linear'"):
        build(attention="linear")
    with pytest.raises(ValueError, match="PIDConfig.beta"):
        build(attention_cfg=dict(beta=0.0))


def test_stock_mmseg_checkpoint_loads_strictly(tmp_path):
    stock = stock_backbone()
    path = tmp_path / "vit_mmseg.pth"
    torch.save({"state_dict": stock.state_dict(), "meta": {}}, path)
    model = build(attention="softmax", init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    model.init_weights()
    for k, v in stock.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert list(model.state_dict()) == list(stock.state_dict())


def test_timm_checkpoint_needs_the_patch_bias(tmp_path):
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    deit = timm.create_model("pid_deit_tiny_patch16_224", img_size=64, embed_dim=48, depth=3, num_heads=3)
    path = tmp_path / "pid_deit.pth"
    torch.save({"model": deit.state_dict()}, path)
    without_bias = build(init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    with pytest.raises(ValueError, match="set backbone patch_bias=True"):
        without_bias.init_weights()  # mmseg's default ViT has no patch bias; it is never dropped silently
    assert set(pm.timm_vit_to_mmseg(deit.state_dict())) == set(build(patch_bias=True).state_dict())


@pytest.mark.slow
def test_shipped_config_takes_a_timm_pid_deit_checkpoint(tmp_path):
    """The paper's pipeline."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401
    from mmengine.config import Config
    from mmseg.registry import MODELS

    cfg = Config.fromfile(str(REPO / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_8xb1-160k_ade20k-512x512.py"))
    torch.manual_seed(0)
    deit = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg="segmenter").eval()
    for p in deit.parameters():  # non-trivial biases and norms, so a dropped or misplaced one shows
        p.data.add_(torch.randn_like(p) * 0.02)
    data = timm.data.resolve_data_config({}, model=deit)
    torch.testing.assert_close(list(cfg.model.data_preprocessor.mean), [255 * m for m in data["mean"]])
    torch.testing.assert_close(list(cfg.model.data_preprocessor.std), [255 * s for s in data["std"]])

    path = tmp_path / "pid_deit_tiny.pth"
    torch.save(deit.state_dict(), path)
    backbone_cfg = cfg.model.backbone.copy()
    backbone_cfg.update(init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    as_shipped = MODELS.build(backbone_cfg)  # 512 px: the 14x14 position grid is resized to 32x32
    as_shipped.init_weights()
    assert as_shipped.pos_embed.shape == (1, 1 + 32 * 32, 192)
    assert torch.equal(as_shipped.patch_embed.projection.bias, deit.patch_embed.proj.bias)
    backbone_cfg.update(img_size=(224, 224))
    backbone = MODELS.build(backbone_cfg)
    backbone.init_weights()  # strict: raises on any missing/unexpected key
    assert backbone.attention_config == deit.blocks[0].attn.attention_config == PIDConfig.preset("segmenter")
    backbone.eval()  # mmseg's ViT.train() returns None, so not chained
    backbone.double(), deit.double()
    x = torch.randn(2, 3, 224, 224, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = deit.forward_intermediates(x, indices=[11], norm=True, intermediates_only=True)[0]
        got = backbone(x)[0]
    assert got.shape == want.shape == (2, 192, 14, 14)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_whole_segmentor_checkpoint_as_backbone_is_refused_clearly(tmp_path):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    cfg = Config.fromfile(str(TINY_CONFIG))
    init_default_scope("mmseg")
    segmentor = MODELS.build(cfg.model)
    path = tmp_path / "iter_4.pth"
    torch.save({"state_dict": segmentor.state_dict(), "meta": {}}, path)
    backbone_cfg = cfg.model.backbone.copy()
    backbone_cfg.update(init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    with pytest.raises(ValueError, match=r"whole segmentor \(backbone. and decode_head. keys\).*load_from=PATH"):
        MODELS.build(backbone_cfg).init_weights()
    backbone_only = {k: v for k, v in segmentor.state_dict().items() if k.startswith("backbone.")}
    torch.save({"state_dict": backbone_only}, path)
    backbone = MODELS.build(backbone_cfg)
    backbone.init_weights()  # the backbone part alone loads
    assert torch.equal(backbone.pos_embed, segmentor.backbone.pos_embed)


def test_mismatched_checkpoint_lists_the_keys(tmp_path):
    sd = dict(stock_backbone().state_dict())
    sd.pop("layers.1.ln2.weight")
    sd["layers.1.extra"] = torch.ones(1)
    path = tmp_path / "bad.pth"
    torch.save(sd, path)
    model = build(init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    with pytest.raises(ValueError) as info:
        model.init_weights()
    assert "missing keys ['layers.1.ln2.weight']" in str(info.value)
    assert "unexpected keys ['layers.1.extra']" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_builds(config):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    cfg = Config.fromfile(str(config))
    assert cfg.custom_imports["imports"] == ["pid_plugins.mmseg"]
    assert cfg.model.backbone.type == "PIDVisionTransformer" and cfg.model.pretrained is None
    init_default_scope("mmseg")
    model = MODELS.build(cfg.model)
    assert model.backbone.attention_config == PIDConfig.preset("segmenter")
    assert type(model.backbone).__name__ == "PIDVisionTransformer"
    assert cfg.model.backbone.patch_bias is True and model.backbone.patch_embed.projection.bias is not None
    assert list(cfg.model.data_preprocessor.mean) == [123.675, 116.28, 103.53]
    assert list(cfg.model.data_preprocessor.std) == [58.395, 57.12, 57.375]
    assert type(model.decode_head).__name__ == "SegmenterMaskTransformerHead"  # decoder PID is opt-in


@pytest.mark.slow
def test_control_first_layer_is_carried_by_configs_and_checkpoint_meta(tmp_path):
    """A config's attention_cfg=dict(..., control_first_layer=False) survives dump/reload and reaches the backbone."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.model.backbone.attention_cfg = dict(preset="segmenter", control_first_layer=False)
    cfg.dump(str(tmp_path / "cfg.py"))
    reloaded = Config.fromfile(str(tmp_path / "cfg.py"))
    again = Config.fromstring(reloaded.pretty_text, file_format=".py")  # how mmengine stores it in checkpoint meta
    init_default_scope("mmseg")
    models = {}
    for flag, config in (("False", again), ("True", Config.fromfile(str(TINY_CONFIG)))):
        torch.manual_seed(0)
        models[flag] = MODELS.build(config.model).eval()
    assert models["False"].backbone.attention_config == PIDConfig.preset("segmenter", control_first_layer=False)
    assert models["True"].backbone.attention_config.control_first_layer is True  # the default, as the shipped configs
    models["False"].load_state_dict(models["True"].state_dict())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        a, b = (m.backbone(x)[0] for m in (models["False"], models["True"]))
    assert a.shape == b.shape and (a - b).abs().max() > 1e-4

