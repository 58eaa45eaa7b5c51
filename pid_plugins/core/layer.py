"""What a layer and a model hold for their attention method, once for every adapter: :class:`MethodLayer` (the
layer's method, config and learnable parameters) and :class:`MethodModel` (the model's method, config and gain
warm-up counter)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from torch import Tensor, nn

from .methods import AttentionMethod, LayerCall, MethodChoice, method_warmup
from .warmup import GainWarmup

__all__ = ["MethodLayer", "MethodModel"]


class MethodLayer:
    """Mixed into an adapter's attention layer (an ``nn.Module``): the layer's method and parameters.

    ``attention_method`` (the :class:`~pid_plugins.core.AttentionMethod`, None for softmax), ``pid`` (its config,
    the attribute PID layers always had) and ``pid_gains`` (the method's learnable per-layer parameters, from
    ``method.make_learned``, or None: the attribute name keeps saved PID checkpoints loading unchanged).
    """

    attention_method: Optional[AttentionMethod]
    pid: Any
    pid_gains: Optional[nn.Module]

    def set_attention(self, choice: Optional[MethodChoice], like: Optional[Tensor] = None) -> None:
        """Switch the layer to ``choice`` (None: softmax); learnable parameters are (re)initialised on ``like``'s
        device and dtype."""
        self.attention_method = choice.method if choice is not None else None
        self.pid = choice.config if choice is not None else None
        learned = choice.method.make_learned(choice.config) if choice is not None else None
        if learned is not None and like is not None:
            learned = learned.to(device=like.device, dtype=like.dtype)
        self.pid_gains = learned

    @property
    def method_active(self) -> bool:
        """Whether the layer runs its method (False: softmax, or a config that computes the stock attention: the
        adapter runs its zoo's own code path, bit for bit)."""
        method = self.attention_method
        return method is not None and not method.is_identity(self.pid)

    @property
    def state_size(self) -> int:
        """How many flat tensors this layer hands to the next (0: the stock attention, nothing threaded)."""
        return len(self.attention_method.state_fields) if self.method_active else 0

    def apply_method(self, call: LayerCall, state: Optional[tuple]) -> Tuple[Tensor, tuple]:
        """The layer's one :meth:`~pid_plugins.core.AttentionMethod.apply` with its own config and parameters."""
        return self.attention_method.apply(self.pid, self.pid_gains, call, state)


class MethodModel:
    """Mixed into an adapter's model (or the module that owns a group of method layers): the method, its config and
    the gain warm-up counter, set in one place.

    ``attention_method`` (None for softmax), ``pid`` (the config, the attribute PID models always had) and
    ``pid_warmup`` (the :class:`~pid_plugins.core.GainWarmup` counter when the config has ``warmup_steps``, else
    None; a submodule, so its step is saved with the model).
    """

    attention_method: Optional[AttentionMethod]
    pid: Any
    pid_warmup: Optional[GainWarmup]

    def set_model_method(self, choice: Optional[MethodChoice], like: Optional[Tensor] = None, *,
                         stock_plus_term: bool = False, where: str = "this model") -> None:
        """Hold ``choice`` (None: softmax) and make (or keep, or drop) the warm-up counter on ``like``'s device;
        ``stock_plus_term``: see :func:`~pid_plugins.core.method_warmup`."""
        self.attention_method = choice.method if choice is not None else None
        self.pid = choice.config if choice is not None else None
        self.pid_warmup = method_warmup(choice, like, self.__dict__.get("_modules", {}).get("pid_warmup"),
                                        stock_plus_term=stock_plus_term, where=where)

    @property
    def method_active(self) -> bool:
        """Whether the model runs its method (False: softmax, or a config that computes the stock attention)."""
        method = self.attention_method
        return method is not None and not method.is_identity(self.pid)
