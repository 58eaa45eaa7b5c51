"""``pid_plugins.timm.convert`` gives a whole model: a stock timm DeiT converted in place runs every path of timm's
model exactly (``torch.equal``) as the model built by its ``pid_*`` name with the same weights, for every method of
tests/method_cases.py: the forward with ``attn_mask`` / ``is_causal``, ``forward_intermediates`` (every form) and
``get_intermediate_layers``, timm's and torchvision's fx feature extraction, checkpointing in training, the warm-up
counter, ``deepcopy`` and pickling, and ``convert(model, "softmax")``; mmseg's bare stock backbone and head likewise."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import zoo_cases as zc
from method_cases import MODELS, cases

timm = zc.import_timm()
import pid_plugins.timm as pt  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

DEIT_CASE = MODELS["timm-deit"]
PID_NAME, STOCK_NAME, ARGS = zc.TIMM["deit"]
TOKENS = (ARGS["img_size"] // ARGS["patch_size"]) ** 2 + 1  # patches and the class token


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (tests/conftest.py)


@pytest.fixture(autouse=True)
def toy_registered():
    import toy_method  # noqa: F401  (registers scaled_reference, as a user does)


def converted_and_named(method: str, cfg, seed: int = 0, name: str = PID_NAME, base: str = STOCK_NAME):
    """(stock model converted in place, model built by name with its weights loaded strictly), eval mode."""
    torch.manual_seed(seed)
    model = timm.create_model(base, **ARGS).eval()
    assert pt.convert(model, method, cfg) is model and type(model) is not pt.PIDVisionTransformer
    named = timm.create_model(name, attention=method, attention_cfg=cfg, **ARGS).eval()
    named.load_state_dict(model.state_dict(), strict=True)
    assert list(model.state_dict()) == list(named.state_dict())
    return model, named


def key_mask(seed: int = 2) -> torch.Tensor:
    """A float mask that hides a few keys from every query (a padding mask, as NaFlex passes)."""
    mask = torch.zeros(TOKENS, TOKENS)
    mask[:, torch.randperm(TOKENS - 1, generator=torch.Generator().manual_seed(seed))[:4] + 1] = float("-inf")
    return mask


def same(got, want) -> None:
    """Equal tensors, or equal nests of them (lists, tuples, dicts)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for key in want:
            same(got[key], want[key])
    else:
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            same(g, w)


def both(model, named, call):
    """``call`` on both models: the same tensors, or the same refusal."""
    try:
        want = call(named)
    except Exception as exc:  # noqa: BLE001 - the converted model must refuse it the same way
        with pytest.raises(type(exc), match=None):
            call(model)
        return None
    got = call(model)
    if isinstance(want, tuple) and all(isinstance(w, list) and all(isinstance(n, str) for n in w) for w in want):
        assert got == want  # node names
    else:
        same(got, want)
    return got


@pytest.mark.parametrize("method,model_case,cfg", cases(models=lambda m: m.name == "timm-deit", with_cfg=True))
def test_every_eval_path_equals_the_model_built_by_name(method, model_case, cfg):
    model, named = converted_and_named(method.name, cfg)
    x = DEIT_CASE.inputs()
    mask = key_mask()
    calls = {
        "forward": lambda m: m(x),
        "attn_mask": lambda m: m(x, attn_mask=mask),
        "is_causal": lambda m: m(x, is_causal=True),
        "features_mask": lambda m: m.forward_features(x, attn_mask=mask),
        "intermediates": lambda m: m.forward_intermediates(x, indices=[0, 2]),
        "intermediates_norm_prefix": lambda m: m.forward_intermediates(
            x, indices=2, norm=True, return_prefix_tokens=True, output_fmt="NLC"),
        "intermediates_dict_mask": lambda m: m.forward_intermediates(
            x, output_dict=True, return_prefix_tokens=True, attn_mask=mask),
        "intermediates_causal_early": lambda m: m.forward_intermediates(
            x, indices=[1], stop_early=True, intermediates_only=True, is_causal=True),
        "get_intermediate_layers": lambda m: m.get_intermediate_layers(x, n=2, reshape=True, attn_mask=mask),
    }
    with torch.no_grad():
        outs = {what: both(model, named, call) for what, call in calls.items()}
        assert outs["forward"] is not None and outs["intermediates"] is not None
        # the masked path is not the plain one under another name
        assert not torch.equal(outs["attn_mask"], outs["forward"])


