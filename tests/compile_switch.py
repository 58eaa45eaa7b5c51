"""What the compile-switch tests (tests/zoos/*/test_*_compile_switch.py) share: each zoo's own compile switch for every
built-in method with fixed gains, learnable gains and warm-up (:func:`variants`), and :class:`Dynamo`, which counts the
graph breaks (by reason) and graphs compiled while a switch ran."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from method_cases import BUILTIN, MODELS, method_cfg

#: the warm-up length of the warm-up variants (training forwards): longer than the tests' runs, so every step has
#: another scale (a scale baked into the graph as a constant would recompile every step)
WARMUP_STEPS = 16


def variants(model: str, methods=None, layers: int = None) -> List:
    """pytest params ``(method, cfg)`` for ``model``: every built-in method there with its "on" parameters, and with
    ``learnable=True`` / ``warmup_steps`` where it takes them; ``layers``: the switch model's depth, where it is
    shallower (the first "on" parameters that act within it)."""
    out = []
    for name, m in BUILTIN.items():
        if model not in m.models or (methods is not None and name not in methods):
            continue
        on = dict(_acting(m, MODELS[model], layers) or {})
        out.append(pytest.param(name, on, id=name))
        if m.learnable:
            out.append(pytest.param(name, {**on, "learnable": True}, id=f"{name}-learnable"))
        if m.warmup:
            out.append(pytest.param(name, {**on, "warmup_steps": WARMUP_STEPS}, id=f"{name}-warmup"))
    return out


def _acting(method, model, layers):
    """The method's first "on" parameters for ``model`` whose ``from_layer`` (where it has one) is within ``layers``."""
    if layers is None:
        return method_cfg(method, model)
    for cfg in method.on(model):
        if (cfg or {}).get("from_layer", 1) <= layers:
            return cfg
    raise ValueError(f"{method.name}: no 'on' parameters act within {layers} layers of {model.name}")


class Dynamo:
    """Dynamo's counters from a fresh start (``torch._dynamo.reset()`` and the counters cleared on entry and exit)."""

    def __enter__(self) -> "Dynamo":
        torch._dynamo.reset()
        counters.clear()
        return self

    def __exit__(self, *exc) -> None:
        torch._dynamo.reset()
        counters.clear()

    @property
    def graph_breaks(self) -> Dict[str, int]:
        """{reason: count} of the graph breaks so far."""
        return dict(counters["graph_break"])

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (each recompilation adds one)."""
        return counters["stats"]["unique_graphs"]


def assert_close_state(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], rtol: float, atol: float,
                       moved_from: Dict[str, torch.Tensor] = None) -> None:
    """Two state dicts equal within tolerance, key by key; with ``moved_from`` (the weights before training), also
    that training changed some of them (the comparison could fail)."""
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
    if moved_from is not None:
        assert any(not torch.equal(want[k], moved_from[k]) for k in want if want[k].is_floating_point())


def assert_variant_trained(model: torch.nn.Module, cfg: dict, before: Dict[str, torch.Tensor], steps: int) -> None:
    """What a variant's compiled training must show beyond equal weights: a warm-up counter advanced once per
    training step (``steps`` < WARMUP_STEPS), and learnable gains that are parameters that trained."""
    if "warmup_steps" in cfg:
        counters = [b for n, b in model.named_buffers() if n.endswith("step")]
        assert counters and all(int(c) == steps < WARMUP_STEPS for c in counters)
    if "learnable" in cfg:
        gains = [n for n, p in model.named_parameters() if "attention_params" in n or "lambda" in n]
        assert gains and any(not torch.equal(model.state_dict()[n], before[n]) for n in gains)
