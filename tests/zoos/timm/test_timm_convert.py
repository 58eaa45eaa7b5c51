"""``pid_plugins.timm.convert(model, attention, attention_cfg)``: a built timm model's attention switched IN PLACE.

References: the ``pid_*`` model built by name with the same weights loaded strictly (bit for bit), and the stock
timm model itself (softmax: timm's own classes again, its exact attributes, state_dict keys and outputs). A stock
root keeps its class (its ``blocks`` become ``MethodBlocks``, its ``forward_features`` / ``forward_intermediates``
the method classes'): it runs every path the model built by name runs (tests/core/test_convert_whole_model.py, every
method).
"""
import copy

import pytest
import torch

timm = pytest.importorskip("timm")
import pid_plugins  # noqa: E402
import pid_plugins.timm as pt  # noqa: E402
from timm.layers import Attention  # noqa: E402
from timm.models.deit import VisionTransformerDistilled  # noqa: E402
from timm.models.vision_transformer import Block, VisionTransformer  # noqa: E402
from method_cases import variants  # noqa: E402
from zoo_cases import DEIT, FAN  # noqa: E402

#: every built-in method with its parameters on the contract's DeiT (tests/method_cases.py)
METHOD_CFG = {key: cfg for key, (_, cfg) in variants("timm-deit", learnable=False).items()}
PID_NAME, STOCK_NAME = "pid_deit_tiny_patch16_224", "deit_tiny_patch16_224"


def stock(name=STOCK_NAME, seed=0, **kwargs):
    torch.manual_seed(seed)
    return timm.create_model(name, **{**DEIT, **kwargs}).eval()


def named(attention="pid", attention_cfg=None, weights=None, name=PID_NAME, args=DEIT):
    """The model built by its pid-plugins name, with ``weights`` loaded strictly."""
    model = timm.create_model(name, attention=attention, attention_cfg=attention_cfg, **args).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def images(size=32, n=2, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def layout(model, ordered=True):
    """Everything nn.Module keeps, per module: class, plain attributes, submodule/parameter/buffer names (in order,
    unless ``ordered=False``: FAN's own ``__init__`` makes its warm-up counter first, ``convert`` adds it last)."""
    names = list if ordered else sorted
    return names((name, type(m), sorted(vars(m)), names(m._modules), list(m._parameters), list(m._buffers),
                  m.training) for name, m in model.named_modules())


# --------------------------------------------------------------------------------------- stock -> method
@pytest.mark.parametrize("method", METHOD_CFG)
def test_a_stock_deit_converted_in_place_equals_the_named_model(method):
    model = stock()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    x = images()
    with torch.no_grad():
        y_stock = model(x)
    assert pt.convert(model, method, METHOD_CFG[method]) is model
    assert type(model) is VisionTransformer and type(model.blocks) is pt.MethodBlocks  # the root keeps its class
    assert all(type(b) is pt.PIDBlock and type(b.attn) is pt.PIDAttention for b in model.blocks)
    assert all(p is q for p, q in zip(model.parameters(), params))  # the same tensors, nothing copied
    reference = named(method, METHOD_CFG[method], weights)
    # below the root: the attributes the PID classes' __init__ sets, nothing else; the root: the same submodules
    assert layout(model)[1:] == layout(reference)[1:] and layout(model)[0][3:] == layout(reference)[0][3:]
    assert list(model.state_dict()) == list(reference.state_dict())
    with torch.no_grad():
        y = model(x)
        assert torch.equal(y, reference(x))
        assert not torch.allclose(y, y_stock, atol=1e-4)  # the method is on


def test_distilled_deit_converts_and_goes_back():
    model = stock("deit_tiny_distilled_patch16_224")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x = images()
    with torch.no_grad():
        y_stock = model(x)
        pt.convert(model, "pid")
        assert type(model) is VisionTransformerDistilled and type(model.blocks) is pt.MethodBlocks
        assert all(b.attn.attention_config == pid_plugins.PIDConfig.preset("deit") for b in model.blocks)
        assert torch.equal(model(x), named(weights=weights, name="pid_deit_tiny_distilled_patch16_224")(x))
        pt.convert(model, "softmax")
        assert type(model) is VisionTransformerDistilled and torch.equal(model(x), y_stock)


# --------------------------------------------------------------------------------------- method -> softmax
@pytest.mark.parametrize("cfg", [None, {"learnable": True, "warmup_steps": 5}], ids=["fixed", "learnable_warmup"])
def test_softmax_goes_back_to_timms_own_classes_bit_for_bit(cfg):
    model = stock()
    pristine = layout(model)
    keys = list(model.state_dict())
    handle_calls = []
    model.blocks[1].register_forward_hook(lambda *args: handle_calls.append(1))  # a user's hook survives
    x = images()
    with torch.no_grad():
        y_stock = model(x)
        pt.convert(model, "pid", cfg)
        pt.convert(model, "neutreno")  # method -> method, in place
        pt.convert(model, "pid", cfg)
        model(x)
        assert pt.convert(model, "softmax") is model
        assert type(model) is VisionTransformer
        assert all(type(b) is Block and type(b.attn) is Attention for b in model.blocks)
        assert layout(model) == pristine  # every attribute, submodule, parameter and buffer we added is gone
        assert list(model.state_dict()) == keys
        assert torch.equal(model(x), y_stock)
    assert len(handle_calls) == 3


def test_a_model_built_by_pid_name_keeps_its_class_and_computes_the_stock_model():
    model = named("pid", {"learnable": True, "warmup_steps": 3})
    reference = stock()
    model.load_state_dict(reference.state_dict(), strict=False)
    x = images()
    pt.convert(model, "softmax")
    assert type(model) is pt.PIDVisionTransformer and model.attention_method is None
    assert model.attention_warmup is None and model.blocks.warmup_counter is None
    assert list(model.state_dict()) == list(reference.state_dict())  # no gains, no counter
    mask = torch.zeros(17, 17)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x, attn_mask=mask), reference(x, attn_mask=mask))