@pytest.mark.parametrize("method,model_case,cfg", cases(models=lambda m: m.name == "timm-deit", with_cfg=True))
def test_fx_feature_extraction_equals_the_model_built_by_name(method, model_case, cfg):
    """timm's extractor traces ``attn_mask`` / ``is_causal`` as inputs (timm's loop over the blocks in
    ``forward_features``); torchvision's takes them as constants."""
    from timm.models import create_feature_extractor, get_graph_node_names
    from torchvision.models.feature_extraction import create_feature_extractor as tv_extractor

    model, named = converted_and_named(method.name, cfg)
    x = DEIT_CASE.inputs()
    nodes = {"blocks.0.add_1": "first", "blocks.1.add_1": "block", "norm": "features", "head": "logits"}
    constants = {"attn_mask": None, "is_causal": False}
    with torch.no_grad():
        want = both(model, named, lambda m: tv_extractor(m, nodes, concrete_args=constants)(x))
        assert want is not None, method.name
        same(want["logits"], named(x))
        inter = named.forward_intermediates(x, indices=[0, 1], output_fmt="NLC", intermediates_only=True)
        same([want["first"][:, 1:], want["block"][:, 1:]], inter)
        assert both(model, named, get_graph_node_names) is not None
        same(create_feature_extractor(model, nodes)(x), want)
        same(create_feature_extractor(named, nodes)(x), want)


def test_learnable_gains_and_warmup_under_checkpointing_and_masks():
    """Training with checkpointing and masks: the converted model's outputs and gradients are the named model's (each
    method's checkpointing against none: the contract's kit case), the warm-up counter advances once per training
    forward on every path, and a checkpoint of either loads strictly into the other."""
    cfg = {"learnable": True, "warmup_steps": 5, "lambda_p": 0.5, "lambda_i": 0.3, "lambda_d": 0.2}
    model, named = converted_and_named("pid", cfg)
    model.train(), named.train()
    x = DEIT_CASE.inputs()
    mask = key_mask()
    for step, (kwargs, checkpointed) in enumerate([({}, True), ({"attn_mask": mask}, False), ({"is_causal": True},
                                                                                                True)]):
        for m in (model, named):
            m.set_grad_checkpointing(checkpointed)
            m.zero_grad(set_to_none=True)
        outs = [m(x, **kwargs) for m in (model, named)]
        same(outs[0], outs[1])
        for out in outs:
            out.square().mean().backward()
        grads = dict(named.named_parameters())
        for name, p in model.named_parameters():
            same(p.grad, grads[name].grad)
        assert int(model.attention_warmup.step) == int(named.attention_warmup.step) == step + 1
        inter = [m.forward_intermediates(x, indices=[1], intermediates_only=True, **kwargs) for m in (model, named)]
        same(inter[0], inter[1])
        assert int(model.attention_warmup.step) == step + 2
        model.attention_warmup.step.fill_(step + 1), named.attention_warmup.step.fill_(step + 1)
    back = timm.create_model(PID_NAME, attention="pid", attention_cfg=cfg, **ARGS)
    back.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(named.state_dict(), strict=True)


def test_deepcopy_and_pickle_keep_every_path_and_softmax_removes_it():
    model, named = converted_and_named("pid", {"lambda_p": 0.5, "lambda_i": 0.3, "lambda_d": 0.2})
    x = DEIT_CASE.inputs()
    mask = key_mask()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        want = named(x, attn_mask=mask)
        want_inter = named.forward_intermediates(x, indices=[0, 1])
        for other in (clone, loaded):
            assert type(other) is VisionTransformer
            assert other.forward_features.args[0] is other  # bound to the copy, not to the original
            same(other(x, attn_mask=mask), want)
            same(other.forward_intermediates(x, indices=[0, 1]), want_inter)
    torch.manual_seed(0)
    stock = timm.create_model(STOCK_NAME, **ARGS).eval()
    assert pt.convert(model, "softmax") is model
    assert "forward_features" not in vars(model) and "forward_intermediates" not in vars(model)
    assert sorted(vars(model)) == sorted(vars(stock))
    with torch.no_grad():
        same(model(x, attn_mask=mask), stock(x, attn_mask=mask))
        same(model.forward_intermediates(x, indices=[0, 1]), stock.forward_intermediates(x, indices=[0, 1]))
    pt.convert(model, "pid", {"lambda_p": 0.5, "lambda_i": 0.3, "lambda_d": 0.2})  # and back again
    with torch.no_grad():
        same(model(x, attn_mask=mask), want)


