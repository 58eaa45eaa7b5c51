"""Learnable per-layer gains (opt-in via ``PIDConfig(learnable=True)``), non-negative by construction."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import PIDConfig

__all__ = ["PIDGains", "layer_gains"]

_GAINS = ("lambda_p", "lambda_i", "lambda_d")
#: a learnable gain initialised at 0 starts here instead (softplus never reaches 0 exactly)
MIN_INITIAL_GAIN = 1e-4


def _inverse_softplus(gain: float) -> float:
    """``raw`` with ``softplus(raw) == gain`` (gain > 0)."""
    return gain + math.log(-math.expm1(-gain))


class PIDGains(nn.Module):
    """Trainable ``lambda_p, lambda_i, lambda_d`` of one layer, initialised from a :class:`PIDConfig`.

    Each gain is ``softplus(raw)`` of an unconstrained parameter (``lambda_p_raw`` ...), so it stays
    positive whatever the optimiser does: the stability of PID attention (PIDformer, Proposition 2)
    needs positive gains. A gain initialised at 0 starts at :data:`MIN_INITIAL_GAIN`. ``beta`` and
    ``control_first_layer`` stay fixed. Exclude these parameters from weight decay (weight decay would
    pull the raw value towards 0, i.e. the gain towards log 2), as timm's ``no_weight_decay`` does.

    Each raw parameter has shape ``(1,)``, not ``()``: FSDP2's ``fully_shard`` shards parameters along their
    first dimension and refuses 0-dim ones. State dicts written before the reparametrisation (parameters
    named ``lambda_p`` holding the gain itself) or with 0-dim raw values load: they are converted.
    """

    def __init__(self, config: PIDConfig) -> None:
        super().__init__()
        self.beta = config.beta
        self.control_first_layer = config.control_first_layer
        for name in _GAINS:
            raw = _inverse_softplus(max(getattr(config, name), MIN_INITIAL_GAIN))
            setattr(self, f"{name}_raw", nn.Parameter(torch.tensor([raw])))

    def forward(self) -> tuple[Tensor, Tensor, Tensor, float, bool]:
        """``(lambda_p, lambda_i, lambda_d, beta, control_first_layer)`` as :func:`pid_update` takes them."""
        lp, li, ld = (F.softplus(getattr(self, f"{name}_raw")) for name in _GAINS)
        return (lp, li, ld, self.beta, self.control_first_layer)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in _GAINS:
            old = state_dict.get(prefix + name)
            if old is not None and prefix + f"{name}_raw" not in state_dict:
                gain = float(old)
                if not gain > 0:
                    raise ValueError(
                        f"{prefix}{name} = {gain} in this checkpoint: learned PID gains must be positive "
                        "(this checkpoint predates the positive parametrisation; a gain <= 0 has no equivalent in it)"
                    )
                state_dict[prefix + f"{name}_raw"] = torch.tensor([_inverse_softplus(gain)], dtype=old.dtype)
                del state_dict[prefix + name]
            raw = state_dict.get(prefix + f"{name}_raw")
            if isinstance(raw, torch.Tensor) and raw.dim() == 0:  # written when the raw gains were 0-dim
                state_dict[prefix + f"{name}_raw"] = raw.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, control_first_layer={self.control_first_layer}"


def layer_gains(config: PIDConfig, learned: "PIDGains | None"):
    """The gains to pass to :func:`pid_update`: the learned ones if the layer has them, else the config."""
    return learned() if learned is not None else config
