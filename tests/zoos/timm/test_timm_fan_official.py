"""FAN against the official FAN function (NVlabs/FAN, FAN-ViT), re-implemented here independently."""
import math

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401

CFG = dict(img_size=64, embed_dim=48, depth=3, num_heads=4, num_classes=10)  # head_dim 12, a 4 x 4 grid
LN_EPS = 1e-6  # the model's LayerNorms
NORM_V_EPS = 1e-5  # ChannelProcessing.norm_v: PyTorch's default
BN_EPS = 1e-5


def official_shapes(embed_dim, depth, num_classes, mlp_ratio=4, cls_attn_layers=2, fused_cls_qkv=False,
                    pos_key="pos_embed"):
    """Parameter names and shapes of an official FAN-ViT checkpoint (patch size 16)."""
    C, hidden = embed_dim, embed_dim * mlp_ratio
    shapes = {}

    def linear(name, n_out, n_in, bias=True):
        shapes[f"{name}.weight"] = (n_out, n_in)
        if bias:
            shapes[f"{name}.bias"] = (n_out,)

    def norm(name, n):
        shapes[f"{name}.weight"] = shapes[f"{name}.bias"] = (n,)

    def bn(name, n):
        for p in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.{p}"] = (n,)
        shapes[f"{name}.num_batches_tracked"] = ()

    widths = [3, C // 8, C // 4, C // 2, C]
    for i, idx in enumerate((0, 2, 4, 6)):
        shapes[f"patch_embed.proj.{idx}.0.weight"] = (widths[i + 1], widths[i], 3, 3)
        bn(f"patch_embed.proj.{idx}.1", widths[i + 1])
    shapes[f"{pos_key}.token_projection.weight"] = (C, 64, 1, 1)
    shapes[f"{pos_key}.token_projection.bias"] = (C,)
    for i in range(depth):
        b = f"blocks.{i}"
        shapes[f"{b}.gamma1"] = shapes[f"{b}.gamma2"] = (C,)
        norm(f"{b}.norm1", C)
        linear(f"{b}.attn.q", C, C)
        linear(f"{b}.attn.kv", 2 * C, C)
        linear(f"{b}.attn.proj", C, C)
        norm(f"{b}.norm2", C)
        shapes[f"{b}.mlp.temperature"] = (CFG["num_heads"], 1, 1)
        linear(f"{b}.mlp.q", C, C)
        linear(f"{b}.mlp.mlp_v.fc1", hidden, C)
        shapes[f"{b}.mlp.mlp_v.gamma"] = (hidden,)
        shapes[f"{b}.mlp.mlp_v.dwconv.conv1.weight"] = shapes[f"{b}.mlp.mlp_v.dwconv.conv2.weight"] = (hidden, 1, 3, 3)
        shapes[f"{b}.mlp.mlp_v.dwconv.conv1.bias"] = shapes[f"{b}.mlp.mlp_v.dwconv.conv2.bias"] = (hidden,)
        bn(f"{b}.mlp.mlp_v.dwconv.bn", hidden)
        linear(f"{b}.mlp.mlp_v.fc2", C, hidden)
        norm(f"{b}.mlp.norm_v", C)
    shapes["cls_token"] = (1, 1, C)
    for i in range(cls_attn_layers):
        b = f"cls_attn_blocks.{i}"
        shapes[f"{b}.gamma1"] = shapes[f"{b}.gamma2"] = (C,)
        norm(f"{b}.norm1", C)
        if fused_cls_qkv:
            linear(f"{b}.attn.qkv", 3 * C, C)
        else:
            for p in "qkv":
                linear(f"{b}.attn.{p}", C, C)
        linear(f"{b}.attn.proj", C, C)
        norm(f"{b}.norm2", C)
        linear(f"{b}.mlp.fc1", hidden, C)
        linear(f"{b}.mlp.fc2", C, hidden)
    norm("norm", C)
    linear("head", num_classes, C)
    return shapes


def random_state_dict(shapes, seed=0):
    """Random values that make every part matter (non-trivial norms, BN statistics, gains, temperatures)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "num_batches_tracked":
            sd[name] = torch.tensor(7)
        elif leaf == "running_var":
            sd[name] = torch.rand(shape, generator=g) + 0.5
        elif leaf in ("gamma1", "gamma2", "gamma", "temperature") or (leaf == "weight" and len(shape) == 1):
            sd[name] = 1.0 + 0.3 * torch.randn(shape, generator=g)  # norm scales, layer scales, temperatures
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 4
            sd[name] = torch.randn(shape, generator=g) / math.sqrt(fan_in) * (1.0 if len(shape) > 1 else 0.3)
        if ".mlp_v.fc2." in name:
            sd[name] = sd[name] * 3e-3
    return sd


def official_fan(sd, x, num_heads, pid=None, control_first_layer=True):
    """FAN-ViT's forward (patch 16, Fourier positions, FAN blocks, 2 class-attention blocks), float64."""
    sd = {k: v.double() for k, v in sd.items()}
    if "pos_embeder.token_projection.weight" in sd:
        sd = {k.replace("pos_embeder.", "pos_embed."): v for k, v in sd.items()}

    def lin(t, p):
        return F.linear(t, sd[f"{p}.weight"], sd.get(f"{p}.bias"))

    def ln(t, p, eps=LN_EPS):
        return F.layer_norm(t, t.shape[-1:], sd[f"{p}.weight"], sd[f"{p}.bias"], eps)

    def bn(t, p):
        return F.batch_norm(t, sd[f"{p}.running_mean"], sd[f"{p}.running_var"], sd[f"{p}.weight"],
                            sd[f"{p}.bias"], False, 0.0, BN_EPS)

    def heads(t):  # (B, N, C) -> (B, h, N, C / h)
        B, N, C = t.shape
        return t.reshape(B, N, num_heads, C // num_heads).transpose(1, 2)

    def merge(t):
        B, h, N, d = t.shape
        return t.transpose(1, 2).reshape(B, N, h * d)

    x = x.double()
    for i, idx in enumerate((0, 2, 4, 6)):
        x = bn(F.conv2d(x, sd[f"patch_embed.proj.{idx}.0.weight"], stride=2, padding=1), f"patch_embed.proj.{idx}.1")
        if i < 3:
            x = F.gelu(x)
    B, C, H, W = x.shape
    x = x.flatten(2).transpose(1, 2)

    ys = torch.arange(1, H + 1, dtype=torch.float64)
    xs = torch.arange(1, W + 1, dtype=torch.float64)
    ys = ys / (ys[-1] + 1e-6) * 2 * math.pi
    xs = xs / (xs[-1] + 1e-6) * 2 * math.pi
    freq = 10000 ** (2 * torch.div(torch.arange(32), 2, rounding_mode="floor").double() / 32)

    def features(coord):  # (n,) -> (n, 32)
        f = coord[:, None] / freq
        out = torch.empty_like(f)
        out[:, 0::2], out[:, 1::2] = f[:, 0::2].sin(), f[:, 1::2].cos()
        return out

    fy, fx = features(ys), features(xs)
    grid = torch.cat([fy[:, None, :].expand(H, W, 32), fx[None, :, :].expand(H, W, 32)], dim=-1)  # (H, W, 64)
    pos = F.conv2d(grid.permute(2, 0, 1)[None], sd["pos_embed.token_projection.weight"],
                   sd["pos_embed.token_projection.bias"])
    x = x + pos.flatten(2).transpose(1, 2)

    state = None
    i = 0
    while f"blocks.{i}.gamma1" in sd:
        b = f"blocks.{i}"
        h = ln(x, f"{b}.norm1")
        q = heads(lin(h, f"{b}.attn.q"))
        k, v = lin(h, f"{b}.attn.kv").chunk(2, dim=-1)
        k, v = heads(k), heads(v)
        out = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
        if pid is not None:
            lp, li, ld, beta = pid
            if state is None and not control_first_layer:
                v1, S, e = v, None, None
            elif state is None or state[1] is None:
                v1 = v if state is None else state[0]
                e = beta * v1 - v
                S = e
                out = out + lp * e + li * S
            else:
                v1, S, e_prev = state
                e = beta * v1 - v
                S = S + e
                out = out + lp * e + li * S + ld * (e - e_prev)
            state = (v1, S, e)
        x = x + sd[f"{b}.gamma1"] * lin(merge(out), f"{b}.attn.proj")

        h = ln(x, f"{b}.norm2")
        qc = heads(lin(h, f"{b}.mlp.q")).softmax(dim=-2).transpose(-1, -2)  # (B, h, d, N)
        kc = heads(h).softmax(dim=-2).mean(dim=-1, keepdim=True)  # (B, h, N, 1)
        attn = torch.sigmoid(qc @ kc) * sd[f"{b}.mlp.temperature"]  # (B, h, d, 1)
        t = lin(h, f"{b}.mlp.mlp_v.fc1")  # fc1 -> t + gamma * DWConv(t) -> fc2, no activation after the sum
        hid = t.shape[-1]
        g = t.transpose(1, 2).reshape(B, hid, H, W)
        p = f"{b}.mlp.mlp_v.dwconv"
        g = F.conv2d(g, sd[f"{p}.conv1.weight"], sd[f"{p}.conv1.bias"], padding=1, groups=hid)
        g = bn(F.gelu(g), f"{p}.bn")
        g = F.conv2d(g, sd[f"{p}.conv2.weight"], sd[f"{p}.conv2.bias"], padding=1, groups=hid)
        t = t + sd[f"{b}.mlp.mlp_v.gamma"] * g.reshape(B, hid, H * W).transpose(1, 2)
        vc = heads(ln(lin(t, f"{b}.mlp.mlp_v.fc2"), f"{b}.mlp.norm_v", NORM_V_EPS))  # (B, h, N, d)
        out = (attn * vc.transpose(-1, -2)).permute(0, 3, 1, 2).reshape(B, H * W, C)
        x = x + sd[f"{b}.gamma2"] * out
        i += 1

    x = torch.cat([sd["cls_token"].expand(B, -1, -1), x], dim=1)
    i = 0
    while f"cls_attn_blocks.{i}.gamma1" in sd:
        b = f"cls_attn_blocks.{i}"
        if f"{b}.attn.qkv.weight" in sd:
            for j, name in enumerate("qkv"):
                sd[f"{b}.attn.{name}.weight"] = sd[f"{b}.attn.qkv.weight"].chunk(3)[j]
                sd[f"{b}.attn.{name}.bias"] = sd[f"{b}.attn.qkv.bias"].chunk(3)[j]
        xn = ln(x, f"{b}.norm1")
        q = heads(lin(xn[:, :1], f"{b}.attn.q"))
        k, v = heads(lin(xn, f"{b}.attn.k")), heads(lin(xn, f"{b}.attn.v"))
        cls = lin(merge(((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1) @ v), f"{b}.attn.proj")
        x = x + sd[f"{b}.gamma1"] * torch.cat([cls, xn[:, 1:]], dim=1)
        x = ln(x, f"{b}.norm2")
        cls = sd[f"{b}.gamma2"] * lin(F.gelu(lin(x[:, :1], f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
        x = x + torch.cat([cls, x[:, 1:]], dim=1)
        i += 1
    return lin(ln(x, "norm")[:, 0], "head")


def images(n=2, size=64, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def build(name, **kwargs):
    return timm.create_model(name, **{**CFG, **kwargs}).double().eval()


def assert_rel_close(actual, expected, rel=1e-5):
    err = (actual - expected).abs().max() / expected.abs().max()
    assert err <= rel, f"max relative difference {err:.3g} > {rel}"


def test_the_layout_is_the_official_one():
    shapes = official_shapes(CFG["embed_dim"], CFG["depth"], CFG["num_classes"])
    model = build("fan_tiny_12_p16_224")
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes


@pytest.mark.parametrize("fused_attn", [True, False])
def test_fan_computes_the_official_function(fused_attn):
    sd = random_state_dict(official_shapes(CFG["embed_dim"], CFG["depth"], CFG["num_classes"]))
    model = build("fan_tiny_12_p16_224")
    model.load_state_dict(sd, strict=True)
    for blk in model.blocks:
        blk.attn.fused_attn = fused_attn
    x = images()
    with torch.no_grad():
        assert_rel_close(model(x), official_fan(sd, x, CFG["num_heads"]))
    for blk in model.blocks:
        blk.mlp.norm_v.eps = 1e-6
    with torch.no_grad():
        with pytest.raises(AssertionError):
            assert_rel_close(model(x), official_fan(sd, x, CFG["num_heads"]), rel=1e-3)
    for blk in model.blocks:
        blk.mlp.norm_v.eps = NORM_V_EPS
    mlp = pid_plugins.timm.fan.ChannelMlp
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(mlp, "forward", lambda self, t, H, W: self.fc2(F.gelu(self.fc1(t) + self.gamma
                                                                           * self.dwconv(self.fc1(t), H, W))))
        with pytest.raises(AssertionError):
            assert_rel_close(model(x), official_fan(sd, x, CFG["num_heads"]), rel=1e-3)


@pytest.mark.parametrize("control_first_layer", [True, False])
def test_pid_fan_computes_the_official_function_with_pid_token_mixing(control_first_layer):
    sd = random_state_dict(official_shapes(CFG["embed_dim"], CFG["depth"], CFG["num_classes"]), seed=3)
    gains = dict(lambda_p=0.6, lambda_i=0.3, lambda_d=0.2, beta=0.4)
    model = build("pid_fan_tiny_12_p16_224", attention_cfg=dict(gains, control_first_layer=control_first_layer))
    model.load_state_dict(sd, strict=True)
    x = images(seed=4)
    with torch.no_grad():
        out = model(x)
        assert_rel_close(out, official_fan(sd, x, CFG["num_heads"], pid=tuple(gains.values()),
                                           control_first_layer=control_first_layer))
        assert (out - official_fan(sd, x, CFG["num_heads"])).abs().max() > 1e-3  # PID does change it


@pytest.mark.parametrize("variant", ["plain", "fused_qkv", "pos_embeder", "both_wrapped"])
@pytest.mark.parametrize("name", ["fan_tiny_12_p16_224", "pid_fan_tiny_12_p16_224"])
def test_official_checkpoint_variants_load_and_compute_the_official_function(variant, name, tmp_path):
    fused = variant in ("fused_qkv", "both_wrapped")
    pos_key = "pos_embeder" if variant in ("pos_embeder", "both_wrapped") else "pos_embed"
    sd = random_state_dict(official_shapes(CFG["embed_dim"], CFG["depth"], CFG["num_classes"],
                                           fused_cls_qkv=fused, pos_key=pos_key), seed=5)
    path = tmp_path / "fan.pth"
    torch.save({"model": sd} if variant == "both_wrapped" else sd, path)
    kwargs = dict(attention_cfg=dict(lambda_p=0.0, lambda_i=0.0, lambda_d=0.0)) if name.startswith("pid_") else {}
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10),
                              **CFG, **kwargs).double().eval()
    x = images(seed=6)
    with torch.no_grad():
        assert_rel_close(model(x), official_fan(sd, x, CFG["num_heads"]))


def test_official_initialisation():
    """The official init."""
    torch.manual_seed(0)
    model = timm.create_model("fan_tiny_12_p16_224")
    sd = model.state_dict()
    dw = torch.cat([sd[f"blocks.{i}.mlp.mlp_v.dwconv.conv{j}.weight"].flatten() for i in range(12) for j in (1, 2)])
    assert dw.std().item() == pytest.approx(math.sqrt(2 / 9), rel=0.02)
    assert all(sd[f"blocks.{i}.mlp.mlp_v.dwconv.conv{j}.bias"].abs().max() == 0 for i in range(12) for j in (1, 2))
    lin = sd["blocks.0.mlp.mlp_v.fc1.weight"]
    assert lin.std().item() == pytest.approx(0.02, rel=0.05) and lin.abs().max() <= 2.0
    assert sd["blocks.0.attn.kv.bias"].abs().max() == 0 and sd["head.bias"].abs().max() == 0
    assert (sd["blocks.0.mlp.norm_v.weight"] == 1).all() and model.blocks[0].mlp.norm_v.eps == NORM_V_EPS
    assert model.blocks[0].norm1.eps == LN_EPS
    assert (sd["blocks.0.gamma1"] == 1).all() and (sd["blocks.0.mlp.temperature"] == 1).all()
    stem = sd["patch_embed.proj.0.0.weight"]  # PyTorch's kaiming-uniform(a=sqrt(5)): bound 1/sqrt(fan_in)
    assert stem.abs().max() <= 1 / math.sqrt(3 * 9) + 1e-6 and stem.std() > 0.5 / math.sqrt(3 * 9) / math.sqrt(3)


def test_pretrained_cfg_is_the_official_one():
    cfg = timm.create_model("fan_tiny_12_p16_224").pretrained_cfg
    assert cfg["crop_pct"] == 1.0 and cfg["interpolation"] == "bicubic" and cfg["input_size"] == (3, 224, 224)
    assert tuple(cfg["mean"]) == timm.data.IMAGENET_DEFAULT_MEAN and tuple(cfg["std"]) == timm.data.IMAGENET_DEFAULT_STD
