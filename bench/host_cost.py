"""Host cost of every method at tiny widths on one thread: `make bench` (section ``host``).

    python bench/host_cost.py                       # every method, both shapes
    python bench/host_cost.py --methods pid --only decode

At these widths a step is host time (Python and the dispatch of each aten op), as a GPU's eager step is: the
ratios stand for the GPU's eager regime (docs/performance.md). Two shapes, method vs stock with the same weights,
interleaved pairs in one process (bench/_harness.py), one thread, timed by the thread's CPU time
(``time.thread_time``: on a loaded machine, the time the thread waits for a core is not counted):

    decode  Llama hidden 64, 8 layers, 4 / 2 kv heads, vocab 256, b1, 16-token prompt, 32 new tokens, dynamic cache,
            ``generate``: method/stock tokens/s, and the microseconds the method adds per layer per decode step
            (the median over pairs of the time difference / (32 x 8))
    train   timm DeiT embed 64, depth 6, 2 heads, img 32, patch 8, 10 classes, b2, cross-entropy + SGD step:
            method/stock time
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import interleaved  # noqa: E402
from _models import HF_SIBLINGS  # noqa: E402

DECODE_CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
PROMPT, NEW_TOKENS = 16, 32
TRAIN_CFG = dict(img_size=32, patch_size=8, embed_dim=64, depth=6, num_heads=2, num_classes=10)
TRAIN_BATCH = 2
#: (method, transformers parameters): the decoding rows' methods (Elliptical with its causal prefix mean)
DECODE_METHODS = (("pid", None),) + HF_SIBLINGS
#: the training rows' methods (each at its timm default)
TRAIN_METHODS = tuple(m for m, _ in DECODE_METHODS)
#: the targets (issue 59): PID and every other method
TARGETS = {"decode": {"pid": 0.92, "*": 0.90}, "train": {"pid": 1.07, "*": 1.10}}
DECODE_REPS, TRAIN_REPS = 18, 14


def target(shape: str, method: str) -> float:
    bounds = TARGETS[shape]
    return bounds.get(method, bounds["*"])


def decode_pair(method: str, params: Any) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """``generate`` of the tiny Llama, stock and ``method`` (same weights)."""
    from _models import hf_pair

    stock, model = hf_pair(DECODE_CFG, method, params)
    prompt = torch.randint(0, DECODE_CFG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))

    def decode(m):
        m.eval()

        def run():
            m.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return run

    return decode(stock), decode(model)


def train_pair(method: str) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """One cross-entropy + SGD step of the tiny DeiT, stock and ``method`` (same initial weights)."""
    import timm
    import torch.nn.functional as F

    import pid_plugins.timm  # noqa: F401

    torch.manual_seed(0)
    stock = timm.create_model("deit_tiny_patch16_224", **TRAIN_CFG)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention=method, **TRAIN_CFG)
    model.load_state_dict(stock.state_dict(), strict=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TRAIN_BATCH, 3, TRAIN_CFG["img_size"], TRAIN_CFG["img_size"], generator=g)
    y = torch.randint(0, TRAIN_CFG["num_classes"], (TRAIN_BATCH,), generator=g)

    def step(m):
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)

        def run():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            opt.step()
        return run

    return step(stock), step(model)


def measure(shape: str, method: str, params: Any = None, reps: Optional[int] = None,
            progress: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """One host row: ``shape`` ("decode" or "train") for ``method``, on one thread (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if shape == "decode":
            fs, fm = decode_pair(method, params)
            r = interleaved(fs, fm, reps=reps or DECODE_REPS, warmup=2, progress=progress, min_time=0.2,
                            clock=time.thread_time)
            steps = NEW_TOKENS * DECODE_CFG["num_hidden_layers"]
            row = dict(r, ratio=1.0 / r["ratio"], unit="tokens/s", tokens=NEW_TOKENS,
                       stock_tokens_per_s=NEW_TOKENS / r["stock_s"], pid_tokens_per_s=NEW_TOKENS / r["pid_s"],
                       us_per_layer_step=r["median_diff_s"] / steps * 1e6, config=DECODE_CFG)
        else:
            fs, fm = train_pair(method)
            row = dict(interleaved(fs, fm, reps=reps or TRAIN_REPS, warmup=2, progress=progress, min_time=0.2,
                                   clock=time.thread_time),
                       config=dict(TRAIN_CFG, batch=TRAIN_BATCH))
    finally:
        torch.set_num_threads(threads)
    return dict(row, shape=shape, method=method, params=params, threads=1, bound=target(shape, method))


def markdown(rows: List[Dict[str, Any]]) -> str:
    """The host table: one line per method, decode tokens/s ratio, µs per layer per decode step, training ratio."""
    by: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[r["shape"]] = r

    def cell(r: Optional[Dict[str, Any]], key: str, fmt: str, op: str = "") -> str:
        if r is None:
            return ""
        value = r[key]
        text = format(value, fmt)
        if op:
            ok = value >= r["bound"] if op == ">=" else value <= r["bound"]
            text += f" ({op} {r['bound']:.2f}{'' if ok else ' **no**'})"
        return text

    lines = ["Host cost at tiny widths, one thread (the GPU's eager regime): decode = Llama hidden 64, 8 layers, 4/2 "
             "heads, vocab 256, b1, 16+32 tokens, dynamic cache, `generate` (method/stock tokens/s; Elliptical with "
             "mean='prefix'); train = timm DeiT embed 64, depth 6, 2 heads, img 32, patch 8, b2, cross-entropy + SGD "
             "(method/stock time). Interleaved pairs, medians.", "",
             "| method | decode tokens/s ratio | µs added per layer per decode step | train time ratio |",
             "|---|---|---|---|"]
    for method, shapes in by.items():
        d, t = shapes.get("decode"), shapes.get("train")
        lines.append(f"| {method} | {cell(d, 'ratio', '.3f', '>=')} | {cell(d, 'us_per_layer_step', '.1f')} | "
                     f"{cell(t, 'ratio', '.3f', '<=')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(TRAIN_METHODS))
    p.add_argument("--only", default="decode,train")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    params = dict(DECODE_METHODS)
    rows = []
    for shape in args.only.split(","):
        for method in args.methods.split(","):
            rows.append(measure(shape, method, params.get(method), args.reps))
            r = rows[-1]
            extra = f", {r['us_per_layer_step']:.1f} us/layer/step" if shape == "decode" else ""
            print(f"{shape} {method}: {r['ratio']:.3f}{extra} (spread {r['stock_spread']:.2f}/{r['pid_spread']:.2f})",
                  flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
