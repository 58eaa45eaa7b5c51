"""Host time of the transformers adapter's forward hooks: microseconds per training forward of a 32-layer tiny Llama.

Each forward hook pid-plugins registers on the model is wrapped in a timer, and their times are summed per
forward (median over the forwards). The hooks run once per forward whatever the model's width, so the figure is
the adapter's per-forward host cost (the attention function's per-layer cost is the ``host`` section's).

A second figure times the same pre-hooks called again and again on the arguments of one forward (hot: their code
and the module objects they read in the CPU's caches). In a training forward they run first after the previous
step's backward and optimizer step, and on this project's VM the difference is large: most of the first figure is the
first touch of the layers' module dicts, which the forward reads right after (docs/performance.md).

    python bench/hooks.py              # prints both figures
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List

import torch

#: the tiny Llama of the host-cost shapes, 32 layers
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _timed(hook: Callable, spent: List[float]) -> Callable:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return hook(*args, **kwargs)
        finally:
            spent.append(time.thread_time() - start)
    return timed


def _model(method: str) -> torch.nn.Module:
    """The 32-layer tiny Llama with ``method``, in training mode (seed 0)."""
    import pid_plugins.hf  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation=method)).train()


def hook_microseconds(method: str = "pid", forwards: int = 30, threads: int = 1) -> float:
    """Median over ``forwards`` training forwards (forward, loss, backward) of the summed time of pid-plugins' forward
    hooks on the model, in microseconds."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(method)
        spent: List[float] = []
        wrapped = 0
        for module in model.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__module__", "").startswith("pid_plugins."):
                        hooks[key] = _timed(hook, spent)
                        wrapped += 1
        if not wrapped:
            return 0.0  # the model carries no hook of ours
        ids = torch.randint(0, SHAPE["vocab_size"], (1, 16))
        per_forward = []
        for i in range(forwards + 3):
            spent.clear()
            model(ids, labels=ids, use_cache=False).loss.backward()
            if i >= 3:  # after warm-up
                per_forward.append(sum(spent))
        return statistics.median(per_forward) * 1e6
    finally:
        torch.set_num_threads(previous)


def hot_microseconds(method: str = "pid", reps: int = 2000, threads: int = 1) -> float:
    """pid-plugins' forward pre-hooks of one training forward of the same model, called ``reps`` times in a row on that
    forward's arguments (each call gets a copy of its keyword arguments, as torch hands them): microseconds per
    forward, median of five rounds. The post-hooks are left out (they advance the warm-up counter)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(method)
        calls: List[tuple] = []

        def recording(hook: Callable) -> Callable:
            def record(module: Any, args: tuple, kwargs: dict) -> Any:
                calls.append((hook, module, args, dict(kwargs)))
                return hook(module, args, kwargs)
            return record

        for module in model.modules():
            hooks = module._forward_pre_hooks
            for key, hook in list(hooks.items()):
                if getattr(hook, "__module__", "").startswith("pid_plugins."):
                    hooks[key] = recording(hook)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, 16))
        for _ in range(3):
            calls.clear()
            model(ids, labels=ids, use_cache=False).loss.backward()
        if not calls:
            return 0.0
        rounds = []
        for _ in range(5):
            start = time.thread_time()
            for _ in range(reps):
                for hook, module, args, kwargs in calls:
                    hook(module, args, dict(kwargs))
            rounds.append((time.thread_time() - start) / reps)
        return statistics.median(rounds) * 1e6
    finally:
        torch.set_num_threads(previous)


def add_microseconds(reps: int = 20000) -> float:
    """One tiny aten add's host time on this machine (the unit the hooks' cost is read in), one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(4)
        times = []
        for _ in range(5):
            start = time.thread_time()
            for _ in range(reps):
                x + x
            times.append((time.thread_time() - start) / reps)
        return statistics.median(times) * 1e6
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    us, hot, add = hook_microseconds(), hot_microseconds(), add_microseconds()
    print(f"pid-plugins' forward hooks, 32-layer tiny Llama, training forward: {us:.0f} us = {us / add:.0f} tiny aten "
          f"adds ({add:.2f} us each)")
    print(f"their pre-hooks called hot, on the same forward's arguments: {hot:.1f} us = {hot / add:.1f} tiny aten adds")
