"""HuggingFace transformers adapter: ``attn_implementation="pid"`` (and every method registered with
:func:`pid_plugins.register_method`, under its name).

``import pid_plugins.hf`` registers ``"pid"`` with transformers' ``AttentionInterface`` (the attention
function: the base attention, SDPA by default, then the PID term on self-attention) and
``AttentionMaskInterface`` (the base attention's mask function). Then::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pid")   # preset `lm`
    model = pid_plugins.hf.to_pid(model, PIDConfig.preset("lm"))                     # or convert
    model.config.pid = {"lambda_p": 0.5}                                              # change gains
    model = pid_plugins.hf.to_pid(model, {"learnable": True})                        # learnable gains
    model = pid_plugins.hf.to_pid(model, base="eager")                               # attention weights
    model = pid_plugins.hf.to_pid(model, {"gamma": 0.3}, method="my_method")          # a registered method

Changes to transformers on import (all through its extension points except the last two): every registered method
is registered with ``AttentionInterface`` and ``AttentionMaskInterface`` under its name; a torch
module-registration hook gives each ``PreTrainedModel`` an inert forward pre-/post-hook and, once, wraps its
``post_init`` (discovery of a model built as PID before its first forward); ``PreTrainedModel._initialize_weights``
is wrapped once so that transformers' initialisation of missing weights gives learnable gains their initial values
and the warm-up counter t = 0 (transformers has no hook for modules it does not know).
"""
try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "pid_plugins.hf needs transformers: pip install -c constraints.txt 'pid-plugins[hf]'"
    ) from exc

from .attention import (
    ATTN_IMPLEMENTATION,
    BASES,
    PIDForwardState,
    install_pid_hooks,
    method_of,
    model_method_config,
    model_pid_config,
    pid_attention_forward,
    to_pid,
)
from .catalogue import get_config, list_models
from .gains import NoGainDecayTrainerMixin, decay_parameter_names, gain_parameter_names

__all__ = [
    "ATTN_IMPLEMENTATION", "BASES", "PIDForwardState", "pid_attention_forward", "install_pid_hooks", "model_pid_config",
    "model_method_config", "method_of",
    "to_pid", "get_config", "list_models", "NoGainDecayTrainerMixin", "decay_parameter_names", "gain_parameter_names",
]
