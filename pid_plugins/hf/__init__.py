"""HuggingFace transformers adapter: ``attn_implementation="pid"`` (and every registered method, under its name)::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pid")   # preset `lm`
    pid_plugins.hf.convert(model, "pid", {"learnable": True})     # a built model, in place (learnable gains)
    pid_plugins.hf.convert(model, "softmax")                      # back to the stock model, bit for bit

The adapter's modules are listed in docs/transformers.md.
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
