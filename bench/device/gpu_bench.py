"""The GPU bench of the prepared device run (bench/device/run.sh): each method against the stock model, on one device.

    python bench/device/gpu_bench.py --device cuda --out $OUT            # the device run (H100/H200 shapes)
    python bench/device/gpu_bench.py --device cpu --tiny --out /tmp/o    # the dry run (test_device_script.py)

Rows (PID's first, then every other built-in method's, the compiled rows last, so that a run cut short still has
PID's eager rows):

    deit-s train        timm deit_small_patch16_224 vs pid_deit_small_patch16_224 (attention=<method>), 224 px, b128,
                        bf16 autocast forward + backward
    llama-1b train      a Llama of Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 key-value heads, MLP
                        8192, vocabulary 32000: about 1.1B parameters, random weights), bf16 weights, b4 x 1024
                        tokens forward + backward (the loss's backward; no optimiser step: the same for both)
    llama-1b decode bN  generate() with the dynamic cache, eager, b1 and b8, a 128-token prompt, 32 new tokens, the
                        eager
    llama-1b compiled   the static cache, each decoding step torch.compile(mode="reduce-overhead", fullgraph=True),
                        b1, the 31 compiled decoding steps timed (the eager prefill before them is not)
                        (``--compiled-methods``: PID's by default; every compile costs tens of seconds)

Method: the stock model and the method model (the stock model's weights loaded) live in one process; after warm-up
they run alternately (the pair's order flips every repetition), each call timed with CUDA events (``perf_counter`` on
the CPU); the figure is the median over repetitions of method/stock. Peak memory: the most allocated during one call
beyond what was allocated before it (``torch.cuda.max_memory_allocated``; not measured on the CPU, where
``make bench`` does it).
``--budget-s``: rows left when it is spent are written as skipped with that reason. The JSON and Markdown are
rewritten after every row (OUT/gpu_bench.json, OUT/gpu_bench.md), and a progress line is printed per row.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

#: the shapes of the device run and of the dry run
SHAPES = {
    "full": dict(deit="deit_small_patch16_224", deit_batch=128, img=224,
                 llama=dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
                 train_batch=4, train_seq=1024, prompt=128, new_tokens=32, warmup=2, reps=5, train_reps=15),
    "tiny": dict(deit="deit_tiny_patch16_224", deit_batch=2, img=32,
                 deit_args=dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10),
                 llama=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
                 train_batch=2, train_seq=16, prompt=8, new_tokens=3, warmup=1, reps=1, train_reps=1),
}
#: the parameters a causal model runs a method with, where its zoo preset is not causal
CAUSAL_PARAMS: Dict[str, Any] = {"elliptical": {"mean": "prefix"}}
def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ================================================================================================ timing
class Clock:
    """Times one call: CUDA events on a CUDA device, perf_counter otherwise (seconds)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        setup = getattr(fn, "setup", None)
        if setup is not None:  # untimed preparation (the compiled row's prefill)
            setup()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def interleaved(clock: Clock, stock: Callable[[], object], method: Callable[[], object], warmup: int,
                reps: int) -> Dict[str, float]:
    for _ in range(warmup):
        for fn in (stock, method):
            if getattr(fn, "setup", None) is not None:
                fn.setup()
            fn()
    ts, tm, ratios = [], [], []
    for i in range(reps):
        if i % 2:
            b = clock(method)
            a = clock(stock)
        else:
            a = clock(stock)
            b = clock(method)
        ts.append(a), tm.append(b), ratios.append(b / a)
    return {"stock_s": statistics.median(ts), "method_s": statistics.median(tm), "ratio": statistics.median(ratios),
            "spread": (max(ratios) - min(ratios)) / statistics.median(ratios)}


