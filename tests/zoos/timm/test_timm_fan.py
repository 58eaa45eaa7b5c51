"""FAN in timm."""
import pytest
import torch

from zoo_cases import weights as zc_weights
import torch.nn.functional as F

timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401
from pid_plugins import PIDConfig, get_model_entry, list_models  # noqa: E402
from pid_plugins.timm import FAN  # noqa: E402

SMALL = dict(img_size=64, embed_dim=48, depth=3, num_heads=4, num_classes=10)
PAPER_PARAMS_M = {"fan_tiny_12_p16_224": 7.3, "fan_small_12_p16_224": 28.3,
                  "fan_base_18_p16_224": 54.0, "fan_large_24_p16_224": 80.5}


def pair(seed=0, **kwargs):
    """pid_fan (PID unless told otherwise) and fan (softmax) with identical weights, small config."""
    args = {**SMALL, **kwargs}
    pid_kwargs = {k: args.pop(k) for k in ("attention_cfg", "attention") if k in args}
    torch.manual_seed(seed)
    stock = timm.create_model("fan_tiny_12_p16_224", **args)
    model = timm.create_model("pid_fan_tiny_12_p16_224", **args, **pid_kwargs)
    result = model.load_state_dict(stock.state_dict(), strict=False)
    assert not result.unexpected_keys and all(".attention_params." in k for k in result.missing_keys)
    return model.eval(), stock.eval()


def images(n=2, size=64, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_names_come_from_the_registry():
    pid_names = list_models("pid_fan*")
    assert pid_names == ["pid_fan_base_18_p16_224", "pid_fan_large_24_p16_224", "pid_fan_small_12_p16_224",
                         "pid_fan_tiny_12_p16_224"]
    registered = set(timm.list_models("*fan*"))
    assert set(pid_names) | {get_model_entry(n).base for n in pid_names} <= registered


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAPER_PARAMS_M))
def test_real_sizes_parameter_counts_and_forward(name):
    model = timm.create_model(name).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    assert params == pytest.approx(PAPER_PARAMS_M[name], rel=0.02)
    if name == "fan_tiny_12_p16_224":
        assert params == pytest.approx(7.0, rel=0.05)  # the FAN-T figure
    assert model.attention_config is None
    pid = timm.create_model("pid_" + name).eval()
    assert pid.attention_config == PIDConfig.preset("deit")
    assert list(zc_weights(pid.state_dict())) == list(model.state_dict())
    with torch.no_grad():
        out = pid(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


def test_pid_controls_token_mixing_only():
    model, _ = pair()
    assert all(blk.attn.attention_config == PIDConfig.preset("deit") for blk in model.blocks)
    assert all(not hasattr(blk.attn, "attention_config") for blk in model.cls_attn_blocks)


def test_channel_processing_attends_over_channels():
    cp = timm.create_model("fan_tiny_12_p16_224", **SMALL).blocks[0].mlp.eval()
    x = torch.randn(2, 16, 48)
    with torch.no_grad():
        y = cp(x, 4, 4)
        v = cp.norm_v(cp.mlp_v(x, 4, 4))
        ratio = y / v
    assert y.shape == x.shape
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-4, atol=1e-5)  # same weight for all tokens
    assert (ratio > 0).all() and (ratio < 1).all()


def test_contract_head_intermediates_features():
    """FAN's own shapes (features_only, forward_intermediates, fx equal the forward: tests/core/test_method_contract.py)."""
    model, _ = pair()
    x = images()
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 1 + 16, 48)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        assert model.forward_head(feats, pre_logits=True).shape == (2, 48)
        final, inter = model.forward_intermediates(x, indices=2, norm=True)
        torch.testing.assert_close(final, feats)
        assert [t.shape for t in inter] == [(2, 48, 4, 4)] * 2
        assert all(model(images(size=size)).shape == (2, 10) for size in (32, 96))  # other input sizes
    fmodel = timm.create_model("pid_fan_tiny_12_p16_224", features_only=True, out_indices=(0, 2), **SMALL).eval()
    assert fmodel.model.cls_attn_blocks is None and fmodel.feature_info.reduction() == [16, 16]  # pruned


