import math

import pytest

from pid_plugins import PIDConfig


def test_presets_match_the_paper():
    assert PIDConfig.preset("deit").gains == (0.8, 0.5, 0.05, 0.1)
    assert PIDConfig.preset("segmenter").gains == (0.5, 0.3, 0.05, 1.0)
    assert PIDConfig.preset("lm").gains == (0.4, 0.5, 0.1, 0.3)
    assert PIDConfig.preset("neutreno").gains == (0.6, 0.0, 0.0, 1.0)  # NeuTRENO (NeurIPS 2023), vision
    assert PIDConfig.preset_names() == ["deit", "lm", "neutreno", "segmenter"]
    assert all(PIDConfig.preset(name).control_first_layer for name in PIDConfig.preset_names())
    assert PIDConfig() == PIDConfig.preset("deit")


def test_preset_with_overrides():
    cfg = PIDConfig.preset("lm", lambda_p=0.2, learnable=True)
    assert cfg.gains == (0.2, 0.5, 0.1, 0.3) and cfg.learnable


@pytest.mark.parametrize("cfg", [PIDConfig(), PIDConfig(0.0, 0.0, 0.0, 1.0), PIDConfig(0.2, 0.9, 0.6, 0.3, True),
                                 PIDConfig(control_first_layer=False), PIDConfig(warmup_steps=7)])
def test_dict_round_trip(cfg):
    d = cfg.to_dict()
    assert d == {"lambda_p": cfg.lambda_p, "lambda_i": cfg.lambda_i, "lambda_d": cfg.lambda_d,
                 "beta": cfg.beta, "learnable": cfg.learnable, "control_first_layer": cfg.control_first_layer,
                 "warmup_steps": cfg.warmup_steps}
    assert PIDConfig.from_dict(d) == cfg
    assert hash(PIDConfig.from_dict(d)) == hash(cfg)


def test_from_dict_with_preset_key_and_coerce():
    assert PIDConfig.from_dict({"preset": "segmenter", "beta": 0.5}).gains == (0.5, 0.3, 0.05, 0.5)
    assert PIDConfig.coerce(None, default="lm") == PIDConfig.preset("lm")
    assert PIDConfig.coerce("segmenter") == PIDConfig.preset("segmenter")
    assert PIDConfig.coerce({"lambda_p": 0.5, "beta": 0.3}).gains == (0.5, 0.5, 0.05, 0.3)
    assert PIDConfig.coerce({"lambda_p": 0.5}, default="lm").gains == (0.5, 0.5, 0.1, 0.3)
    base = PIDConfig(0.1, 0.2, 0.3, 0.4)
    assert PIDConfig.coerce(None, default=base) is base
    assert PIDConfig.coerce({"beta": 1.0}, default=base).gains == (0.1, 0.2, 0.3, 1.0)
    assert PIDConfig.coerce({"preset": "lm", "beta": 1.0}, default=base).gains == (0.4, 0.5, 0.1, 1.0)
    with pytest.raises(ValueError, match="PIDConfig, a dict, a preset name or None"):
        PIDConfig.coerce(0.5)


def test_ints_become_floats():
    cfg = PIDConfig(1, 0, 0, 1)
    assert cfg.gains == (1.0, 0.0, 0.0, 1.0) and all(type(g) is float for g in cfg.gains)


def test_is_zero():
    assert PIDConfig(0, 0, 0, 0.3).is_zero
    assert not PIDConfig(0, 0, 0, 0.3, learnable=True).is_zero
    assert not PIDConfig(0, 0, 1e-9, 0.3).is_zero


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(lambda_p=-0.1), "lambda_p", ">= 0"),
        (dict(lambda_i=-1), "lambda_i", ">= 0"),
        (dict(lambda_d=-0.5), "lambda_d", ">= 0"),
        (dict(lambda_p=math.nan), "lambda_p", "finite"),
        (dict(lambda_i=math.inf), "lambda_i", "finite"),
        (dict(beta=0.0), "beta", "(0, 1]"),
        (dict(beta=1.5), "beta", "(0, 1]"),
        (dict(beta=-0.2), "beta", "(0, 1]"),
        (dict(beta=math.nan), "beta", "finite"),
        (dict(lambda_p="0.5"), "lambda_p", "real number"),
        (dict(lambda_p=True), "lambda_p", "real number"),
        (dict(learnable="yes"), "learnable", "True or False"),
        (dict(control_first_layer=0), "control_first_layer", "True or False"),
    ],
)
def test_invalid_values_name_the_field_and_the_rule(kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        PIDConfig(**kwargs)
    assert f"PIDConfig.{field}" in str(info.value)
    assert allowed in str(info.value)


def test_unknown_preset_and_fields():
    with pytest.raises(ValueError, match=r"unknown PID preset 'vit'.*\['deit', 'lm', 'neutreno', 'segmenter'\]"):
        PIDConfig.preset("vit")
    with pytest.raises(ValueError, match=r"unknown PIDConfig field\(s\) \['lambda_x'\]"):
        PIDConfig.from_dict({"lambda_x": 1.0})
    with pytest.raises(ValueError, match="dict or PIDConfig"):
        PIDConfig.from_dict([0.1, 0.2])
    with pytest.raises(ValueError, match="PIDConfig.beta"):
        PIDConfig.preset("deit", beta=2.0)


def test_replace_validates():
    assert PIDConfig().replace(lambda_p=0.2).lambda_p == 0.2
    with pytest.raises(ValueError, match="PIDConfig.lambda_d"):
        PIDConfig().replace(lambda_d=-1.0)
