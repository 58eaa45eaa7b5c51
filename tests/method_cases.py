"""The case table of the method contract (tests/core/test_method_contract.py): which method runs on which zoo model,
with which parameters, and against which independent float64 rule."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Optional, Sequence, Tuple

import pytest

import zoo_cases as zc

from pid_plugins.testing.models import MODELS, Cfg, Model, fairseq_data  # noqa: F401  (the kit's models)

CAUSAL = frozenset(n for n, m in MODELS.items() if m.causal)


@dataclass(frozen=True)
class Method:
    """One attention method of the contract."""

    name: str
    config_type: Callable[[], type]
    on: Callable[[Model], Sequence[Cfg]]
    rule: Callable[[Cfg, Model], zc.Rule]
    defaults: Dict[str, str]
    zero: Cfg = None
    zero_models: FrozenSet[str] = frozenset()
    models: FrozenSet[str] = frozenset(MODELS)
    compile_models: FrozenSet[str] = frozenset()
    compile_overrides: Dict[str, Tuple[str, Tuple[float, float]]] = field(default_factory=dict)
    builtin: bool = True
    learned: Tuple[str, ...] = ()
    warmup: bool = False
    onnx_dynamo_models: FrozenSet[str] = frozenset()
    static_compile: bool = False
    causal_cfg: Cfg = None

    @property
    def learnable(self) -> bool:
        """The method has per-layer learnable parameters (``learnable=True``)."""
        return bool(self.learned)

    @property
    def impl(self):
        """The method object registered under this name (pid_plugins.core.get_method; the toy is registered on import
        of tests/toy_method.py, as a user registers it)."""
        if not self.builtin:
            import toy_method  # noqa: F401

        from pid_plugins.core import get_method

        return get_method(self.name)

    @property
    def cross_layer_state(self) -> bool:
        """Each layer hands the next a state (the method object's ``state_fields``): what a pipeline stage carries
        across its boundary and the state rule refuses to start afresh mid-stack."""
        return bool(self.impl.state_fields)

    def config(self, cfg: Cfg, zoo: str):
        """The config the models must carry for ``cfg`` (the zoo's preset with ``cfg``'s overrides)."""
        return self.config_type().preset(self.defaults[zoo], **(cfg or {}))


def _pid_config():
    from pid_plugins import PIDConfig

    return PIDConfig


def _neutreno_config():
    from pid_plugins.core.siblings.neutreno import NeuTRENOConfig

    return NeuTRENOConfig


def _twicing_config():
    from pid_plugins.core.siblings.twicing import TwicingConfig

    return TwicingConfig


def _elliptical_config():
    from pid_plugins.core.siblings.elliptical import EllipticalConfig

    return EllipticalConfig


def _value_residual_config():
    from pid_plugins.core.siblings.value_residual import ValueResidualConfig

    return ValueResidualConfig


def _toy_config():
    from toy_method import ScaledReferenceConfig

    return ScaledReferenceConfig


PID_ON = {"lambda_p": 0.5, "lambda_i": 0.3, "lambda_d": 0.2, "beta": 0.6}  # every gain apart from the presets'
VR_MIXED = {"lambda_1": 0.3, "lambda_2": 0.9}  # not the paper's 0.5 / 0.5: a weight per term that a swap would show


def _vr_rule(cfg: Cfg, model: Model) -> zc.Rule:
    cfg = {"lambda_1": 0.5, "lambda_2": 0.5, **(cfg or {})}  # None: the resformer preset
    return zc.value_residual_rule([(cfg["lambda_1"], cfg["lambda_2"])] * 16)


ELLIPTICAL_PREFIX = {"mean": "prefix"}  # Elliptical's causal form (its sequence mean is refused in causal models)


def _elliptical_on(model: Model) -> Sequence[Cfg]:
    if model.name == "fairseq-lm":
        return [None]  # fairseq's preset for language models: the prefix mean, delta 1
    if model.causal:
        return [dict(ELLIPTICAL_PREFIX)]
    return [{"from_layer": 3}, {"from_layer": 2}]


def _elliptical_rule(cfg: Cfg, model: Model) -> zc.Rule:
    if model.causal:
        return zc.elliptical_prefix_rule(1.0 if model.zoo == "fairseq" else 5.0)
    return zc.elliptical_rule(cfg["from_layer"])


def _toy_rule(cfg: Cfg, model: Model) -> zc.Rule:
    from toy_method import toy_rule

    return toy_rule(cfg["gamma"])


VISION = ("timm", "mmseg")
METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("pid", _pid_config, on=lambda model: [PID_ON, {**PID_ON, "control_first_layer": False}],
           rule=lambda cfg, model: zc.pid_rule(cfg["lambda_p"], cfg["lambda_i"], cfg["lambda_d"], cfg["beta"],
                                               cfg.get("control_first_layer", True)),
        defaults={"timm": "deit", "mmseg": "segmenter", "hf": "lm", "fairseq": "lm"},
        zero={"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}, zero_models=frozenset(MODELS),
        compile_models=frozenset({"fairseq-lm"}),  # timm, transformers, mmseg: tests/core/test_compile.py
        learned=("lambda_p_raw", "lambda_i_raw", "lambda_d_raw"), warmup=True,
        onnx_dynamo_models=frozenset({"timm-deit", "timm-fan", "hf-llama", "hf-bert"})),
    Method("neutreno", _neutreno_config,
           on=lambda model: [{"alpha": 0.6 if model.zoo in VISION else 0.4}],
           rule=lambda cfg, model: zc.neutreno_rule(cfg["alpha"]),
           defaults={"timm": "deit", "mmseg": "segmenter", "hf": "lm", "fairseq": "lm"},
           zero={"alpha": 0.0}, zero_models=frozenset(MODELS),
           compile_models=frozenset({"timm-deit", "timm-fan", "hf-llama", "mmseg-backbone", "fairseq-lm"}),
           warmup=True),
    # no strength parameter: from_layer past the last layer computes A v in every layer (stock bit for bit where
    # the adapter's own attention is the one called: timm, transformers)
    Method("twicing", _twicing_config, on=lambda model: [{"from_layer": 1}, {"from_layer": 0}],
           rule=lambda cfg, model: zc.twiced_from(cfg["from_layer"]),
           defaults=dict.fromkeys(("timm", "mmseg", "hf", "fairseq"), "vision"),
           zero={"from_layer": 99}, zero_models=frozenset({"timm-deit", "timm-fan", "hf-llama", "hf-bert"}),
           compile_models=frozenset({"timm-deit", "hf-llama", "mmseg-backbone", "fairseq-lm"}),
           onnx_dynamo_models=frozenset({"timm-deit", "hf-llama"}), static_compile=True),
    # bidirectional by default (the sequence mean); causal models run the prefix mean (mean="prefix")
    Method("elliptical", _elliptical_config, on=_elliptical_on, rule=_elliptical_rule,
           defaults={"timm": "deit", "mmseg": "segmenter", "hf": "deit", "fairseq": "lm"},
           zero={"from_layer": 99}, zero_models=frozenset({"timm-deit", "timm-fan", "hf-bert"}),
           compile_models=frozenset({"timm-deit", "timm-fan", "hf-bert", "mmseg-backbone"}),
           compile_overrides={"mmseg-backbone": ("aot_eager", (1e-5, 1e-6))}, static_compile=True,
           causal_cfg=ELLIPTICAL_PREFIX),
    Method("value_residual", _value_residual_config, on=lambda model: [VR_MIXED, None], rule=_vr_rule,
           defaults=dict.fromkeys(("timm", "mmseg", "hf", "fairseq"), "resformer"),
           zero={"lambda_1": 0.0, "lambda_2": 1.0}, zero_models=frozenset(MODELS),
           compile_models=frozenset({"timm-deit", "hf-llama"}), learned=("lambda_1", "lambda_2"),
           onnx_dynamo_models=frozenset({"hf-llama"}), static_compile=True),
    Method("scaled_reference", _toy_config, on=lambda model: [{"gamma": 0.7}], rule=_toy_rule,
           defaults=dict.fromkeys(("timm", "mmseg", "hf", "fairseq"), "default"),
           zero={"gamma": 0.0}, zero_models=frozenset(MODELS),
           compile_models=frozenset({"timm-deit", "timm-fan", "hf-llama", "mmseg-backbone", "fairseq-lm"}),
           builtin=False),
)}
#: the methods pid_plugins ships (the table without the toy): what the per-zoo feature tests run
BUILTIN: Dict[str, Method] = {n: m for n, m in METHODS.items() if m.builtin}
#: every built-in method that runs in a causal model, with the parameters a causal model with a KV cache runs it with
#: (``causal_cfg``; None: the zoo's preset), and stock SDPA as the control: what transformers' decoding tests run
#: (zoo_cases.gqa_llama)
CAUSAL_METHODS: Dict[str, Cfg] = {"sdpa": None, **{n: m.causal_cfg for n, m in BUILTIN.items() if m.models & CAUSAL}}


def method_cfg(method: Method, model: Model) -> Cfg:
    """The "on" parameters of the properties other than the reference (the first of ``method.on``)."""
    return method.on(model)[0]


def cases(models: Optional[Callable[[Model], bool]] = None, methods: Optional[Callable[[Method], bool]] = None,
          pair: Optional[Callable[[Method, Model], bool]] = None, with_cfg: bool = False) -> list:
    """pytest params (method, model[, cfg]) of every pair that applies, ids ``method-model[-i]``."""
    out = []
    for method in METHODS.values():
        if methods is not None and not methods(method):
            continue
        for model in MODELS.values():
            if model.name not in method.models or (models is not None and not models(model)):
                continue
            if pair is not None and not pair(method, model):
                continue
            if with_cfg:
                for i, cfg in enumerate(method.on(model)):
                    out.append(pytest.param(method, model, cfg, id=f"{method.name}-{model.name}-{i}"))
            else:
                out.append(pytest.param(method, model, id=f"{method.name}-{model.name}"))
    return out


def variants(model: Optional[str] = None, methods: Optional[Callable[[Method], bool]] = None, learnable: bool = True,
             warmup_steps: int = 0) -> Dict[str, Tuple[str, Cfg]]:
    """The built-in methods as a per-zoo feature test runs them, ``{id: (method name, parameters)}``: every method of
    :data:`BUILTIN` (``methods``: those it accepts) as ``<name>`` with its "on" parameters on ``model`` (a key of
    :data:`MODELS`; None: the zoo's preset, parameters None); with ``learnable``, each one with learnable parameters
    also as ``learnable_<name>`` (those parameters plus ``learnable=True``); with ``warmup_steps``, each one with
    warm-up also as ``<name>_warmup`` (plus ``warmup_steps``)."""
    chosen = [m for m in BUILTIN.values() if methods is None or methods(m)]
    base = {m.name: None if model is None else method_cfg(m, MODELS[model]) for m in chosen}
    out: Dict[str, Tuple[str, Cfg]] = {m.name: (m.name, base[m.name]) for m in chosen}
    if learnable:
        out.update({f"learnable_{m.name}": (m.name, {**(base[m.name] or {}), "learnable": True})
                    for m in chosen if m.learnable})
    if warmup_steps:
        out.update({f"{m.name}_warmup": (m.name, {**(base[m.name] or {}), "warmup_steps": warmup_steps})
                    for m in chosen if m.warmup})
    return out
