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

Compiled rows (``--compiled``; ``make bench`` runs both): the same shapes, stock and method each compiled the way a
user of the zoo compiles (inductor, the CPU): decode = ``generate`` on a static cache (``generation_config.max_cache_len``
fixed, so every call reuses one cache size) with transformers' own compile of the decoding step
(``generation_config.compile_config``: ``CompileConfig(fullgraph=True, mode="default")``, the prefill eager; on the CPU
transformers compiles only when ``compile_config._compile_all_devices`` is set); train = ``torch.compile(model)``
around the same step (forward, loss, backward through the compiled graphs; the SGD step eager). The compiled stock
model is built once per shape and shared by every method's row (one compile); each method model compiles once.
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
#: the targets (issue 59): PID and every other method; compiled (issue 66): method/stock with both compiled
TARGETS = {"decode": {"pid": 0.92, "*": 0.90}, "train": {"pid": 1.07, "*": 1.10},
           "compiled decode": {"pid": 0.97, "neutreno": 0.97, "value_residual": 0.97, "*": 0.90},
           "compiled train": {"twicing": 1.10, "*": 1.02}}
DECODE_REPS, TRAIN_REPS = 18, 14
COMPILED_DECODE_REPS, COMPILED_TRAIN_REPS = 14, 14
#: the static cache of the compiled decode rows: prompt and new tokens fit, whatever a call decodes
MAX_CACHE_LEN = 64


def target(shape: str, method: str, compiled: bool = False) -> float:
    bounds = TARGETS[f"compiled {shape}" if compiled else shape]
    return bounds.get(method, bounds["*"])


#: the compiled stock models, one per shape, shared by every method's row (torch.compile happens once), and the
#: decode rows' CompileConfig
_COMPILED_STOCK: Dict[str, Any] = {}


def _compile_config():
    """One CompileConfig for every row (transformers recompiles a model's call when handed a config unequal to the
    last one)."""
    if "config" not in _COMPILED_STOCK:
        from transformers.generation import CompileConfig

        config = CompileConfig(fullgraph=True, mode="default")  # inductor; "reduce-overhead" (CUDA graphs) is CUDA's
        config._compile_all_devices = True  # transformers compiles on accelerators only unless told
        _COMPILED_STOCK["config"] = config
    return _COMPILED_STOCK["config"]


def decode_pair(method: str, params: Any, compiled: bool = False) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """``generate`` of the tiny Llama, stock and ``method`` (same weights); ``compiled``: on a static cache with the
    decoding step compiled by transformers (the module doc)."""
    from _models import hf_pair

    stock, model = hf_pair(DECODE_CFG, method, params)
    if compiled:  # every row's stock has the same weights (hf_pair's seed): one compiled stock model serves them all
        stock = _COMPILED_STOCK.setdefault("decode", stock)
    prompt = torch.randint(0, DECODE_CFG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    kwargs: Dict[str, Any] = {}
    if compiled:
        kwargs["compile_config"] = _compile_config()

    def decode(m):
        m.eval()
        if compiled:
            m.generation_config.cache_implementation = "static"
            m.generation_config.max_cache_len = MAX_CACHE_LEN

        def run():
            m.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                       **kwargs)
        return run

    return decode(stock), decode(model)


def train_pair(method: str, compiled: bool = False) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """One cross-entropy + SGD step of the tiny DeiT, stock and ``method`` (same initial weights); ``compiled``: each
    model under ``torch.compile`` (inductor)."""
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

    def step(m, call):
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)

        def run():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(call(x), y).backward()
            opt.step()
        return run

    if not compiled:
        return step(stock, stock), step(model, model)
    # the shared compiled stock model keeps training across rows (lr 1e-4: its weights barely move); each method
    # model starts from its weights at the time
    stock, stock_call = _COMPILED_STOCK.setdefault("train", (stock, torch.compile(stock)))
    model.load_state_dict(stock.state_dict(), strict=False)
    return step(stock, stock_call), step(model, torch.compile(model))


