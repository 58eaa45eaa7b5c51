"""HuggingFace transformers adapter: ``attn_implementation="pid"`` (and every method registered with
:func:`pid_plugins.register_method`, under its name).

``import pid_plugins.hf`` registers every method with transformers' ``AttentionInterface`` (the attention
function: the base attention, SDPA by default, then the method on self-attention) and ``AttentionMaskInterface``
(the base attention's mask function). Then::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pid")                   # preset `lm`
    config = AutoConfig.from_pretrained(path); config.pid = {"lambda_p": 0.3}                   # its parameters
    model = AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation="pid")
    model = AutoModel.from_config(config, attn_implementation="pid")                             # not trained
    pid_plugins.hf.convert(model, "pid", {"learnable": True})     # a built model, in place (learnable gains)
    pid_plugins.hf.convert(model, "neutreno", base="eager")       # another method, on eager attention
    pid_plugins.hf.convert(model, "softmax")                      # back to the stock model, bit for bit
    pid_plugins.hf.convert(model, "pid", {"lambda_p": 0.5})       # other gains (saved as config.pid)
    pid_plugins.finish_warmup(model)                              # end a gain warm-up: the fixed-gain model

The adapter, one job per module: :mod:`~pid_plugins.hf.attention` (the attention and mask functions),
:mod:`~pid_plugins.hf.discovery` (finding a model's attention modules; the forward hooks that hand each forward its
method state), :mod:`~pid_plugins.hf.config` (what a model config says: the method, its parameters, the base
attention; how the choice is saved), :mod:`~pid_plugins.hf.warmup` (the gain warm-up counter),
:mod:`~pid_plugins.hf.cache` (the method and transformers' KV caches), :mod:`~pid_plugins.hf.gains` (learnable gains,
weight decay), :mod:`~pid_plugins.hf.record` (the method record in the weights), :mod:`~pid_plugins.hf.install`
(what the import changes in transformers), :mod:`~pid_plugins.hf.conversion` (switching a built model in place),
:mod:`~pid_plugins.hf.pipeline` (pipeline stages for ``torch.distributed.pipelining`` that carry the method's state
across stage boundaries).
"""
try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "pid_plugins.hf needs transformers: pip install -c constraints.txt 'pid-plugins[hf]'"
    ) from exc

from .attention import MethodForwardState, method_attention_forward, method_mask
from .catalogue import get_config, list_models
from .config import ATTN_IMPLEMENTATION, BASES, method_of, model_method_config
from .conversion import convert
from .gains import NoGainDecayTrainerMixin, decay_parameter_names, gain_parameter_names
from .pipeline import PipelineStageModule, pipeline_stage, stage_layer_range
from .install import install as _install

_install()

__all__ = [
    "ATTN_IMPLEMENTATION", "BASES", "MethodForwardState", "method_attention_forward", "method_mask",
    "model_method_config", "method_of", "convert", "get_config", "list_models", "NoGainDecayTrainerMixin",
    "decay_parameter_names", "gain_parameter_names", "pipeline_stage", "PipelineStageModule", "stage_layer_range",
]
