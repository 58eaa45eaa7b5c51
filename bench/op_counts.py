"""Aten ops each method adds per decoder layer in one decoding step: `make bench` (section ``ops``).

    python bench/op_counts.py                     # every method, the small GQA Llama of run_all.py

One KV-cache decoding step (batch 1, 16-token prompt) of the 6-layer GQA Llama of ``run_all.py`` (hidden 256,
8 query / 2 key-value heads), stock (sdpa) and each method with the same weights. Every aten op the step
dispatches is counted with a TorchDispatchMode (below autograd, so what would run on a device), split into
views (ops whose output aliases an input: no kernel, but dispatcher time) and kernel-launching ops (the rest).
The table gives (method - stock) / layers for each, and the extra ops by name.
"""
from __future__ import annotations

import collections
import os
import sys
from typing import Any, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def is_view(func: Any) -> bool:
    """An op whose output aliases its input (no kernel): view, expand, unsqueeze, transpose, ..."""
    return bool(getattr(func, "is_view", False))


def decode_step_ops(model: torch.nn.Module, prompt: torch.Tensor) -> collections.Counter:
    from transformers import DynamicCache

    model.eval()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, past_key_values=cache, use_cache=True)
        model(prompt[:, -1:], past_key_values=cache, use_cache=True)  # warm (lazy paths)
        cache.crop(-1)
        with _Count() as c:
            model(prompt[:, -1:], past_key_values=cache, use_cache=True)
    return c.ops


def op_rows(methods=None) -> List[Dict[str, Any]]:
    from _models import HF_CFG, HF_SIBLINGS, hf_pair

    methods = methods or (("pid", None),) + HF_SIBLINGS
    layers = HF_CFG["num_hidden_layers"]
    prompt = torch.randint(0, HF_CFG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    rows = []
    stock_ops = None
    for method, params in methods:
        stock, model = hf_pair(HF_CFG, method, params)
        if stock_ops is None:
            stock_ops = decode_step_ops(stock, prompt)
        ops = decode_step_ops(model, prompt)
        extra = {str(k): ops[k] - stock_ops[k] for k in ops.keys() | stock_ops.keys() if ops[k] != stock_ops[k]}
        kern = sum(ops[k] - stock_ops[k] for k in ops.keys() | stock_ops.keys() if not is_view(k))
        views = sum(ops[k] - stock_ops[k] for k in ops.keys() | stock_ops.keys() if is_view(k))
        rows.append(dict(method=method, params=params, layers=layers, stock_ops=sum(stock_ops.values()),
                         ops=sum(ops.values()), kernels_per_layer=kern / layers, views_per_layer=views / layers,
                         extra=dict(sorted(extra.items()))))
    return rows


def markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["Aten ops added per decoder layer, one decoding step (dynamic cache, batch 1) of a 6-layer GQA Llama "
             "(hidden 256, 8/2 heads), method - stock:", "",
             "| method | stock ops/step | method ops/step | kernel-launching ops added per layer | views added per layer "
             "| extra ops (whole step) |", "|---|---|---|---|---|---|"]
    for r in rows:
        extra = ", ".join(f"{k.replace('aten.', '')} {v:+d}" for k, v in r["extra"].items())
        lines.append(f"| {r['method']} | {r['stock_ops']} | {r['ops']} | {r['kernels_per_layer']:.2f} | "
                     f"{r['views_per_layer']:.2f} | {extra} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(markdown(op_rows()))