# ----------------------------------------------------------------------------- learnable gains and warm-up
def test_learnable_gains_are_created_on_the_models_device_dtype_and_mode():
    model = stock().double()
    pt.convert(model, "pid", {"learnable": True})
    gains = [n for n, _ in model.named_parameters() if ".attention_params." in n]
    assert len(gains) == 3 * DEIT["depth"]
    assert all(p.dtype == torch.float64 for n, p in model.named_parameters() if ".attention_params." in n)
    assert not any(m.training for m in model.modules())  # eval model: the new gains modules are in eval too
    # the root keeps timm's no_weight_decay; timm's optimizer factory leaves the (0/1-dim) gains undecayed
    from timm.optim import param_groups_weight_decay

    undecayed = {id(p) for g in param_groups_weight_decay(model, 0.05) if g["weight_decay"] == 0 for p in g["params"]}
    assert all(id(p) in undecayed for n, p in model.named_parameters() if ".attention_params." in n)
    reference = named("pid", {"learnable": True}).double()
    assert list(model.state_dict()) == list(reference.state_dict())
    pt.convert(model, "pid", {"learnable": False})
    assert not any(".attention_params." in n for n, _ in model.named_parameters())


def test_warmup_counter_is_created_follows_the_mode_and_is_removed():
    model = stock()
    pt.convert(model, "pid", {"warmup_steps": 4})
    assert isinstance(model.attention_warmup, pid_plugins.GainWarmup) and not model.attention_warmup.training
    assert model.blocks.warmup_counter is model.attention_warmup  # a plain reference: saved once, at the root
    assert "attention_warmup.step" in model.state_dict()
    x = images()
    with torch.no_grad():
        model(x)
    assert int(model.attention_warmup.step) == 0  # eval forwards do not count
    model.train()
    model(x)
    assert int(model.attention_warmup.step) == 1
    pt.convert(model, "pid", {"warmup_steps": 8})  # another N: t carries over
    counter = model.attention_warmup
    assert counter.warmup_steps == 8 and int(counter.step) == 1 and counter.training
    pt.convert(model, "pid")  # no warm-up: the counter goes
    assert not hasattr(model, "attention_warmup") and "attention_warmup.step" not in model.state_dict()
    assert model.blocks.warmup_counter is None
    pt.convert(model, "pid", {"warmup_steps": 4})
    pt.convert(model, "softmax")
    assert not hasattr(model, "attention_warmup") and "attention_warmup.step" not in model.state_dict()


