"""The command line of ``transformer_lm_pid`` (:class:`PIDTransformerLanguageModelConfig`) and its attention."""
# no `from __future__ import annotations`: omegaconf 2.0 reads the config dataclass field types at run time

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from fairseq.models.transformer_lm import TransformerLanguageModelConfig
from fairseq.utils import safe_getattr

from ..core import MethodChoice, resolve_attention

__all__ = ["PIDTransformerLanguageModelConfig", "attention_from_args", "method_name"]


@dataclass
class PIDTransformerLanguageModelConfig(TransformerLanguageModelConfig):
    """``transformer_lm``'s options plus ``--attention-method`` and ``--attention-cfg``."""

    attention_method: str = field(default="pid", metadata={
        "help": "the attention method: 'pid' (default), 'softmax' for the stock model, or the name of a method "
                "registered with pid_plugins.register_method (e.g. by your own --user-dir)"})
    attention_cfg: Optional[str] = field(default=None, metadata={
        "help": "the method's parameters as a JSON object over its fairseq preset (PID's: lm), e.g. "
                "'{\"lambda_p\": 0.4, \"beta\": 0.3}', '{\"control_first_layer\": false}', "
                "'{\"learnable\": true}' or '{\"warmup_steps\": 1000}' (gain warm-up for fine-tuning: the method's "
                "term scaled by min(1, t/N), t counting training forward passes, saved in the checkpoint); unset: the "
                "preset (or the --arch entry's)"})


def method_name(args: Any) -> str:
    """``--attention-method`` (unset: ``"pid"``, the package's default)."""
    return safe_getattr(args, "attention_method", "pid") or "pid"


def attention_from_args(args: Any) -> Optional[MethodChoice]:
    """The attention method and its parameters from fairseq's options (None: softmax)."""
    name = method_name(args)
    cfg_text = safe_getattr(args, "attention_cfg", None)
    params = parse_attention_cfg(cfg_text) if cfg_text not in (None, "") else None
    return resolve_attention(name, params, zoo="fairseq", where="transformer_lm_pid", params_name="--attention-cfg")


def parse_attention_cfg(text: Any) -> Any:
    """``--attention-cfg``: a JSON object of parameters (or a JSON string naming a preset)."""
    if isinstance(text, dict):  # already parsed (a config written by Python)
        return dict(text)
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--attention-cfg must be a JSON object, e.g. '{{\"gamma\": 0.3}}', got {text!r} "
                         f"({exc})") from exc
    if not isinstance(value, (dict, str)):
        raise ValueError(f"--attention-cfg must be a JSON object (or a JSON string naming a preset), got {text!r}")
    return value