def test_distilled_deit_and_a_model_built_by_name_converted():
    """The distilled DeiT (two prefix tokens) converts whole too; a model built by name keeps its class's methods
    (no instance attributes added)."""
    model, named = converted_and_named("neutreno", None, name="pid_deit_tiny_distilled_patch16_224",
                                       base="deit_tiny_distilled_patch16_224")
    x = DEIT_CASE.inputs()
    mask = torch.zeros(TOKENS + 1, TOKENS + 1)
    mask[:, -3:] = float("-inf")
    with torch.no_grad():
        same(model(x, attn_mask=mask), named(x, attn_mask=mask))
        same(model.forward_intermediates(x, return_prefix_tokens=True, output_fmt="NLC"),
             named.forward_intermediates(x, return_prefix_tokens=True, output_fmt="NLC"))
    pt.convert(named, "pid")
    assert "forward_features" not in vars(named) and "forward_intermediates" not in vars(named)


STOCK_PART = {"backbone": ("VisionTransformer", "PIDVisionTransformer"),
              "head": ("SegmenterMaskTransformerHead", "PIDSegmenterMaskTransformerHead")}


def bare_and_typed(method: str, cfg, seed: int = 0, part: str = "backbone"):
    """(mmseg's stock part built alone and converted in place, the method class built from its type with the same
    weights loaded strictly), eval mode."""
    pm = pytest.importorskip("pid_plugins.mmseg")
    stock_type, method_type = STOCK_PART[part]
    args = zc.mm_args(part)
    model = zc.mm_build(stock_type, args, seed)
    assert pm.convert(model, method, cfg) is model and type(model).__name__ == stock_type
    typed = zc.mm_build(method_type, args, seed + 1, attention=method, attention_cfg=cfg)
    typed.load_state_dict(model.state_dict(), strict=True)
    assert list(model.state_dict()) == list(typed.state_dict())
    return model, typed


@pytest.mark.parametrize("method,model_case", cases(models=lambda m: m.name in ("mmseg-backbone", "mmseg-head")))
def test_a_bare_stock_mmseg_part_equals_the_typed_one(method, model_case):
    """A bare stock backbone or head: outputs, and under mmseg's layer checkpointing (``with_cp``) in training the
    outputs and gradients."""
    part = model_case.name.split("-")[1]
    cfg = method.on(model_case)[0]
    model, typed = bare_and_typed(method.name, cfg, part=part)
    x = model_case.inputs()
    with torch.no_grad():
        same(model(x), typed(x))
    for m in (model, typed):
        for layer in m.layers:
            layer.with_cp = True
    got, want = zc.mm_train_step(part, model), zc.mm_train_step(part, typed)
    same(got, want)


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_a_bare_stock_mmseg_part_with_warmup_copies_finishes_and_goes_back(part):
    pm = pytest.importorskip("pid_plugins.mmseg")
    import pid_plugins

    cfg = {"learnable": True, "warmup_steps": 4}
    model, typed = bare_and_typed("pid", cfg, part=part)
    x = zc.mm_inputs(part)
    for _ in range(2):  # training forwards advance both counters
        same(zc.mm_train_step(part, model), zc.mm_train_step(part, typed))
    assert int(model.attention_warmup.step) == int(typed.attention_warmup.step) == 2
    model.eval(), typed.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.no_grad():
        for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            same(other(x), typed(x))
    pid_plugins.finish_warmup(model), pid_plugins.finish_warmup(typed)
    assert model.attention_warmup is None and "attention_warmup.step" not in model.state_dict()
    with torch.no_grad():
        same(model(x), typed(x))
    stock = zc.mm_build(STOCK_PART[part][0], zc.mm_args(part), 0)
    assert pm.convert(model, "softmax") is model
    assert sorted(vars(model)) == sorted(vars(stock)) and list(model.state_dict()) == list(stock.state_dict())
    stock.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        same(model(x), stock(x))