# --------------------------------------------------------------------------------------------------- FAN
def test_fan_round_trip_in_place():
    torch.manual_seed(0)
    model = timm.create_model("fan_tiny_12_p16_224", **FAN).eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    pristine = layout(model)
    params = dict(model.named_parameters())
    x = images(FAN["img_size"])
    with torch.no_grad():
        y_stock = model(x)
        assert pt.convert(model, "pid", {"learnable": True, "warmup_steps": 3}) is model
        after = dict(model.named_parameters())
        assert all(after[n] is p for n, p in params.items()) and len(after) == len(params) + 3 * FAN["depth"]
        assert not model.attention_warmup.training and not model.blocks[0].attn.attention_params.training
        reference = named("pid", {"learnable": True, "warmup_steps": 3}, name="pid_fan_tiny_12_p16_224", args=FAN)
        reference.load_state_dict(model.state_dict())
        assert layout(model, ordered=False) == layout(reference, ordered=False)
        assert torch.equal(model(x), reference(x))
        pt.convert(model, "elliptical")
        assert torch.equal(model(x), named("elliptical", None, weights, "pid_fan_tiny_12_p16_224", FAN)(x))
        assert pt.convert(model, "softmax") is model
        assert type(model) is pt.FAN and layout(model) == pristine
        assert list(model.state_dict()) == list(weights)
        assert torch.equal(model(x), y_stock)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.slow
def test_refusals_come_before_any_change():
    from timm.models.vision_transformer import ResPostBlock

    model = stock()
    pristine, keys = layout(model), list(model.state_dict())
    with pytest.raises(ValueError, match=r"unknown attention method 'nope': choose 'softmax' or one of \["):
        pt.convert(model, "nope")
    with pytest.raises(ValueError, match="PIDConfig.lambda_d"):
        pt.convert(model, "pid", {"lambda_d": -0.1})
    # mixed head shapes: one block with another number of heads (a model timm builds only by hand)
    odd = copy.deepcopy(model)
    odd.blocks[2] = Block(48, num_heads=4)
    odd_layout = layout(odd)
    with pytest.raises(ValueError, match=r"one \(num_heads, head_dim\).*\[\(3, 16\), \(4, 12\)\]"):
        pt.convert(odd, "pid")
    assert layout(odd) == odd_layout
    assert pt.convert(odd, "softmax") is odd and layout(odd) == odd_layout  # softmax: nothing to do
    # a non-standard block anywhere: nothing converted, not even the blocks before it
    post = timm.models.VisionTransformer(block_fn=ResPostBlock, **DEIT)
    mixed = copy.deepcopy(model)
    mixed.blocks[2] = post.blocks[0]
    mixed_layout = layout(mixed)
    with pytest.raises(TypeError, match="block 2 is ResPostBlock with Attention attention"):
        pt.convert(mixed, "pid")
    assert layout(mixed) == mixed_layout
    with pytest.raises(TypeError, match="got ResNet"):
        pt.convert(timm.create_model("resnet10t"), "pid")
    with pytest.raises(TypeError, match="before torch.compile"):
        pt.convert(torch.compile(stock()), "pid")
    assert layout(model) == pristine and list(model.state_dict()) == keys


