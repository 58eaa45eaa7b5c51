"""Gain warm-up: a method's term scaled by ``min(1, t / N)``, ``t`` the model's training-mode forwards (a
persistent int64 buffer), while a model is fine-tuned into the method."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["GainWarmup", "make_warmup"]


class GainWarmup(nn.Module):
    """One model's warm-up counter: calling it returns ``min(1, t / N)`` and, in training mode, advances ``t``."""

    def __init__(self, warmup_steps: int) -> None:
        super().__init__()
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps <= 0:
            raise ValueError(f"GainWarmup needs warmup_steps > 0 (an int), got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def scale(self) -> Tensor:
        """``min(1, t / N)`` as a 0-dim tensor (reads ``t``; a fresh tensor, unaffected by later advances)."""
        dtype = torch.float32 if self.step.device.type == "mps" else torch.float64
        # cumsum of one element: outside AOT autograd's recomputable ops, so a compiled step saves the scale for
        # its backward instead of recomputing it from the advanced buffer (pytorch PR 197039)
        scale = self.step.clamp(max=self.warmup_steps).to(dtype) / self.warmup_steps
        if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():  # an exported graph runs no backward (and
            return scale                                               # ONNX Runtime has no CumSum of a scalar)
        return scale.cumsum(0)

    @torch.no_grad()
    def advance(self) -> None:
        """``t += 1`` in training mode (in place, on the buffer's device: no host synchronisation)."""
        if self.training:
            self.step.add_(1)

    def forward(self) -> Tensor:
        scale = self.scale()
        self.advance()
        return scale

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # a checkpoint without the counter (softmax, or saved before warm-up): t starts at 0, strict load passes
        if prefix + "step" not in state_dict:
            state_dict[prefix + "step"] = torch.zeros((), dtype=torch.long)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"warmup_steps={self.warmup_steps}"


def make_warmup(steps: int, current: Optional[GainWarmup] = None,
                like: Optional[Tensor] = None) -> Optional[GainWarmup]:
    """The counter for ``steps`` forwards (None for 0); ``current`` is kept, or its ``t`` carries over."""
    if not steps:
        return None
    if current is not None and current.warmup_steps == steps:
        return current
    counter = GainWarmup(steps)
    if current is not None:
        counter.step = current.step.clone()
    elif like is not None:
        counter.to(like.device)
    counter.train(current.training if current is not None else True)
    return counter
