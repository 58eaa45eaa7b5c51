"""Where PID's extra time goes: torch.profiler op tables of one forward+backward, stock vs PID, and their difference.

    python bench/profile_overhead.py --out bench_out --threads 1          # deit_tiny b8 224 px
    python bench/profile_overhead.py --model pid_fan_tiny_12_p16_224 --base fan_tiny_12_p16_224
    python bench/profile_overhead.py --decode                                # HF Llama-GQA, one decoding step

Writes OUT/profile_<model>.txt: for each aten op, calls and self CPU time in the stock and the PID model
(summed over ``--reps`` profiled steps after warm-up), sorted by the PID-minus-stock time. The ops that PID
adds are elementwise (mul/add/sub/neg on ``(B, H, N, D)`` tensors, forward and backward); the matrix
products and attention kernels are the same calls in both.

``--decode``: one KV-cache decoding step of the HF Llama-GQA model of ``run_all.py`` (batch 4): the tensor ops
each side dispatches (counted with a TorchDispatchMode, so views count too), their difference per layer, the
median step time of each side, and the time of one ``pid_update`` call on that step's shapes. Writes
OUT/profile_decode.txt.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_all import timm_pair, vision_runs  # noqa: E402


def op_table(fn, reps: int):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
    out = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            out[e.key][0] += e.count // reps
            out[e.key][1] += e.self_cpu_time_total / reps / 1e3  # ms per step
    return out


def decode_profile(out: str, threads: int) -> str:
    import collections
    import statistics
    import time
    import timeit

    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    from pid_plugins.core.pid import pid_update
    from pid_plugins.hf import model_method_config
    from _models import HF_CFG, hf_pair

    torch.set_num_threads(threads)
    stock, pid = hf_pair()
    prompt = torch.randint(0, HF_CFG["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0))

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    counts, steps = {}, {}
    for name, m in (("stock", stock), ("pid", pid)):
        m.eval()
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            m(prompt, past_key_values=cache, use_cache=True)
            with Count() as c:
                m(prompt[:, -1:], past_key_values=cache, use_cache=True)
            counts[name] = c.ops

            def step(m=m, cache=cache):
                with torch.no_grad():
                    m(prompt[:, -1:], past_key_values=cache, use_cache=True)
                    cache.crop(-1)
            steps[name] = step
    times = {"stock": [], "pid": []}
    for i in range(200):
        for name in (("stock", "pid") if i % 2 == 0 else ("pid", "stock")):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    layers = HF_CFG["num_hidden_layers"]
    cfg = model_method_config(pid.config)
    d = HF_CFG["hidden_size"] // HF_CFG["num_attention_heads"]
    o = torch.randn(4, 1, HF_CFG["num_attention_heads"], d).transpose(1, 2)
    v = torch.randn(4, HF_CFG["num_key_value_heads"], 1, d)
    _, st = pid_update(o, v, None, cfg)
    n = 2000
    t_update = timeit.timeit(lambda: pid_update(o, v, st, cfg), number=n) / n
    t_add = timeit.timeit(lambda: o.add(o, alpha=0.5), number=n) / n
    lines = [f"HF Llama-GQA ({layers} layers, hidden {HF_CFG['hidden_size']}, 8 query / 2 key-value heads), one "
             f"decoding step, batch 4, {threads} thread(s), torch {torch.__version__}",
             f"median step: stock {med['stock'] * 1e3:.2f} ms, PID {med['pid'] * 1e3:.2f} ms "
             f"(+{(med['pid'] - med['stock']) * 1e6 / layers:.0f} us per layer, PID/stock tokens/s "
             f"{med['stock'] / med['pid']:.3f})",
             f"one pid_update call on these shapes: {t_update * 1e6:.1f} us; one elementwise add of the same size: "
             f"{t_add * 1e6:.1f} us",
             f"tensor ops dispatched per step: stock {sum(counts['stock'].values())}, PID "
             f"{sum(counts['pid'].values())}",
             "", f"{'op':32s} {'stock':>6s} {'PID':>6s} {'extra per layer':>16s}"]
    for k in sorted(counts["stock"].keys() | counts["pid"].keys()):
        a, b = counts["stock"][k], counts["pid"][k]
        if a != b:
            lines.append(f"{k:32s} {a:6d} {b:6d} {(b - a) / layers:16.1f}")
    text = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "profile_decode.txt"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pid_deit_tiny_patch16_224")
    p.add_argument("--base", default="deit_tiny_patch16_224")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--decode", action="store_true", help="profile one HF decoding step instead (see above)")
    args = p.parse_args()
    if args.decode:
        print(decode_profile(args.out, args.threads))
        return
    torch.set_num_threads(args.threads)
    stock, pid = timm_pair(args.model, args.base)
    x = torch.randn(args.batch, 3, 224, 224)
    fs, fp = vision_runs(stock, pid, x)["forward+backward"]
    for _ in range(2):
        fs(), fp()
    ts, tp = op_table(fs, args.reps), op_table(fp, args.reps)
    rows = sorted(set(ts) | set(tp), key=lambda k: -(tp.get(k, [0, 0.0])[1] - ts.get(k, [0, 0.0])[1]))
    total_s = sum(v[1] for v in ts.values())
    total_p = sum(v[1] for v in tp.values())
    calls_s = sum(v[0] for v in ts.values())
    calls_p = sum(v[0] for v in tp.values())
    lines = [f"{args.model} vs {args.base}, batch {args.batch}, 224 px, forward+backward, {args.threads} thread(s), "
             f"torch {torch.__version__}; per step, mean of {args.reps} profiled steps",
             f"aten ops (self time, all ops): stock {calls_s} calls {total_s:.1f} ms, PID {calls_p} calls "
             f"{total_p:.1f} ms",
             "",
             f"{'op':44s} {'stock calls':>11s} {'PID calls':>10s} {'stock ms':>9s} {'PID ms':>8s} {'PID-stock ms':>12s}"]
    for k in rows:
        cs, ms = ts.get(k, [0, 0.0])
        cp, mp = tp.get(k, [0, 0.0])
        if cs == cp and abs(mp - ms) < 0.5:
            continue
        lines.append(f"{k:44s} {cs:11d} {cp:10d} {ms:9.1f} {mp:8.1f} {mp - ms:12.1f}")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{args.model}.txt")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
