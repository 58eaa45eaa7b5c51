"""The PID-attention core: gains, the update rule, and a reference attention module."""
from .checkpoint import UnsafeCheckpointError, check_keys, load_weights_only, unwrap_state_dict
from .heads import expand_heads
from .methods import (
    FX_LEAVES, SOFTMAX, AttentionContext, AttentionMethod, CacheSlot, LayerCall, MethodChoice, MethodConfig,
    MissingLayerState, StockPath, get_method, list_methods, method_warmup, on_register, register_method,
    reserve_names, resolve_attention,
)
from .layer import MethodLayer, MethodModel, finish_warmup, finished_config, register_warmup_finisher
from .warmup import GainWarmup, make_warmup
from .pid import PIDConfig, PIDGains, PIDMethod, PIDState, layer_gains, pid_update, scaled_gains  # registers "pid"
from .attention import PIDSelfAttention, sdpa_with_pid  # noqa: E402  (the reference layer, on PID's module)

__all__ = [
    "PIDConfig", "PIDState", "pid_update", "expand_heads", "PIDGains", "layer_gains", "PIDSelfAttention",
    "sdpa_with_pid", "GainWarmup", "make_warmup", "scaled_gains", "AttentionMethod", "AttentionContext",
    "CacheSlot", "LayerCall", "StockPath", "MissingLayerState", "MethodConfig", "MethodChoice", "PIDMethod",
    "register_method", "get_method", "list_methods", "on_register", "reserve_names", "resolve_attention",
    "method_warmup", "SOFTMAX", "unwrap_state_dict", "check_keys", "UnsafeCheckpointError", "load_weights_only",
    "FX_LEAVES", "MethodLayer", "MethodModel", "finish_warmup", "finished_config", "register_warmup_finisher",
]