def measure(shape: str, method: str, params: Any = None, reps: Optional[int] = None,
            progress: Optional[Callable[[], None]] = None, compiled: bool = False) -> Dict[str, Any]:
    """One host row: ``shape`` ("decode" or "train") for ``method``, on one thread (restored after); ``compiled``:
    both models compiled (the module doc). The warm-up pairs compile (not timed)."""
    from torch._dynamo.utils import counters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if compiled:
        # every model compiled in this process (other sections' too) is a cache entry of the same code objects
        # (Module._call_impl, VisionTransformer.forward): past dynamo's default limit of 8 it would run them eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    graphs = counters["stats"]["unique_graphs"]
    try:
        if shape == "decode":
            fs, fm = decode_pair(method, params, compiled)
            r = interleaved(fs, fm, reps=reps or (COMPILED_DECODE_REPS if compiled else DECODE_REPS), warmup=2,
                            progress=progress, min_time=0.2, clock=time.thread_time)
            steps = NEW_TOKENS * DECODE_CFG["num_hidden_layers"]
            row = dict(r, ratio=1.0 / r["ratio"], unit="tokens/s", tokens=NEW_TOKENS,
                       stock_tokens_per_s=NEW_TOKENS / r["stock_s"], pid_tokens_per_s=NEW_TOKENS / r["pid_s"],
                       us_per_layer_step=r["median_diff_s"] / steps * 1e6, config=DECODE_CFG)
        else:
            fs, fm = train_pair(method, compiled)
            row = dict(interleaved(fs, fm, reps=reps or (COMPILED_TRAIN_REPS if compiled else TRAIN_REPS), warmup=2,
                                   progress=progress, min_time=0.2, clock=time.thread_time),
                       config=dict(TRAIN_CFG, batch=TRAIN_BATCH))
    finally:
        torch.set_num_threads(threads)
    how = None
    if compiled:
        how = ("static cache, transformers' compile of the decoding step (CompileConfig(fullgraph=True, "
               "mode='default'), inductor; prefill eager)" if shape == "decode" else "torch.compile(model), inductor")
    # graphs compiled by the row (warm-up included): one per compiled model (the shared stock's first row: two)
    row["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs
    return dict(row, shape=shape, method=method, params=params, threads=1, compiled=compiled, compile=how,
                bound=target(shape, method, compiled))


def markdown(rows: List[Dict[str, Any]]) -> str:
    """The host table: one line per method, decode tokens/s ratio, µs per layer per decode step, training ratio,
    and the compiled decode and training ratios."""
    by: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[("compiled " if r.get("compiled") else "") + r["shape"]] = r

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
             "(method/stock time). Compiled: both models compiled (inductor): decode on a static cache with "
             "transformers' compile of the decoding step (prefill eager), train under torch.compile(model). "
             "Interleaved pairs, medians.", "",
             "| method | decode tokens/s ratio | µs added per layer per decode step | train time ratio | "
             "compiled decode tokens/s ratio | compiled train time ratio |",
             "|---|---|---|---|---|---|"]
    for method, shapes in by.items():
        d, t = shapes.get("decode"), shapes.get("train")
        cd, ct = shapes.get("compiled decode"), shapes.get("compiled train")
        lines.append(f"| {method} | {cell(d, 'ratio', '.3f', '>=')} | {cell(d, 'us_per_layer_step', '.1f')} | "
                     f"{cell(t, 'ratio', '.3f', '<=')} | {cell(cd, 'ratio', '.3f', '>=')} | "
                     f"{cell(ct, 'ratio', '.3f', '<=')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(TRAIN_METHODS))
    p.add_argument("--only", default="decode,train")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--compiled", choices=("no", "yes", "both"), default="both",
                   help="eager rows, compiled rows, or both (default)")
    args = p.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    params = dict(DECODE_METHODS)
    rows = []
    modes = {"no": (False,), "yes": (True,), "both": (False, True)}[args.compiled]
    for compiled in modes:
        for shape in args.only.split(","):
            for method in args.methods.split(","):
                rows.append(measure(shape, method, params.get(method), args.reps, compiled=compiled))
                r = rows[-1]
                extra = f", {r['us_per_layer_step']:.1f} us/layer/step" if shape == "decode" else ""
                print(f"{'compiled ' if compiled else ''}{shape} {method}: {r['ratio']:.3f}{extra} "
                      f"(spread {r['stock_spread']:.2f}/{r['pid_spread']:.2f})", flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