def test_reset_classifier_and_no_weight_decay():
    model, _ = pair(attention_cfg=dict(learnable=True))
    model.reset_classifier(3)
    assert model(images()).shape == (2, 3)
    model.reset_classifier(0, global_pool="avg")
    assert model(images()).shape == (2, 48)
    from timm.optim import create_optimizer_v2

    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if ".attention_params." in n or n.endswith("temperature") or n.startswith("pos_embed") or n == "cls_token":
            assert id(p) not in decayed, n
    assert any(names[i].endswith("attn.q.weight") for i in decayed)


def official_layout(sd, fused_qkv=False, pos_embeder=False, wrap=None):
    out = {}
    for k, v in sd.items():
        if pos_embeder and k.startswith("pos_embed."):
            k = k.replace("pos_embed.", "pos_embeder.", 1)
        out[k] = v.clone()
    if fused_qkv:
        i = 0
        while f"cls_attn_blocks.{i}.attn.q.weight" in out:
            p = f"cls_attn_blocks.{i}.attn."
            out[p + "qkv.weight"] = torch.cat([out.pop(p + s + ".weight") for s in "qkv"])
            out[p + "qkv.bias"] = torch.cat([out.pop(p + s + ".bias") for s in "qkv"])
            i += 1
    return {wrap: out} if wrap else out


@pytest.mark.parametrize("variant", [dict(), dict(wrap="model"), dict(wrap="state_dict"),
                                     dict(fused_qkv=True, pos_embeder=True, wrap="model")])
def test_official_checkpoint_layouts_load_strictly(variant, tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("fan_tiny_12_p16_224", **SMALL).eval()
    sd = source.state_dict()
    path = tmp_path / "fan_tiny.pth"
    torch.save(official_layout(sd, **variant), path)
    for name in ("fan_tiny_12_p16_224", "pid_fan_tiny_12_p16_224"):
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10), **SMALL)
        for k, v in zc_weights(model.state_dict()).items():
            assert torch.equal(v, sd[k]), k
    softmax = timm.create_model("pid_fan_tiny_12_p16_224", pretrained=True, attention="softmax",
                                pretrained_cfg_overlay=dict(file=str(path), num_classes=10), **SMALL).eval()
    with torch.no_grad():
        assert torch.equal(softmax(images()), source(images()))


def test_mismatched_checkpoint_lists_the_keys(tmp_path):
    torch.manual_seed(0)
    sd = dict(timm.create_model("fan_tiny_12_p16_224", **SMALL).state_dict())
    sd.pop("blocks.1.mlp.temperature")
    sd["blocks.1.mlp.sharpen"] = torch.ones(1)
    path = tmp_path / "bad.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError) as info:
        timm.create_model("pid_fan_tiny_12_p16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          **SMALL)
    assert "missing keys ['blocks.1.mlp.temperature']" in str(info.value)
    assert "unexpected keys ['blocks.1.mlp.sharpen']" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no pretrained weights file given for fan_tiny_12_p16_224"):
        timm.create_model("fan_tiny_12_p16_224", pretrained=True)


@pytest.mark.slow
def test_fine_tune_pid_fan_on_real_digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = timm.create_model("pid_fan_tiny_12_p16_224", img_size=32, patch_size=8, embed_dim=48, depth=2,
                              num_heads=4, num_classes=10)
    assert isinstance(model, FAN)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)

    def held_out():
        model.eval()
        with torch.no_grad():
            return F.cross_entropy(model(x[-300:]), y[-300:]).item()

    before = held_out()
    losses = []
    for _ in range(60):  # enough steps for the stem's BatchNorm running statistics to settle for eval
        model.train()
        idx = torch.randint(0, len(x) - 300, (64,), generator=g)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    assert held_out() < 0.5 * before
