"""PID/stock time ratio of a timm model, measured in one process with interleaved repetitions.

    python bench/timm_overhead.py --model pid_deit_tiny_patch16_224 --batch 8 --threads 1 2

Builds the PID model and the stock model of its base architecture with identical weights, warms both up,
then alternates them (stock, PID, stock, PID, ...) so that machine noise hits both alike, and reports the
median time of each and the PID/stock ratio of the medians, for forward and forward+backward. Absolute
times on shared machines are noise; the ratio is the figure. Writes JSON (``--out``) and prints markdown.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def measure(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    import timm
    from tqdm import tqdm

    import pid_plugins.timm  # noqa: F401
    from pid_plugins import get_model_entry

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pid_deit_tiny_patch16_224")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15, help="interleaved repetitions per model and mode")
    p.add_argument("--out", default="bench/timm_overhead.json")
    args = p.parse_args()

    base = get_model_entry(args.model).base
    torch.manual_seed(0)
    stock = timm.create_model(base)
    pid = timm.create_model(args.model)
    pid.load_state_dict(stock.state_dict())
    x = torch.randn(args.batch, 3, args.img_size, args.img_size)

    def fwd(m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    def fwd_bwd(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        return run

    results = {"model": args.model, "base": base, "batch": args.batch, "img_size": args.img_size,
               "torch": torch.__version__, "timm": timm.__version__, "machine": platform.machine(),
               "cpu_count": torch.get_num_threads(), "runs": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mode, make in (("forward", fwd), ("forward+backward", fwd_bwd)):
            stock.train(mode != "forward"), pid.train(mode != "forward")
            fs, fp = make(stock), make(pid)
            for _ in range(args.warmup):
                fs(), fp()
            ts, tp = [], []
            for _ in tqdm(range(args.reps), desc=f"{mode} threads={threads}", leave=False):
                ts += measure(fs, 1)
                tp += measure(fp, 1)
            row = {"threads": threads, "mode": mode, "stock_median_s": statistics.median(ts),
                   "pid_median_s": statistics.median(tp)}
            row["ratio"] = row["pid_median_s"] / row["stock_median_s"]
            results["runs"].append(row)

    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\n{args.model} vs {base}, batch {args.batch}, {args.img_size} px, torch {torch.__version__}\n")
    print("| threads | mode | stock median (s) | PID median (s) | PID/stock |")
    print("|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['threads']} | {r['mode']} | {r['stock_median_s']:.4f} | {r['pid_median_s']:.4f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
