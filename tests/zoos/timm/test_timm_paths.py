"""The timm paths one step off the main road."""
import pytest
import torch

from zoo_cases import weights as zc_weights

timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401
from pid_plugins import PIDConfig  # noqa: E402
from pid_plugins.core.methods import _fx_update  # noqa: E402

DEIT = dict(img_size=32, patch_size=8, embed_dim=72, depth=2, num_heads=3)
FAN = dict(img_size=32, embed_dim=48, depth=2, num_heads=4)


def images(n=2, size=32, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A softmax DeiT and a FAN checkpoint with a 1000-class head (the pretrained cfg's)."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    deit = timm.create_model("deit_tiny_patch16_224", **DEIT)
    fan = timm.create_model("fan_tiny_12_p16_224", **FAN)
    paths = dict(deit=root / "deit.pth", fan=root / "fan.pth")
    torch.save(deit.state_dict(), paths["deit"])
    torch.save(fan.state_dict(), paths["fan"])
    return paths


@pytest.mark.parametrize("num_classes", [0, 7, 1000])
def test_pretrained_with_a_new_head_or_none_behaves_as_stock_timm(checkpoints, num_classes):
    path = str(checkpoints["deit"])
    kw = dict(pretrained=True, num_classes=num_classes, pretrained_cfg_overlay=dict(file=path), **DEIT)
    torch.manual_seed(1)
    stock = timm.create_model("deit_tiny_patch16_224", **kw).eval()
    torch.manual_seed(1)
    soft = timm.create_model("pid_deit_tiny_patch16_224", attention="softmax", **kw).eval()
    pid = timm.create_model("pid_deit_tiny_patch16_224", **kw).eval()
    saved = torch.load(path, weights_only=True)
    for model in (soft, pid):
        sd = zc_weights(model.state_dict())
        assert list(sd) == list(stock.state_dict())
        assert all(torch.equal(sd[k], v) for k, v in saved.items() if not k.startswith("head."))
        assert model.num_classes == num_classes
    x = images()
    with torch.no_grad():
        assert torch.equal(soft(x), stock(x))  # same loaded weights, same fresh head (same seed), same function
        out = pid(x)
    assert out.shape == (2, num_classes or 72)
    if num_classes == 1000:  # the checkpoint's head is kept
        assert torch.equal(pid.head.weight, saved["head.weight"])
    elif num_classes:  # a fresh head, as timm's (stock timm drops the checkpoint's)
        assert torch.equal(soft.head.weight, stock.head.weight)


@pytest.mark.parametrize("num_classes", [0, 7])
@pytest.mark.parametrize("name", ["fan_tiny_12_p16_224", "pid_fan_tiny_12_p16_224"])
def test_pretrained_fan_with_a_new_head_or_none(checkpoints, name, num_classes):
    saved = torch.load(checkpoints["fan"], weights_only=True)
    model = timm.create_model(name, pretrained=True, num_classes=num_classes,
                              pretrained_cfg_overlay=dict(file=str(checkpoints["fan"])), **FAN).eval()
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in saved.items() if not k.startswith("head."))
    assert ("head.weight" in sd) == bool(num_classes)
    if num_classes:
        assert sd["head.weight"].shape == (num_classes, 48)
    with torch.no_grad():
        assert model(images()).shape == (2, num_classes or 48)


def test_a_checkpoint_that_does_not_fit_is_still_refused_with_a_new_head(checkpoints):
    with pytest.raises(ValueError, match="missing keys"):
        timm.create_model("pid_deit_tiny_patch16_224", pretrained=True, num_classes=0,
                          pretrained_cfg_overlay=dict(file=str(checkpoints["deit"])), **{**DEIT, "depth": 3})


@pytest.mark.parametrize("attn_layer", ["diff", torch.nn.Identity])
def test_attn_layer_is_refused_with_a_clear_error(attn_layer):
    with pytest.raises(ValueError, match="attn_layer=.* is not supported"):
        timm.create_model("pid_deit_tiny_patch16_224", attn_layer=attn_layer, **DEIT)
    model = timm.create_model("pid_deit_tiny_patch16_224", attn_layer="attn", **DEIT)
    assert type(model.blocks[0].attn).__name__ == "PIDAttention"


@pytest.mark.parametrize("name,cfg", [("pid_deit_tiny_patch16_224", DEIT), ("pid_fan_tiny_12_p16_224", FAN)])
@pytest.mark.parametrize("learnable,control_first_layer", [(False, True), (True, True), (False, False)])
def test_fx_feature_extraction(name, cfg, learnable, control_first_layer):
    """timm's and torchvision's fx feature extraction trace PID models (the PID step is a leaf)."""
    from timm.models import create_feature_extractor
    from torchvision.models.feature_extraction import get_graph_node_names

    torch.manual_seed(0)
    pid = PIDConfig.preset("deit", learnable=learnable, control_first_layer=control_first_layer)
    model = timm.create_model(name, attention_cfg=pid, **cfg).eval()
    assert "blocks.1.add_1" in get_graph_node_names(model)[1]  # plain torchvision, no timm tracer lists
    extractor = create_feature_extractor(model, return_nodes={"blocks.1.add_1": "block", "head": "logits"})
    steps = [n for n in extractor.graph.nodes if n.op == "call_function" and n.target is _fx_update]
    assert len(steps) == 2  # one leaf call per PID layer
    x = images()
    with torch.no_grad():
        feats = extractor(x)
        expected = model.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)[0]
        torch.testing.assert_close(feats["logits"], model(x), rtol=0, atol=0)
    prefix = model.num_prefix_tokens if name.startswith("pid_deit") else 0
    torch.testing.assert_close(feats["block"][:, prefix:], expected, rtol=0, atol=0)
    extractor.train()
    extractor(x)["logits"].sum().backward()
    assert model.blocks[0].attn.proj.weight.grad is not None
    if learnable:
        assert all(p.grad is not None for p in model.blocks[1].attn.attention_params.parameters())


