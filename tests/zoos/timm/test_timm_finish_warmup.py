"""``pid_plugins.finish_warmup(model)`` on timm models (PID DeiT, FAN; PID, NeuTRENO, learnable PID; built by
name or converted): after training past ``warmup_steps`` the finished model computes exactly (torch.equal) what
the warmed-up model computed, has no ``attention_warmup.step``, is the model built without warm-up with the same
weights, and still exports with timm's ``onnx_export`` and traces with timm's fx feature extraction."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")
import pid_plugins  # noqa: E402
import pid_plugins.timm as pt  # noqa: E402
from pid_plugins.core.methods import _fx_update  # noqa: E402
from method_cases import variants  # noqa: E402
from zoo_cases import DEIT, FAN  # noqa: E402

N = 3
MODELS = {"deit": ("pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", DEIT),
          "fan": ("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", FAN)}
#: every built-in method with warm-up (the preset), learnable too where it has learnable parameters
VARIANTS = variants(methods=lambda m: m.warmup)


def images(kind, n=4, seed=1):
    size = MODELS[kind][2]["img_size"]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def build(kind, method, warmup_steps=N, converted=False):
    name, base, args = MODELS[kind]
    attention, cfg = VARIANTS[method]
    cfg = dict(cfg or {}, warmup_steps=warmup_steps) if warmup_steps else cfg
    torch.manual_seed(0)
    if converted:  # a stock model switched in place
        return pt.convert(timm.create_model(base, **args), attention, cfg)
    return timm.create_model(name, attention=attention, attention_cfg=cfg, **args)


def warmed_up(kind, method, converted=False):
    """A model trained for N + 1 steps (t = N + 1 > N: scale 1), in eval mode."""
    model = build(kind, method, converted=converted).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = images(kind, seed=2), torch.arange(4) % 10
    for _ in range(N + 1):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert int(model.attention_warmup.step) == N + 1
    return model.eval()


CASES = [(kind, method, False) for kind in MODELS for method in VARIANTS] + [("deit", "pid", True)]


@pytest.mark.parametrize("kind, method, converted", CASES)
def test_finished_model_is_the_warmed_up_function_without_the_counter(kind, method, converted):
    model = warmed_up(kind, method, converted)
    x = images(kind)
    with torch.no_grad():
        want = model(x)
    if method == "learnable_pid":  # the learned gains moved during warm-up and are kept as trained
        gains = {n: p.clone() for n, p in model.named_parameters() if ".attention_params." in n}
        initial = dict(build(kind, method, converted=converted).named_parameters())
        assert gains and any(not torch.equal(p, initial[n]) for n, p in gains.items())
    assert pid_plugins.finish_warmup(model) is model
    assert "attention_warmup.step" not in model.state_dict()
    assert getattr(model.blocks, "warmup_counter", None) is None  # the ViT container's reference goes too
    if converted:  # a stock root keeps its class: the counter was its submodule, the layers hold the method
        assert not hasattr(model, "attention_warmup")
    else:
        assert model.attention_warmup is None and model.attention_config.warmup_steps == 0
    assert all(blk.attn.attention_config.warmup_steps == 0 for blk in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    if method == "learnable_pid":
        assert all(torch.equal(p, gains[n]) for n, p in model.named_parameters() if ".attention_params." in n)
    # the model built without warm-up, with these weights, is the same function
    plain = build(kind, method, warmup_steps=0, converted=converted).eval()
    plain.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(plain(x), want)
    model.train()
    model(x)  # a training forward no longer counts anything
    assert "attention_warmup.step" not in model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_finished_model_traces_with_fx_and_exports_with_timms_onnx_export(kind, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    from timm.models import create_feature_extractor
    from timm.utils.onnx import onnx_export

    model = pid_plugins.finish_warmup(warmed_up(kind, "learnable_pid"))
    x = images(kind, n=3)
    with torch.no_grad():
        want = model(x)
    extractor = create_feature_extractor(model, return_nodes={"head": "logits"})
    nodes = list(extractor.graph.nodes)
    assert sum(n.op == "call_function" and n.target is _fx_update for n in nodes) == len(model.blocks)
    assert not any("attention_warmup" in str(n.target) for n in nodes)  # no counter left in the graph
    with torch.no_grad():
        assert torch.equal(extractor(x)["logits"], want)
    size = MODELS[kind][2]["img_size"]
    path = tmp_path / "model.onnx"
    onnx_export(model, str(path), input_size=(3, size, size), batch_size=2, check=True)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"input0": x.numpy().astype(np.float32)})[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
