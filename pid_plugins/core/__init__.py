"""The PID-attention core: gains, the update rule, and a reference attention module."""
from .attention import PIDSelfAttention, sdpa_with_pid
from .config import PIDConfig
from .control import PIDState, expand_heads, pid_update
from .gains import PIDGains, layer_gains
from .warmup import GainWarmup, make_warmup, pid_term, scaled_gains, warmup_scale

__all__ = [
    "PIDConfig", "PIDState", "pid_update", "expand_heads", "PIDGains", "layer_gains",
    "PIDSelfAttention", "sdpa_with_pid", "GainWarmup", "make_warmup", "scaled_gains", "warmup_scale", "pid_term",
]
