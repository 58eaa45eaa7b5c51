"""Learnable per-layer gains (opt-in via ``PIDConfig(learnable=True)``)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import PIDConfig

__all__ = ["PIDGains", "layer_gains"]


class PIDGains(nn.Module):
    """Trainable ``lambda_p, lambda_i, lambda_d`` of one layer, initialised from a :class:`PIDConfig`.

    ``beta`` stays fixed (it weighs the reference signal and must stay in (0, 1]). The parameters are
    scalars, so they broadcast over any value shape; exclude them from weight decay like norms/biases.
    """

    def __init__(self, config: PIDConfig) -> None:
        super().__init__()
        self.beta = config.beta
        self.lambda_p = nn.Parameter(torch.tensor(config.lambda_p))
        self.lambda_i = nn.Parameter(torch.tensor(config.lambda_i))
        self.lambda_d = nn.Parameter(torch.tensor(config.lambda_d))

    def forward(self) -> tuple[Tensor, Tensor, Tensor, float]:
        return (self.lambda_p, self.lambda_i, self.lambda_d, self.beta)

    def extra_repr(self) -> str:
        return f"beta={self.beta}"


def layer_gains(config: PIDConfig, learned: "PIDGains | None"):
    """The gains to pass to :func:`pid_update`: the learned ones if the layer has them, else the config."""
    return learned() if learned is not None else config
