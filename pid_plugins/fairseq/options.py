"""The command line of ``transformer_lm_pid``: its options (:class:`PIDTransformerLanguageModelConfig`, fairseq's
``transformer_lm`` options plus ``--attention-method``, ``--attention-cfg`` and PID's ``--pid-*``) and the attention
they choose (:func:`attention_from_args`, through core's one policy)."""
# no `from __future__ import annotations`: omegaconf 2.0 reads the config dataclass field types at run time

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from fairseq.models.transformer_lm import TransformerLanguageModelConfig
from fairseq.utils import safe_getattr

from ..core import MethodChoice, resolve_attention

__all__ = ["PID_OPTIONS", "PIDTransformerLanguageModelConfig", "attention_from_args"]

#: PID's own options (``--pid-NAME``); unset they are None, so a method other than PID can refuse them
PID_OPTIONS = ("lambda_p", "lambda_i", "lambda_d", "beta", "control_first_layer", "warmup_steps")


@dataclass
class PIDTransformerLanguageModelConfig(TransformerLanguageModelConfig):
    """``transformer_lm``'s options plus the attention method's: ``--attention-method``, ``--attention-cfg`` and
    PID's ``--pid-*`` gains (each option's help says what it takes)."""

    attention_method: str = field(default="pid", metadata={
        "help": "the attention method: 'pid' (default), 'softmax' for the stock model, or the name of a method "
                "registered with pid_plugins.register_method (e.g. by your own --user-dir)"})
    attention_cfg: Optional[str] = field(default=None, metadata={
        "help": "the method's parameters as a JSON object, e.g. '{\"gamma\": 0.3}' (unset: its fairseq preset). "
                "PID's may also be given with the --pid-* options, not both"})
    pid_attention: str = field(default="pid", metadata={
        "help": "'pid', or 'softmax' for the stock model (the historical spelling of --attention-method)"})
    pid_lambda_p: Optional[float] = field(default=None, metadata={
        "help": "PID proportional gain (>= 0; unset: the lm preset's, 0.4)"})
    pid_lambda_i: Optional[float] = field(default=None, metadata={
        "help": "PID integral gain (>= 0; unset: the lm preset's, 0.5)"})
    pid_lambda_d: Optional[float] = field(default=None, metadata={
        "help": "PID derivative gain (>= 0; unset: the lm preset's, 0.1)"})
    pid_beta: Optional[float] = field(default=None, metadata={
        "help": "weight of the first layer's values, in (0, 1] (unset: the lm preset's, 0.3)"})
    # a value, not a flag: fairseq turns a bool field that defaults to True into a flag that sets it False
    pid_control_first_layer: Optional[str] = field(default=None, metadata={
        "help": "'true' (the default): the first layer gets the PID term too (eq. 25 with sums from layer 1); "
                "'false': it computes plain attention and only records v^1 (NeuTRENO's convention)"})
    pid_warmup_steps: Optional[int] = field(default=None, metadata={
        "help": "gain warm-up for fine-tuning into PID: the PID term is scaled by min(1, t/N), t counting training "
                "forward passes (saved in the checkpoint: --restore-file continues it); 0 (the default): off"})


def attention_from_args(args: Any) -> Optional[MethodChoice]:
    """The attention method and its parameters from fairseq's options (None: softmax, the stock model), through
    :func:`pid_plugins.core.resolve_attention`."""
    legacy = safe_getattr(args, "pid_attention", "pid") or "pid"
    if legacy not in ("pid", "softmax"):
        raise ValueError(f"--pid-attention must be 'pid' or 'softmax', got {legacy!r}")
    name = safe_getattr(args, "attention_method", "pid") or "pid"
    if legacy == "softmax" and name not in ("pid", "softmax"):
        raise ValueError(f"--pid-attention softmax conflicts with --attention-method {name}: give one of them "
                         "(--attention-method softmax for the stock model)")
    if legacy == "softmax":
        name = "softmax"
    cfg_text = safe_getattr(args, "attention_cfg", None)
    params = _parse_attention_cfg(cfg_text) if cfg_text not in (None, "") else None
    given = {key: safe_getattr(args, f"pid_{key}", None) for key in PID_OPTIONS}
    given = {key: value for key, value in given.items() if value is not None}
    pid: Optional[Dict[str, Any]] = None
    if name in ("pid", "softmax") and given and params is not None:  # never meant, flipped to softmax or not
        raise ValueError(f"PID's parameters are given twice, as --attention-cfg and as --pid-"
                         f"{sorted(given)[0].replace('_', '-')}: use one of them")
    if name == "pid" and given:
        pid = dict(given)
        if "control_first_layer" in pid:
            pid["control_first_layer"] = _as_bool(pid["control_first_layer"], "--pid-control-first-layer")
    elif name not in ("pid", "softmax") and given:
        options_given = ", ".join(f"--pid-{key.replace('_', '-')}" for key in sorted(given))
        raise ValueError(f"{options_given} set PID's parameters but --attention-method is {name}: drop them, or "
                         f"pass {name}'s parameters as --attention-cfg JSON")
    options = {f"--pid-{key.replace('_', '-')}": value for key, value in given.items()} if name == "softmax" else None
    return resolve_attention(name, params, zoo="fairseq", pid=pid, where="transformer_lm_pid", options=options)


def _parse_attention_cfg(text: Any) -> Any:
    """``--attention-cfg``: a JSON object of parameters (or a JSON string naming a preset)."""
    if isinstance(text, dict):  # already parsed (a config written by Python)
        return dict(text)
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--attention-cfg must be a JSON object, e.g. '{{\"gamma\": 0.3}}', got {text!r} ({exc})") from exc
    if not isinstance(value, (dict, str)):
        raise ValueError(f"--attention-cfg must be a JSON object (or a JSON string naming a preset), got {text!r}")
    return value


def _as_bool(value: Any, option: str) -> bool:
    """``true``/``false`` (any case; also 1/0, yes/no) or a bool, as fairseq stores the option."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{option} takes true or false, got {value!r}")