def peak_bytes(device: torch.device, fn: Callable[[], object]) -> Optional[int]:
    """The most memory allocated during ``fn()`` beyond what was allocated before it (None off CUDA)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        if getattr(fn, "setup", None) is not None:
            fn.setup()
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return None  # the CPU has no allocator statistics: make bench measures CPU memory (bench/_harness.py)


# ================================================================================================ the workloads
def deit_pair(shape, method: str, device, stock=None):
    import timm

    import pid_plugins.timm  # noqa: F401

    name = shape["deit"]
    args = shape.get("deit_args", {})
    if stock is None:
        torch.manual_seed(0)
        stock = timm.create_model(name, **args).to(device)
    model = timm.create_model("pid_" + name, attention=method, **args).to(device)
    model.load_state_dict(stock.state_dict())
    return stock, model


def deit_step(shape, device):
    x = torch.randn(shape["deit_batch"], 3, shape["img"], shape["img"], device=device)

    def make(m):
        def run():
            m.train()
            m.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = m(x).float().square().mean()
            loss.backward()
        return run
    return make


def llama_pair(shape, method: str, device, stock=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf

    if stock is None:
        torch.manual_seed(0)
        with torch.device(device):
            stock = LlamaForCausalLM(LlamaConfig(**shape["llama"])).to(torch.bfloat16)
        stock.set_attn_implementation("sdpa")
    with torch.device(device):  # built on the device (1B parameters initialised there, not on the host)
        model = LlamaForCausalLM(LlamaConfig(**shape["llama"])).to(torch.bfloat16)
    model.load_state_dict(stock.state_dict())
    model.set_attn_implementation("sdpa")
    pid_plugins.hf.convert(model, method, CAUSAL_PARAMS.get(method))
    return stock, model


def llama_ids(shape, batch: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, shape["llama"]["vocab_size"], (batch, seq), generator=g).to(device)


def llama_train(shape, device):
    ids = llama_ids(shape, shape["train_batch"], shape["train_seq"], device)

    def make(m):
        def run():
            m.train()
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
        return run
    return make


def llama_decode(shape, device, batch: int):
    prompt = llama_ids(shape, batch, shape["prompt"], device)
    n = shape["new_tokens"]

    def make(m):
        def run():
            m.eval()
            with torch.no_grad():
                m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return run
    return make


def llama_compiled(shape, device, backend: str):
    from transformers import StaticCache

    prompt = llama_ids(shape, 1, shape["prompt"], device)
    n = shape["new_tokens"]

    def make(m):
        m.eval()
        cache = StaticCache(config=m.config, max_cache_len=prompt.shape[1] + n)
        if backend == "inductor":
            step = torch.compile(m, mode="reduce-overhead", fullgraph=True)
        else:
            step = torch.compile(m, backend=backend, fullgraph=True)

        first = {}

        def prefill():  # eager, untimed: the row times the compiled decoding steps alone
            cache.reset()
            with torch.no_grad():
                first["tok"] = m(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        def run():
            tok = first["tok"]
            with torch.no_grad():  # one compiled decoding step per token
                for _ in range(n - 1):
                    tok = step(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        run.setup = prefill
        return run
    return make


# ================================================================================================ the rows
def plan(args, shape, device) -> List[Dict[str, Any]]:
    """The rows in run order: (workload, method, builder of (stock fn, method fn), kind) dicts."""
    import pid_plugins

    methods = ["pid"] + [m for m in pid_plugins.list_methods() if m != "pid"]
    if args.methods:
        methods = [m for m in methods if m in args.methods.split(",")]
    compiled = args.compiled_methods.split(",") if args.compiled_methods else []
    rows: List[Dict[str, Any]] = []
    for method in methods:
        for family, workload, maker in (
                ("deit", f"deit-s train bf16 b{shape['deit_batch']}", deit_step(shape, device)),
                ("llama", f"llama-1b train bf16 b{shape['train_batch']}x{shape['train_seq']}",
                 llama_train(shape, device))):
            rows.append(dict(workload=workload, method=method, family=family, make=maker, kind="time"))
        for batch in (1, 8):
            rows.append(dict(workload=f"llama-1b decode b{batch} dynamic eager", method=method, family="llama",
                             make=llama_decode(shape, device, batch), kind="tokens/s"))
        if method in compiled:
            rows.append(dict(workload="llama-1b decode b1 static compiled", method=method, family="llama",
                             make=llama_compiled(shape, device, args.compile_backend), kind="tokens/s",
                             compiled=True))
    # PID's rows first (its compiled row, tens of seconds of compiling, after its eager rows: the targets are PID's),
    # then the other methods'
    return sorted(rows, key=lambda r: (r["method"] != "pid", bool(r.get("compiled"))))


TARGETS = {"time": ("<=", 1.02), "tokens/s": (">=", 0.95), "compiled": (">=", 0.98), "memory": ("<=", 1.05)}


def verdict(kind: str, ratio: float) -> Optional[bool]:
    op, bound = TARGETS[kind]
    return ratio <= bound if op == "<=" else ratio >= bound


def write(out: str, result: Dict[str, Any]) -> None:
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["# GPU bench: each method / stock (same weights, one process, interleaved)", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in result["environment"].items()), "",
             "| workload | method | stock ms | method ms | figure (time rows: method/stock time; tokens/s rows: "
             "method/stock tokens/s) | spread | peak memory method/stock | target | met |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['workload']} | {r['method']} | - | - | skipped: {r['skipped']} | | | | |")
            continue
        op, bound = TARGETS[r["target_kind"]]
        mem = f"{r['memory_ratio']:.3f}" if r.get("memory_ratio") is not None else "-"
        lines.append(f"| {r['workload']} | {r['method']} | {r['stock_s'] * 1e3:.2f} | {r['method_s'] * 1e3:.2f} | "
                     f"{r['figure']:.3f} | {r['spread']:.3f} | {mem} | {op} {bound} | "
                     f"{'yes' if r['met'] else 'NO'} |")
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def environment(device) -> Dict[str, Any]:
    env: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for name in ("transformers", "timm", "triton", "pid_plugins"):
        try:
            module = importlib.import_module(name)
            env[name] = getattr(module, "__version__", "?")
        except ImportError:
            env[name] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=os.environ.get("DEVICE", "cuda"))
    p.add_argument("--out", default=os.environ.get("OUT", "bench_device_out"))
    p.add_argument("--tiny", action="store_true", help="the dry run's tiny shapes")
    p.add_argument("--methods", default="", help="comma-separated; default: every built-in method, PID first")
    p.add_argument("--compiled-methods", default="pid", help="the methods of the compiled static-cache row")
    p.add_argument("--compile-backend", default="inductor",
                   help="inductor (mode reduce-overhead: the device run) or another backend (eager: the dry run)")
    p.add_argument("--rows", default="", help="a regular expression: only the rows whose 'workload [method]' it finds")
    p.add_argument("--no-profile", action="store_true", help="leave out the profile of PID's decoding step")
    p.add_argument("--budget-s", type=float, default=330.0, help="rows left when this is spent are skipped")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what users train with; both sides alike
    else:
        torch.set_num_threads(1)  # the dry run: tiny shapes, where threads only add contention
    os.makedirs(args.out, exist_ok=True)
    shape = SHAPES["tiny" if args.tiny else "full"]
    clock = Clock(device)
    t_start = time.monotonic()
    result: Dict[str, Any] = {"environment": environment(device), "shapes": "tiny" if args.tiny else "full",
                              "args": vars(args), "rows": []}
    rows = plan(args, shape, device)
    if args.rows:
        import re

        rows = [r for r in rows if re.search(args.rows, f"{r['workload']} [{r['method']}]")]
    log(f"{len(rows)} rows on {device} ({result['environment']})")
    stocks: Dict[str, Any] = {}
    profiled = args.no_profile
    for i, row in enumerate(rows, 1):
        if not profiled and row["method"] != "pid":  # PID's rows done: where its decoding step spends the time
            profiled = True
            try:
                profile_decode(shape, device, os.path.join(args.out, "gpu_profile.txt"), stocks)
            except Exception as err:  # noqa: BLE001  (the profile explains; its failure stops no row)
                log(f"profile failed: {err!r}")
        out_row = {"workload": row["workload"], "method": row["method"]}
        elapsed = time.monotonic() - t_start
        if "skip" in row:
            out_row["skipped"] = row["skip"]
        elif elapsed > args.budget_s:
            out_row["skipped"] = f"time budget spent ({elapsed:.0f} s of --budget-s {args.budget_s:.0f})"
        else:
            try:
                out_row.update(run_row(row, shape, device, clock, stocks))
            except Exception as err:  # a failed row is recorded and the run goes on
                out_row["skipped"] = f"failed: {type(err).__name__}: {str(err)[:300]}"
                log(f"row {i} failed: {err!r}")
        result["rows"].append(out_row)
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        write(args.out, result)
        figure = out_row.get("figure")
        log(f"row {i}/{len(rows)} {row['workload']} [{row['method']}]: "
            + (f"{figure:.3f} (stock {out_row['stock_s'] * 1e3:.2f} ms)" if figure is not None
               else f"skipped: {out_row['skipped']}"))
    log(f"done in {time.monotonic() - t_start:.0f} s: {args.out}/gpu_bench.json, gpu_bench.md")
    return 0


def profile_decode(shape, device, path: str, stocks: Dict[str, Any]) -> None:
    """The explanation of the decoding rows: one greedy ``generate`` (b1, dynamic cache, eager) of the stock model and
    of PID's, under torch's profiler: the ops launched and the device time each
    took, the 20 costliest per run, and the totals (written to ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    stocks.pop("deit", None)
    stock, model = llama_pair(shape, "pid", device, stocks.get("llama"))
    stocks["llama"] = stock
    maker = llama_decode(shape, device, 1)
    runs = [("stock", maker(stock)), ("pid eager", maker(model))]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    lines = [f"# One greedy generate, b1, {shape['new_tokens']} new tokens after {shape['prompt']}, dynamic cache, "
             f"eager ({device})", ""]
    for name, fn in runs:
        fn()  # warm: the kernels compiled, the allocator filled
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
        device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
        lines += [f"## {name}: wall {wall * 1e3:.1f} ms (under the profiler), kernel launches {launches}, "
                  f"device time {device_us / 1e3:.1f} ms", "",
                  events.table(sort_by=sort, row_limit=20, max_name_column_width=60), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    del model
    log(f"profile written: {path}")


def run_row(row, shape, device, clock: Clock, stocks: Dict[str, Any]) -> Dict[str, Any]:
    """Builds the pair (the stock model kept per family), times it interleaved, measures peak memory."""
    family = row["family"]
    build = deit_pair if family == "deit" else llama_pair
    for other in [k for k in stocks if k != family]:  # one family's models on the device at a time
        del stocks[other]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    stock, model = build(shape, row["method"], device, stocks.get(family))
    stocks[family] = stock
    make_stock = row.get("make_stock", row["make"])
    fs, fm = make_stock(stock), row["make"](model)
    timing = interleaved(clock, fs, fm, shape["warmup"], shape["train_reps" if row["kind"] == "time" else "reps"])
    kind = "compiled" if row.get("compiled") else row["kind"]
    figure = timing["ratio"] if row["kind"] == "time" else 1.0 / timing["ratio"]  # tokens/s: method / stock
    mem_stock, mem_method = peak_bytes(device, fs), peak_bytes(device, fm)
    del model, fs, fm
    return {**timing, "figure": figure, "target_kind": kind, "met": verdict(kind, figure),
            "peak_stock_bytes": mem_stock, "peak_method_bytes": mem_method,
            "memory_ratio": mem_method / mem_stock if mem_stock else None}


if __name__ == "__main__":
    sys.exit(main())