# ------------------------------------------------------------------------------------- timm's model contract
@pytest.mark.slow
def test_forward_intermediates_fx_checkpointing_compile_and_checkpoint_load(tmp_path):
    from timm.models import get_graph_node_names
    from torchvision.models.feature_extraction import create_feature_extractor as tv_feature_extractor
    from torchvision.models.feature_extraction import get_graph_node_names as tv_graph_node_names
    from pid_plugins.core.methods import _fx_update

    cfg = {"learnable": True}
    model = stock()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    pt.convert(model, "pid", cfg)
    reference = named("pid", cfg)
    reference.load_state_dict(model.state_dict())
    x = images()
    # timm's own loops over the blocks (intermediates, attn_mask, fx feature extraction, checkpointing) run the
    # method on the converted root as on the model built by name
    mask = torch.zeros(17, 17)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=[0, 2])
        want_final, want_inter = reference.forward_intermediates(x, indices=[0, 2])
        assert torch.equal(final, want_final) and all(torch.equal(a, b) for a, b in zip(inter, want_inter))
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
        assert torch.equal(model(x, attn_mask=mask), reference(x, attn_mask=mask))
        torch.testing.assert_close(model(x, attn_mask=mask), model(x))  # a zero mask: the plain forward
    # torch.fx: timm's feature extraction (attn_mask traced as an input) and torchvision's (constants)
    assert get_graph_node_names(model) == get_graph_node_names(reference)
    constants = {"attn_mask": None, "is_causal": False}
    assert "blocks.1.add_1" in tv_graph_node_names(model, concrete_args=constants)[1]
    extractor = tv_feature_extractor(model, return_nodes={"blocks.1.add_1": "block", "head": "logits"},
                                     concrete_args=constants)
    assert sum(n.op == "call_function" and n.target is _fx_update for n in extractor.graph.nodes) == DEIT["depth"]
    with torch.no_grad():
        out = extractor(x)
        assert torch.equal(out["logits"], reference(x))
        one = reference.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)[0]
        assert torch.equal(out["block"][:, reference.num_prefix_tokens:], one)
    # gradient checkpointing (timm's switch): each block checkpointed with its state, the gradients of the model
    # built by name
    model.train(), reference.train()
    model.set_grad_checkpointing(True)
    reference.set_grad_checkpointing(True)
    model(x).sum().backward()
    reference(x).sum().backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=0)
    model.set_grad_checkpointing(False)
    model.eval()
    # torch.compile of the converted model
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)
    # a checkpoint saved by a pid_* model loads strictly into a converted one (learned gains, warm-up step)
    saved = named("pid", {"learnable": True, "warmup_steps": 10})
    saved.load_state_dict(weights, strict=False)
    saved.attention_warmup.step.fill_(7)
    with torch.no_grad():
        for n, p in saved.named_parameters():
            if ".attention_params." in n:
                p.add_(0.25)
    path = tmp_path / "pid.pth"
    torch.save(saved.state_dict(), path)
    other = pt.convert(stock(seed=3), "pid", {"learnable": True, "warmup_steps": 10})
    other.load_state_dict(torch.load(path, weights_only=True), strict=True)
    assert int(other.attention_warmup.step) == 7
    with torch.no_grad():
        assert torch.equal(other(x), saved(x))
    # and the other way: a converted model's checkpoint loads strictly into the model built by name
    back = named("pid", {"learnable": True, "warmup_steps": 10})
    back.load_state_dict(other.state_dict(), strict=True)
    assert int(back.attention_warmup.step) == 7
    with torch.no_grad():
        assert torch.equal(back(x), other(x))


def test_warmup_on_the_stock_roots_own_loops_and_finish_warmup_drops_the_counter():
    """Under warm-up timm's own loops on a converted root read the forward's warm-up scale once, as the model built
    by name does; finish_warmup drops the converted root's counter."""
    model = pt.convert(stock(), "twicing", {"from_layer": 0})
    x = images()
    with torch.no_grad():
        assert torch.equal(model.forward_intermediates(x)[0], model.forward_features(x))  # no state to thread
        pt.convert(model, "pid")
        y = model(x)
        pt.convert(model, "pid", {"warmup_steps": 4})
        model.attention_warmup.step.fill_(2)
        assert torch.equal(model.forward_intermediates(x)[0], model.forward_features(x))
        assert not torch.equal(model(x), y)
    pid_plugins.finish_warmup(model)  # the converted root's counter goes, with the container's reference
    assert not hasattr(model, "attention_warmup") and model.blocks.warmup_counter is None
    assert "attention_warmup.step" not in model.state_dict()
    with torch.no_grad():
        assert torch.equal(model(x), y)
    reference = named("pid", {"warmup_steps": 4})
    pid_plugins.finish_warmup(reference)
    assert reference.attention_warmup is None and reference.blocks.warmup_counter is None
