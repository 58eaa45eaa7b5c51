"""Value residual learning (ResFormer, ``attention="value_residual"``; github.com/Zcchill/Value-Residual-Learning):
later layers attend over ``lambda_1 v^1 + lambda_2 v^l`` (zoo_cases' :func:`value_residual_rule`)."""
import pytest
import torch

import pid_plugins
from pid_plugins.core.siblings.value_residual import ValueResidualConfig, ValueResidualLambdas
from zoo_cases import (TIMM, assert_timm_feature_paths, import_timm, timm_images, timm_load_pretrained,
                       timm_reference)
from zoo_cases import timm_pair as zoo_timm_pair
from zoo_cases import value_residual_rule

NAME = "value_residual"
METHOD = pid_plugins.get_method(NAME)
MIXED = {"lambda_1": 0.3, "lambda_2": 0.9}  # not the paper's 0.5 / 0.5: a weight per term that a swap would show


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (tests/conftest.py)


vr_rule = value_residual_rule  # the zoo references' rule, one (lambda_1, lambda_2) per layer


def timm_pair(kind, cfg=None, seed=0):
    """(value residual model, stock model) with the same weights (strict: fixed lambdas add no parameters)."""
    return zoo_timm_pair(kind, seed, attention=NAME, attention_cfg=cfg)


def timm_learnable(kind, seed=0):
    """A learnable value residual model with the stock model's weights (its lambdas are model-only) and the stock
    model, eval mode."""
    timm = import_timm()
    name, base, args = TIMM[kind]
    torch.manual_seed(seed)
    stock = timm.create_model(base, **args).eval()
    model = timm.create_model(name, attention=NAME, attention_cfg={"learnable": True}, **args).eval()
    result = model.load_state_dict(stock.state_dict(), strict=False)
    assert not result.unexpected_keys and all(".attention_params." in k for k in result.missing_keys)
    return model, stock


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_learnable_lambdas_per_block_reference_gradients_and_weight_decay(kind):
    from timm.optim import create_optimizer_v2

    model, stock = timm_learnable(kind)
    gains = [blk.attn.attention_params for blk in model.blocks]
    assert all(isinstance(g, ValueResidualLambdas) for g in gains) and len({id(g) for g in gains}) == len(gains)
    names = {n for n, _ in model.named_parameters() if ".attention_params." in n}
    assert names == {f"blocks.{i}.attn.attention_params.lambda_{j}" for i in range(len(gains)) for j in (1, 2)}
    assert all(g.lambda_1.item() == 0.5 and g.lambda_2.item() == 0.5 for g in gains)  # the preset's values
    # each block reads its own lambdas: set them apart and compare with the per-layer reference
    lambdas = [(0.5, 0.5), (0.25, 1.125), (-0.375, 0.75)]  # exact in float32
    with torch.no_grad():
        for g, (l1, l2) in zip(gains, lambdas):
            g.lambda_1.fill_(l1), g.lambda_2.fill_(l2)
    model64, stock64 = model.double(), stock.double()
    x = timm_images(kind).double()
    with torch.no_grad():
        torch.testing.assert_close(model64(x), timm_reference(kind, stock64, x, vr_rule(lambdas)),
                                   rtol=1e-10, atol=1e-10)
    model.float()
    # gradients: every later block's lambdas get one; the first block's take part with weight 0
    model.train()
    model(timm_images(kind)).square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".attention_params." in n)
    assert torch.equal(gains[0].lambda_1.grad, torch.zeros(1)) and torch.equal(gains[0].lambda_2.grad, torch.zeros(1))
    assert all(g.lambda_1.grad.abs().item() > 0 and g.lambda_2.grad.abs().item() > 0 for g in gains[1:])
    # the lambdas are not weight-decayed (as PID's learnable gains): timm's optimizer factory reads no_weight_decay()
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for group in opt.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    params = dict(model.named_parameters())
    assert not any(id(params[n]) in decayed for n in names)
    assert any(n.endswith("mlp.fc1.weight") and id(p) in decayed for n, p in params.items())
    if kind == "deit":  # DeiT lists the names, FAN a pattern ("*.attention_params.*")
        assert names <= model.no_weight_decay()


def test_timm_trained_lambdas_through_the_pretrained_path(tmp_path):
    """Learnable lambdas come back as trained (fixed ones: the contract's save_load); a softmax checkpoint (no
    lambdas in it) into learnable lambdas starts them at the config's values."""
    name, _, args = TIMM["deit"]
    x = timm_images("deit")
    learned, _ = timm_learnable("deit", seed=4)
    with torch.no_grad():
        learned.blocks[1].attn.attention_params.lambda_1.fill_(0.25)
        learned.blocks[2].attn.attention_params.lambda_2.fill_(1.5)
    torch.save(learned.state_dict(), tmp_path / "learned.pth")
    again = timm_load_pretrained(name, tmp_path / "learned.pth", attention=NAME, attention_cfg={"learnable": True},
                                 **args)
    assert again.blocks[1].attn.attention_params.lambda_1.item() == 0.25
    assert again.blocks[2].attn.attention_params.lambda_2.item() == 1.5
    again.load_state_dict(learned.state_dict(), strict=True)  # the plain state_dict round trip too
    _, stock = timm_pair("deit", seed=5)
    torch.save(stock.state_dict(), tmp_path / "softmax.pth")
    fresh = timm_load_pretrained(name, tmp_path / "softmax.pth", attention=NAME,
                                 attention_cfg={"learnable": True, **MIXED}, **args)
    assert all(blk.attn.attention_params.lambda_1.item() == pytest.approx(0.3) for blk in fresh.blocks)
    fixed, _ = timm_pair("deit", MIXED, seed=5)
    with torch.no_grad():
        assert torch.equal(again(x), learned(x))
        torch.testing.assert_close(fresh(x), fixed(x), rtol=1e-6, atol=1e-6)  # the same rule, trainable


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_features_only_intermediates_and_fx_feature_extraction(kind):
    """The method's ``attend`` reaches torch.fx (timm's feature extraction traces it; the mix is one leaf)."""
    model, _ = timm_pair(kind, MIXED)
    assert_timm_feature_paths(kind, model, attention=NAME, attention_cfg=MIXED)


# learnable lambdas in mmseg (backbone and head; references, training, checkpoints, FSDP2/DDP): test_mmseg_learnable.py


def test_config_presets_and_off_switch():
    assert METHOD.configure(None) == ValueResidualConfig(0.5, 0.5)
    assert METHOD.configure("resformer") == ValueResidualConfig(0.5, 0.5)
    assert METHOD.is_identity(ValueResidualConfig(0.0, 1.0))
    assert not METHOD.is_identity(ValueResidualConfig(0.0, 1.0, learnable=True))
    assert isinstance(METHOD.make_learned(ValueResidualConfig(learnable=True)), ValueResidualLambdas)
    with pytest.raises(ValueError, match="lambda_1 must be a finite number"):
        METHOD.configure({"lambda_1": float("nan")})
