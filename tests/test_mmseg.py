"""mmsegmentation adapter: PID ViT backbone for Segmenter, configs, checkpoints, mmseg's own tools."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmseg")
import pid_plugins.mmseg as pm  # noqa: E402
from pid_plugins import PIDConfig  # noqa: E402
from pid_plugins.mmseg.compat import STANDIN_NAME  # noqa: E402
from reference import naive_pid_stack  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs" / "mmseg").glob("*.py"))
TINY_CONFIG = REPO / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
ARGS = dict(img_size=(64, 64), patch_size=16, embed_dims=48, num_layers=3, num_heads=3, drop_path_rate=0.0,
            final_norm=True, with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6))
ZERO = dict(lambda_p=0.0, lambda_i=0.0, lambda_d=0.0)


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


@pytest.mark.parametrize("kw", [dict(pid=ZERO), dict(attention="softmax")])
def test_zero_gains_or_softmax_equal_the_stock_backbone(kw):
    stock = stock_backbone()
    model = build(**kw)
    model.load_state_dict(stock.state_dict(), strict=True)
    x = images()
    with torch.no_grad():
        assert torch.equal(model(x)[0], stock(x)[0])


def test_gains_from_config_arguments():
    assert build().pid == PIDConfig.preset("segmenter")
    assert build(pid=dict(preset="deit")).pid == PIDConfig.preset("deit")
    assert build(lambda_p=0.2, beta=0.5).pid.gains == (0.2, 0.3, 0.05, 0.5)
    assert build(attention="softmax").pid is None
    with pytest.raises(ValueError, match="attention must be 'pid' or 'softmax'"):
        build(attention="linear")
    with pytest.raises(ValueError, match="PIDConfig.beta"):
        build(beta=0.0)


def test_pid_backbone_matches_a_hand_written_reference():
    cfg = PIDConfig(0.5, 0.3, 0.2, 0.7)
    stock = stock_backbone()
    model = build(pid=cfg.to_dict())
    model.load_state_dict(stock.state_dict())
    model = model.double()
    x = images().double()
    with torch.no_grad():
        h, hw = model.patch_embed(x)
        h = model._pos_embeding(torch.cat([model.cls_token.expand(2, -1, -1), h], 1), hw, model.pos_embed)
        attn_outs, values = [], []
        for layer in model.layers:
            mha = layer.attn.attn
            B, N, C = h.shape
            t = layer.norm1(h)
            q, k, v = (t @ mha.in_proj_weight.T + mha.in_proj_bias).reshape(B, N, 3, 3, C // 3).permute(2, 0, 3, 1, 4)
            attn_outs.append(torch.softmax(q @ k.transpose(-1, -2) * (C // 3) ** -0.5, -1) @ v)
            values.append(v)
            u = naive_pid_stack(attn_outs, values, *cfg.gains)[-1]
            h = h + mha.out_proj(u.transpose(1, 2).reshape(B, N, C))
            h = layer.ffn(layer.norm2(h), identity=h)
        want = model.norm1(h)[:, 1:].reshape(2, 4, 4, C).permute(0, 3, 1, 2)
        torch.testing.assert_close(model(x)[0], want, rtol=1e-10, atol=1e-10)


def test_with_cp_gives_identical_gradients():
    ref = build(pid=dict(preset="segmenter"))
    ckpt = build(pid=dict(preset="segmenter"), with_cp=True)
    ckpt.load_state_dict(ref.state_dict())
    grads = []
    for model in (ref, ckpt):
        model.train()
        x = images().requires_grad_()
        (model(x)[0].square().mean() + model(x * 0.5)[0].mean()).backward()
        grads.append([x.grad] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 10
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_stock_mmseg_checkpoint_loads_strictly(tmp_path):
    stock = stock_backbone()
    path = tmp_path / "vit_mmseg.pth"
    torch.save({"state_dict": stock.state_dict(), "meta": {}}, path)
    model = build(attention="softmax", init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    model.init_weights()
    for k, v in stock.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert list(model.state_dict()) == list(stock.state_dict())


def test_timm_checkpoint_initialises_the_backbone(tmp_path):
    """A timm DeiT (here a PID DeiT from pid_plugins.timm) -> mmseg names; the features agree with timm's."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    torch.manual_seed(0)
    deit = timm.create_model("pid_deit_tiny_patch16_224", img_size=64, embed_dim=48, depth=3, num_heads=3,
                             attention="softmax").eval()
    path = tmp_path / "pid_deit.pth"
    torch.save({"model": deit.state_dict()}, path)
    without_bias = build(attention="softmax", init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    with pytest.raises(ValueError, match="set backbone patch_bias=True"):
        without_bias.init_weights()  # mmseg's default ViT has no patch bias; it is never dropped silently
    model = build(attention="softmax", patch_bias=True, init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    model.init_weights()
    x = images()
    with torch.no_grad():
        want = deit.forward_intermediates(x, indices=[2], norm=True, intermediates_only=True)[0]
        torch.testing.assert_close(model(x)[0], want, rtol=1e-5, atol=1e-5)
    assert set(pm.timm_vit_to_mmseg(deit.state_dict())) == set(model.state_dict())


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
    assert model.backbone.pid == PIDConfig.preset("segmenter")
    assert type(model.backbone).__name__ == "PIDVisionTransformer"


def run_tool(tool, *args, env_extra=None):
    import mmseg

    script = Path(mmseg.__file__).parent / ".mim" / "tools" / tool
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def test_mmseg_tools_train_validate_test_and_resume(tmp_path):
    from pid_plugins.mmseg.data import make_ade20k_like

    data = tmp_path / "ade_tiny"
    make_ade20k_like(data, n_train=8, n_val=2)
    opts = ["--cfg-options"] + [f"{s}_dataloader.dataset.data_root={data}" for s in ("train", "val", "test")]
    work = tmp_path / "work"
    proc = run_tool("train.py", TINY_CONFIG, "--work-dir", work, *opts)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "Iter(train) [4/4]" in log and "mIoU" in log
    assert (work / "iter_4.pth").is_file()
    # mmengine's resume/test load the whole training state with torch.load(weights_only=True), the default in
    # recent torch, which refuses mmengine's HistoryBuffer: the plugin does not weaken torch's loading.
    refused = run_tool("train.py", TINY_CONFIG, "--work-dir", work, "--resume", *opts, "train_cfg.max_iters=6")
    assert refused.returncode != 0 and "HistoryBuffer" in refused.stderr
    trusted = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # the user's explicit choice for their own checkpoints
    resumed = run_tool("train.py", TINY_CONFIG, "--work-dir", work, "--resume", *opts, "train_cfg.max_iters=6",
                       env_extra=trusted)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed epoch: 0, iter: 4" in resumed.stdout + resumed.stderr
    assert "Iter(train) [6/6]" in resumed.stdout + resumed.stderr
    tested = run_tool("test.py", TINY_CONFIG, work / "iter_6.pth", "--work-dir", tmp_path / "test", *opts,
                      env_extra=trusted)
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "mIoU" in tested.stdout + tested.stderr
