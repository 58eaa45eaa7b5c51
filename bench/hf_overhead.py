"""PID/stock ratios for a small Llama (grouped-query) in transformers: train step, prefill, decode tokens/s.

    python bench/hf_overhead.py --threads 1 2

Stock = attn_implementation="sdpa", PID = "pid" (preset `lm`), identical weights, one process, interleaved
repetitions after warm-up, medians. Writes JSON (--out) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="bench/hf_overhead.json")
    args = p.parse_args()

    cfg = dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    stock = LlamaForCausalLM(LlamaConfig(**cfg))
    stock.set_attn_implementation("sdpa")
    pid = LlamaForCausalLM(LlamaConfig(**cfg))
    pid.load_state_dict(stock.state_dict())
    pid_plugins.hf.to_pid(pid)
    ids = torch.randint(0, 8000, (args.batch, args.seq))
    prompt = ids[:, :64]

    def train_step(m):
        def run():
            m.train()
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
        return run

    def prefill(m):
        def run():
            m.eval()
            with torch.no_grad():
                m(ids)
        return run

    def decode(m):
        def run():
            m.eval()
            m.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                       pad_token_id=0)
        return run

    results = {"config": cfg, "batch": args.batch, "seq": args.seq, "new_tokens": args.new_tokens, "runs": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, make in (("train step", train_step), ("prefill", prefill), ("decode", decode)):
            fs, fp = make(stock), make(pid)
            fs(), fp()
            ts, tp = [], []
            for _ in tqdm(range(args.reps), desc=f"{name} threads={threads}", leave=False):
                ts.append(timed(fs))
                tp.append(timed(fp))
            row = {"threads": threads, "what": name, "stock_s": statistics.median(ts), "pid_s": statistics.median(tp)}
            if name == "decode":
                n = args.batch * args.new_tokens
                row["stock_tokens_per_s"], row["pid_tokens_per_s"] = n / row["stock_s"], n / row["pid_s"]
            row["pid_over_stock_time"] = row["pid_s"] / row["stock_s"]
            results["runs"].append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print("| threads | what | stock median (s) | PID median (s) | PID/stock time | tokens/s stock -> PID |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        tps = f"{r['stock_tokens_per_s']:.0f} -> {r['pid_tokens_per_s']:.0f}" if "pid_tokens_per_s" in r else ""
        print(f"| {r['threads']} | {r['what']} | {r['stock_s']:.4f} | {r['pid_s']:.4f} | {r['pid_over_stock_time']:.3f} | {tps} |")


if __name__ == "__main__":
    main()
