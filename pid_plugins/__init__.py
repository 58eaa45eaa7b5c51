"""pid-plugins: PID-controlled attention (PIDformer, ICML 2024) for timm, transformers, mmseg and fairseq.
``import pid_plugins`` needs only torch; each zoo adapter (``pid_plugins.hf``, ...) imports its zoo lazily."""
from .catalogue import ModelEntry, get_model_entry, list_models
from .core import (
    AttentionMethod,
    GainWarmup,
    MethodConfig,
    PIDConfig,
    PIDGains,
    PIDSelfAttention,
    PIDState,
    expand_heads,
    finish_warmup,
    get_method,
    list_methods,
    pid_update,
    register_method,
    sdpa_with_pid,
)

from .core import siblings  # noqa: E402,F401  (registers NeuTRENO, Twicing, Elliptical and value residual)
from .versions import check_version  # noqa: E402

__version__ = "0.1.0"
check_version("torch")

__all__ = [
    "PIDConfig", "PIDState", "PIDGains", "GainWarmup", "pid_update", "expand_heads", "PIDSelfAttention",
    "sdpa_with_pid",
    "AttentionMethod", "MethodConfig", "register_method", "get_method", "list_methods", "finish_warmup",
    "ModelEntry", "list_models", "get_model_entry", "__version__",
]
