"""vLLM rows of ``make bench``: method/stock output tokens/s of vLLM serving the same weights (vLLM's environment).

    .venv-vllm/bin/python bench/vllm_serving.py --out rows.json [--quick] [--threads 2] [--methods pid,twicing]

bench/run_all.py runs it as a subprocess with .venv-vllm's python (vLLM pins its own torch and transformers). For
each shape (a tiny Llama and SmolLM2-135M's shape, random weights saved with transformers) it saves one stock
checkpoint and, per method, a folder with the same weights (a link) whose config.json names the method (its
transformers preset). One process per shape serves them all (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one ``LLM`` per
checkpoint, engine core in-process, vLLM's defaults: its torch.compile, no ``enforce_eager``) and times their
``generate`` calls interleaved, round after round (stock and every method once per round, the order reversed every
other round), so that the machine's drift falls on all of them alike. A call is a batch of prompts, greedy, a fixed
number of new tokens each; its figure is output tokens per second. A row's ratio is the median over rounds of
method/stock within the round; its tokens/s are the medians over rounds. Writes the rows as JSON (bench/run_all.py's
row keys).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

#: the shapes (transformers LlamaConfig fields); SmolLM2-135M's as in bench/run_all.py
SHAPES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024),
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True),
}
LABELS = {"tiny": "Llama 6 layers hidden 256 (GQA 8/2)", "SmolLM2-135M": "SmolLM2-135M shape"}
#: the target of the SmolLM2-shape rows (method/stock output tokens/s): 0.95, and 0.80 for the methods that attend twice
TARGET, TARGETS = 0.95, {"twicing": 0.80, "elliptical": 0.80}
#: the methods served with another preset than their transformers default (Elliptical's is not causal)
PRESETS = {"elliptical": "lm"}
#: untimed generate calls before the timed ones
WARMUP = 2


def prepare(root: Path, methods: List[str]) -> Dict[str, Dict[str, Path]]:
    """Per shape: the stock folder and one folder per method with the same weights (linked)."""
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    folders: Dict[str, Dict[str, Path]] = {}
    for shape, fields in SHAPES.items():
        stock = root / shape / "stock"
        if not (stock / "config.json").exists():
            torch.manual_seed(0)
            T.LlamaForCausalLM(T.LlamaConfig(**fields)).save_pretrained(stock)
        folders[shape] = {"stock": stock}
        for method in methods:
            folder = root / shape / method
            folder.mkdir(parents=True, exist_ok=True)
            config = json.loads((stock / "config.json").read_text())
            config["attn_implementation"] = method  # config.<method> absent: the method's transformers preset
            if method in PRESETS:
                config[method] = PRESETS[method]
            (folder / "config.json").write_text(json.dumps(config))
            for item in stock.iterdir():
                if item.name != "config.json" and not (folder / item.name).exists():
                    (folder / item.name).symlink_to(item.resolve())
            folders[shape][method] = folder
    return folders


def measure(models: List[str], out: str, prompts: int, prompt_len: int, new_tokens: int, rounds: int) -> None:
    """In this process: serve every folder (one ``LLM`` each) and write each one's output tokens/s per round."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engines = {model: LLM(model=model, skip_tokenizer_init=True, max_model_len=prompt_len + new_tokens, seed=0,
                          max_num_seqs=prompts) for model in models}
    vocab = next(iter(engines.values())).llm_engine.model_config.hf_config.vocab_size
    batch = [TokensPrompt(prompt_token_ids=[(7 + 31 * i + 17 * j) % vocab for j in range(prompt_len)])
             for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    rates: Dict[str, List[float]] = {model: [] for model in models}
    for round_ in range(WARMUP + rounds):  # (measured: the first timed call after one warm-up was 2-4x slower)
        for model in (models if round_ % 2 else models[::-1]):
            start = time.perf_counter()
            outputs = engines[model].generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert tokens == prompts * new_tokens, tokens
            if round_ >= WARMUP:
                rates[model].append(tokens / seconds)
    results = {}
    for model, llm in engines.items():
        config = llm.llm_engine.model_config
        results[model] = {"tokens_per_s": rates[model], "dtype": str(config.dtype),
                          "enforce_eager": config.enforce_eager}
    Path(out).write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the rows, as JSON")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: OUT's folder)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--methods", default="pid,neutreno,value_residual,twicing,elliptical",
                   help="comma-separated methods served beside stock")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (each: every checkpoint once)")
    p.add_argument("--quick", action="store_true", help="3 timed rounds: a smoke run")
    p.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)  # (internal: one process's folders)
    args = p.parse_args()
    prompts, prompt_len, new_tokens, rounds = 8, 64, 64, (3 if args.quick else args.rounds)
    if args.measure:
        measure(args.measure, args.out, prompts, prompt_len, new_tokens, rounds)
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    root = Path(args.dir or Path(args.out).resolve().parent / "vllm-checkpoints")
    folders = prepare(root, methods)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    measured: Dict[str, Any] = {}
    started = time.time()
    for shape in SHAPES:  # one process per shape, serving stock and every method interleaved
        models = [str(folders[shape][side]) for side in ["stock", *methods]]
        part = root / f"{shape}.json"
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", str(part), "--measure", *models],
                              env=env, capture_output=True, text=True, timeout=5400)
        if proc.returncode:
            raise SystemExit(f"vLLM serving {shape} failed:\n{proc.stderr[-4000:]}")
        measured.update(json.loads(part.read_text()))
    rows = []
    for shape in SHAPES:
        stock = measured[str(folders[shape]["stock"])]
        for method in methods:
            served = measured[str(folders[shape][method])]
            s, m = statistics.median(stock["tokens_per_s"]), statistics.median(served["tokens_per_s"])
            per_round = [b / a for a, b in zip(stock["tokens_per_s"], served["tokens_per_s"])]
            ratio = statistics.median(per_round)
            goal = TARGETS.get(method, TARGET)
            target = f">= {goal:.2f}" if shape == "SmolLM2-135M" else ""
            rows.append({
                "section": "vllm", "workload": f"vLLM {LABELS[shape]}, {prompts} prompts x {prompt_len}+{new_tokens} "
                                               f"tokens, {method}, torch.compile", "threads": args.threads,
                "unit": "tokens/s", "stock_tokens_per_s": s, "pid_tokens_per_s": m, "ratio": ratio,
                "target": target, "met": (ratio >= goal) if target else None, "method": method,
                "config": SHAPES[shape],
                "stock_runs": stock["tokens_per_s"], "method_runs": served["tokens_per_s"], "dtype": served["dtype"],
                "round_ratios": per_round, "rounds": len(per_round),
                "enforce_eager": [stock["enforce_eager"], served["enforce_eager"]], "row_s": time.time() - started})
    Path(args.out).write_text(json.dumps(rows, indent=2))
    for row in rows:
        print(f"{row['workload']}: {row['pid_tokens_per_s']:.0f} vs stock {row['stock_tokens_per_s']:.0f} tok/s, "
              f"method/stock {row['ratio']:.3f} (rounds {min(row['round_ratios']):.2f}-{max(row['round_ratios']):.2f}) "
              f"{row['target']}")


if __name__ == "__main__":
    main()