@pytest.mark.parametrize("name", ["pid_deit_tiny_patch16_224", "fan_tiny_12_p16_224", "pid_fan_tiny_12_p16_224"])
def test_device_and_dtype_construction_kwargs(name):
    cfg = DEIT if "deit" in name else FAN
    model = timm.create_model(name, device="meta", dtype=torch.float64, **cfg)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    model = timm.create_model(name, dtype=torch.float64, **cfg).eval()
    with torch.no_grad():
        assert model(images().double()).dtype == torch.float64


STAND_IN_VALIDATE = '''
"""Makes timm validate.py's model calls: create_model(args.model, ..., **args.model_kwargs), load_checkpoint."""
import argparse, json
import torch
from timm.models import create_model, is_model, load_checkpoint
from timm.utils import ParseKwargs

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("--split", default="validation")
parser.add_argument("--model", required=True)
parser.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs)
parser.add_argument("--checkpoint", default="")
parser.add_argument("--num-classes", type=int, default=None)
args = parser.parse_args()
assert is_model(args.model), args.model
model = create_model(args.model, pretrained=False, num_classes=args.num_classes, in_chans=3, global_pool=None,
                     scriptable=False, **args.model_kwargs)
load_checkpoint(model, args.checkpoint, False)
model.eval()
with torch.no_grad():
    out = model(torch.load(args.data, weights_only=True))
print(json.dumps(dict(pid=model.attention_config.to_dict(), logits=out.tolist())))
'''


@pytest.mark.integration
@pytest.mark.slow
def test_the_readme_validate_py_command(tmp_path):
    """The validate.py command of the timm docs page (docs/timm.md, as written there) imports the plugin before
    running the script."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "docs" / "timm.md").read_text()
    program = re.search(r'python -c "(import runpy, sys, pid_plugins\.timm;[^"]*)" \\\n\s+validate\.py', readme).group(1)
    gains = {"lambda_p": 0.8, "lambda_i": 0.5, "lambda_d": 0.05, "beta": 0.1}
    assert f'--model-kwargs attention_cfg="{gains}"' in readme
    torch.manual_seed(0)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=gains, **DEIT, num_classes=2).eval()
    torch.save({"epoch": 0, "arch": "pid_deit_tiny_patch16_224", "state_dict": model.state_dict()},
               tmp_path / "model_best.pth.tar")
    x = images()
    torch.save(x, tmp_path / "batch.pt")
    (tmp_path / "validate.py").write_text(STAND_IN_VALIDATE)
    kwargs = [f"attention_cfg={gains}"] + [f"{k}={v}" for k, v in DEIT.items()]
    proc = subprocess.run(
        [sys.executable, "-c", program, "validate.py", str(tmp_path / "batch.pt"), "--split", "validation",
         "--model", "pid_deit_tiny_patch16_224", "--model-kwargs", *kwargs,
         "--num-classes", "2", "--checkpoint", str(tmp_path / "model_best.pth.tar")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["pid"] == PIDConfig.preset("deit", **gains).to_dict()
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(result["logits"]), model(x), rtol=1e-6, atol=1e-6)
