"""PID/stock overhead of every zoo, side by side: `make bench`.

    python bench/run_all.py --out bench_out                  # everything, 1 and 2 threads (about 25 min)
    python bench/run_all.py --quick --only timm,core         # a fast look at some sections

For each workload the PID model and the stock softmax model with the same weights run in ONE process,
alternately, after warm-up; the figure is the ratio of the medians (PID/stock; see bench/_harness.py for
the method and for how peak memory is measured on the CPU). Sections (``--only``):

    timm      deit_tiny_patch16_224 vs pid_deit_tiny_patch16_224, 224 px, batch 8: forward, forward+backward,
              forward+backward of the whole models under torch.compile (inductor)
    fan       fan_tiny_12_p16_224 vs pid_fan_tiny_12_p16_224, 224 px, batch 8: forward, forward+backward,
              forward+backward under torch.compile
    mmseg     Segmenter ViT-T (configs/mmseg, 12 layers), 128x128 crop, batch 2: train step (loss+backward)
    hf        small Llama (grouped-query: 8 query / 2 key-value heads), sdpa vs "pid": train step, prefill,
              decode tokens/s with a KV cache (generate), and static-cache decoding eager and with the
              decoding step compiled (torch.compile fullgraph, inductor; prefill eager), both models alike
    fairseq   transformer_lm vs transformer_lm_pid (same weights): train step, incremental decoding tokens/s
    size      the cost by model size: deit_small and deit_base b8 forward+backward (eager and torch.compile), and
              a 12-layer hidden-768 Llama (12 query / 4 key-value heads) train step (first thread count only;
              fewer repetitions for the big models)
    memory    peak memory of forward+backward, PID/stock (timm, FAN, mmseg, HF, fairseq)
    core      core PIDSelfAttention stack (pid vs pid=None): forward+backward at sequence lengths 64..4096
    compile   a small transformer of core PIDSelfAttention + MLP blocks, eager and torch.compile (inductor)
    ops       aten ops each method adds per decoder layer in one decoding step (kernel-launching and views apart;
              bench/op_counts.py): a table after the timings
    host      every method at tiny widths on one thread, where a step is host time as on a GPU in eager mode
              (bench/host_cost.py): tiny Llama decode tokens/s and the microseconds added per layer per decode step,
              tiny DeiT train step time; then the same with both models compiled (inductor: static-cache decoding
              with transformers' compile of the decoding step, torch.compile(model) training); a table after the
              timings
    floor     the eager floor (bench/eager_reference.py): PID and NeuTRENO decoding and PID's training step written
              by hand against the plugin, both over stock, at the host shapes; medians of three runs
    vllm      vLLM serving stock and method checkpoints of the same weights (a tiny Llama, SmolLM2-135M's shape):
              output tokens/s under vLLM's defaults (torch.compile), all in one process, interleaved, through
              .venv-vllm's python (bench/vllm_serving.py; ``--vllm-python``); not run without that environment

Allocator (``--malloc``). On the CPU every large tensor comes from glibc's malloc. With its default dynamic
thresholds, large buffers are often returned to the OS and re-faulted on the next step, and which ones depends
on what else is alive: PID keeps three state tensors per layer alive, which shifts that pattern and can cost
more than PID's own arithmetic (seen here: deit_tiny forward +10% with the default allocator, +2% tuned).
``--malloc tuned`` (the default) re-runs this script with ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``
and ``MALLOC_TOP_PAD_`` set so that freed memory is reused (what jemalloc/tcmalloc, which PyTorch's CPU tuning
guide recommends, do too); both models get faster and the ratio measures PID's compute. ``--malloc default``
keeps glibc's defaults: the figure a user gets without tuning.

Writes OUT/bench.json and OUT/bench.md (a markdown table: workload, threads, stock median, PID median, ratio,
target, met?) with the machine described.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

# the profiler (peak-memory section) logs every start/stop to the console unless told otherwise
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import interleaved, machine, peak_memory_bytes  # noqa: E402
import host_cost  # noqa: E402
from _models import HF_BASE_CFG, HF_CFG, HF_SIBLINGS, SMOLLM2_CFG, hf_pair  # noqa: E402,F401

SECTIONS = ("timm", "fan", "mmseg", "hf", "fairseq", "size", "memory", "core", "compile", "ops", "host", "floor",
            "vllm")
#: vLLM's own environment (make test-vllm builds it): the vllm rows run there, as a subprocess
VLLM_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-vllm", "bin", "python")
MALLOC_TUNED = {  # glibc: keep freed memory for reuse instead of unmapping and re-faulting it every step
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 33),
    "MALLOC_TOP_PAD_": str(1 << 27),
}
TARGETS = {  # kind -> (comparison, bound): the targets on PID/stock ratios
    "time": ("<=", 1.03),      # forward+backward / train step time
    "tokens/s": (">=", 0.97),  # decode throughput
    "memory": ("<=", 1.10),    # peak memory
    "compiled": ("<=", 1.02),  # compiled forward+backward time
}

# A workload: (section, name, kind, build) where build() returns (stock_fn, pid_fn, info) and kind picks
# the target (None: reported without a target, e.g. forward-only time or prefill).
Task = Tuple[str, str, Optional[str], int, Callable[[], Tuple[Callable[[], Any], Callable[[], Any], Dict[str, Any]]]]


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    for name in ("mmengine", "fairseq", "transformers", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------------------- models
def timm_pair(name: str, base: str) -> Tuple[torch.nn.Module, torch.nn.Module]:
    import timm

    import pid_plugins.timm  # noqa: F401

    torch.manual_seed(0)
    stock = timm.create_model(base)
    pid = timm.create_model(name)
    pid.load_state_dict(stock.state_dict())
    return stock, pid


def vision_runs(stock, pid, x) -> Dict[str, Tuple[Callable, Callable]]:
    def fwd(m):
        def run():
            m.eval()
            with torch.no_grad():
                m(x)
        return run

    def fwd_bwd(m):
        def run():
            m.train()
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        return run

    return {"forward": (fwd(stock), fwd(pid)), "forward+backward": (fwd_bwd(stock), fwd_bwd(pid))}


def mmseg_pair(crop: int, batch: int):
    import pid_plugins.mmseg  # noqa: F401
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "mmseg")
    cfg = Config.fromfile(os.path.join(root, "segmenter_pid-deit-t_mask_8xb1-160k_ade20k-512x512.py"))
    init_default_scope("mmseg")
    cfg.model.data_preprocessor.size = (crop, crop)
    cfg.model.backbone.img_size = (crop, crop)
    cfg.model.backbone.drop_path_rate = 0.0  # stochastic depth would make the two sides differ per step
    torch.manual_seed(0)
    pid = MODELS.build(cfg.model)
    cfg.model.backbone.attention = "softmax"
    stock = MODELS.build(cfg.model)
    pid.load_state_dict(stock.state_dict())  # the stock weights in the method model (it keeps its own record)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, 3, crop, crop, generator=g)
    samples = []
    for _ in range(batch):
        s = SegDataSample(metainfo=dict(img_shape=(crop, crop), pad_shape=(crop, crop), ori_shape=(crop, crop)))
        s.gt_sem_seg = PixelData(data=torch.randint(0, 150, (1, crop, crop), generator=g))
        samples.append(s)

    def step(m):
        def run():
            m.train()
            m.zero_grad(set_to_none=True)
            losses = m(inputs, samples, mode="loss")
            sum(v for k, v in losses.items() if "loss" in k).backward()
        return run

    return step(stock), step(pid)


def hf_runs(batch: int, seq: int, new_tokens: int, cfg: Optional[Dict[str, Any]] = None, method: str = "pid",
            params: Any = None) -> Dict[str, Tuple[Callable, Callable]]:
    stock, pid = hf_pair(cfg, method, params)
    ids = torch.randint(0, (cfg or HF_CFG)["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
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
            m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return run

    def static_decode(m, compiled):
        from transformers import StaticCache

        m.eval()
        cache = StaticCache(config=m.config, max_cache_len=prompt.shape[1] + new_tokens)
        step = torch.compile(m, fullgraph=True) if compiled else m

        def run():
            cache.reset()
            with torch.no_grad():  # eager prefill, then one decoding step per token (compiled or not)
                tok = m(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                for _ in range(new_tokens - 1):
                    tok = step(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return run

    return {"train step": (train_step(stock), train_step(pid)), "prefill": (prefill(stock), prefill(pid)),
            "decode": (decode(stock), decode(pid)),
            "static decode": (lambda: static_decode(stock, False), lambda: static_decode(pid, False)),
            "compiled decode": (lambda: static_decode(stock, True), lambda: static_decode(pid, True))}


FAIRSEQ_ARGS = ["--decoder-layers", "6", "--decoder-embed-dim", "256", "--decoder-ffn-embed-dim", "1024",
                "--decoder-attention-heads", "8", "--tokens-per-sample", "256", "--dropout", "0"]


def fairseq_pair(tmpdir: str):
    import pid_plugins.fairseq as pf
    from fairseq import options, tasks
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(2000):
        d.add_symbol(f"w{i}")
    d.save(os.path.join(tmpdir, "dict.txt"))

    def build(arch: str):
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, [tmpdir, "--task", "language_modeling", "--arch", arch,
                                                    "--user-dir", pf.USER_DIR, *FAIRSEQ_ARGS])
        task = tasks.setup_task(args)
        torch.manual_seed(0)
        return task.build_model(args)

    stock, pid = build("transformer_lm"), build("transformer_lm_pid")
    pid.load_state_dict(stock.state_dict())
    return stock, pid, len(d)


def fairseq_runs(tmpdir: str, batch: int, seq: int, new_tokens: int) -> Dict[str, Tuple[Callable, Callable]]:
    import torch.nn.functional as F

    stock, pid, vocab = fairseq_pair(tmpdir)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(4, vocab, (batch, seq), generator=g)
    prompt = toks[:, :32]

    def train_step(m):
        def run():
            m.train()
            m.zero_grad(set_to_none=True)
            logits = m(toks)[0]
            F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), toks[:, 1:].reshape(-1)).backward()
        return run

    def decode(m):
        def run():
            m.eval()
            state: Dict[str, Any] = {}
            out = prompt
            with torch.no_grad():
                # prefill the cache token by token (fairseq's incremental path), then greedy decoding
                for t in range(1, prompt.size(1) + new_tokens):
                    logits = m(out[:, :t], incremental_state=state)[0][:, -1]
                    if t >= prompt.size(1):
                        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
        return run

    return {"train step": (train_step(stock), train_step(pid)), "incremental decoding": (decode(stock), decode(pid))}


class CoreBlock(torch.nn.Module):
    """Pre-norm transformer block around the core PIDSelfAttention (the compile section's model)."""

    def __init__(self, dim: int, heads: int, pid) -> None:
        super().__init__()
        from pid_plugins.core import PIDSelfAttention

        self.norm1 = torch.nn.LayerNorm(dim)
        self.attn = PIDSelfAttention(dim, heads, qkv_bias=True, pid=pid)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, state):
        y, state = self.attn(self.norm1(x), state)
        x = x + y
        return x + self.mlp(self.norm2(x)), state


class CoreStack(torch.nn.Module):
    def __init__(self, dim: int, heads: int, depth: int, pid, mlp: bool) -> None:
        super().__init__()
        from pid_plugins.core import PIDSelfAttention

        if mlp:
            self.layers = torch.nn.ModuleList(CoreBlock(dim, heads, pid) for _ in range(depth))
        else:
            self.layers = torch.nn.ModuleList(PIDSelfAttention(dim, heads, qkv_bias=True, pid=pid)
                                              for _ in range(depth))
        self.mlp = mlp

    def forward(self, x):
        state = None
        for layer in self.layers:
            y, state = layer(x, state)
            x = y if self.mlp else x + y
        return x


def core_pair(depth: int, mlp: bool, dim: int = 192, heads: int = 3):
    from pid_plugins.core import PIDConfig

    torch.manual_seed(0)
    stock = CoreStack(dim, heads, depth, None, mlp)
    pid = CoreStack(dim, heads, depth, PIDConfig.preset("deit"), mlp)
    pid.load_state_dict(stock.state_dict())
    return stock, pid


def fwd_bwd_fn(m, x):
    def run():
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    return run


# ---------------------------------------------------------------------------------------------- tasks
def build_tasks(args) -> List[Task]:
    q = args.quick
    reps = lambda full, quick: quick if q else full  # noqa: E731
    tasks: List[Task] = []
    cache: Dict[str, Any] = {}

    def cached(key: str, make: Callable[[], Any]) -> Any:
        if key not in cache:
            cache[key] = make()
        return cache[key]

    for threads in args.threads:
        # Thread counts after the first: the targeted workloads of each zoo (forward+backward / train step /
        # decode); forward-only, prefill, the scaling sweep and torch.compile run at the first thread count
        # only (time budget), unless --all-threads.
        secondary = threads != args.threads[0] and not args.all_threads

        def add(section, name, kind, build, threads=threads, secondary=secondary):
            if secondary and (kind not in ("time", "tokens/s") or section in ("core", "compile", "size")):
                return
            tasks.append((section, name, kind, threads, build))

        def vision(section, name, base, mode, kind, n, b=8, compiled=False, warmup=2):
            key = f"{section} {name}"

            def build(n=n):
                stock, pid = cached(key, lambda: timm_pair(name, base))
                if compiled:  # the whole model, PID and stock each under torch.compile (inductor)
                    stock, pid = cached(key + "_compiled", lambda: (torch.compile(stock), torch.compile(pid)))
                x = cached(f"x224_b{b}", lambda: torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(0)))
                fs, fp = vision_runs(stock, pid, x)[mode]
                info = dict(reps=n, warmup=warmup, batch=b, img_size=224, model=name, base=base)
                return fs, fp, dict(info, compile="inductor") if compiled else info
            label = f"{mode}, torch.compile" if compiled else mode
            prefix = section if section != "size" else "timm"
            add(section, f"{prefix} {name.replace('pid_', '')} b{b} {label}", kind, build)

        if "timm" in args.only:
            vision("timm", "pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", "forward", None, reps(5, 2))
            vision("timm", "pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", "forward+backward", "time",
                   reps(15, 3))
            vision("timm", "pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", "forward+backward", "compiled",
                   reps(15, 3), compiled=True)
        if "fan" in args.only:
            vision("fan", "pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", "forward", None, reps(3, 2))
            vision("fan", "pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", "forward+backward", "time", reps(7, 3))
            vision("fan", "pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", "forward+backward", "compiled",
                   reps(7, 3), compiled=True)
        if "mmseg" in args.only:
            def build_mmseg(n=reps(13, 3)):
                fs, fp = cached("mmseg", lambda: mmseg_pair(crop=128, batch=2))
                return fs, fp, dict(reps=n, crop=128, batch=2, layers=12)
            add("mmseg", "mmseg Segmenter ViT-T 128x128 b2 train step", "time", build_mmseg)
        if "hf" in args.only:
            for what, kind, n in (("train step", "time", reps(9, 3)), ("prefill", None, reps(5, 3)),
                                  ("decode", "tokens/s", reps(11, 3))):
                def build_hf(what=what, n=n):
                    runs = cached("hf", lambda: hf_runs(batch=4, seq=256, new_tokens=32))
                    fs, fp = runs[what]
                    info = dict(reps=n, batch=4, seq=256, config=HF_CFG)
                    if what == "decode":
                        info.update(prompt=64, new_tokens=32, tokens=4 * 32)
                    return fs, fp, info
                label = {"train step": "train step b4x256", "prefill": "prefill b4x256",
                         "decode": "decode b4, 64+32 tokens"}[what]
                add("hf", f"hf Llama-GQA {label}", kind, build_hf)

            for what in ("static decode", "compiled decode"):  # PID vs stock, both on a static cache
                def build_hf_static(what=what, n=reps(11, 3)):
                    make_stock, make_pid = cached("hf", lambda: hf_runs(batch=4, seq=256, new_tokens=32))[what]
                    fs, fp = cached("hf " + what, lambda: (make_stock(), make_pid()))
                    return fs, fp, dict(reps=n, batch=4, prompt=64, new_tokens=32, tokens=4 * 32, config=HF_CFG,
                                        cache="static", compile="inductor, fullgraph" if "compiled" in what else None)
                label = "torch.compile(fullgraph)" if what == "compiled decode" else "eager"
                add("hf", f"hf Llama-GQA decode b4, 64+32 tokens, static cache, {label}", "tokens/s",
                    build_hf_static)

            def build_hf_b1(n=reps(7, 3)):  # compiled decoding at batch 1 (kernel launches dominate)
                make_stock, make_pid = cached("hf_b1", lambda: hf_runs(batch=1, seq=64, new_tokens=32))["compiled decode"]
                fs, fp = cached("hf_b1 compiled", lambda: (make_stock(), make_pid()))
                return fs, fp, dict(reps=n, batch=1, prompt=64, new_tokens=32, tokens=32, config=HF_CFG,
                                    cache="static", compile="inductor, fullgraph")
            add("hf", "hf Llama-GQA decode b1, 64+32 tokens, static cache, torch.compile(fullgraph)", "tokens/s",
                build_hf_b1)

            def build_hf_smol(n=reps(5, 2)):
                fs, fp = cached("hf_smol", lambda: hf_runs(batch=1, seq=64, new_tokens=32, cfg=SMOLLM2_CFG))["decode"]
                return fs, fp, dict(reps=n, batch=1, prompt=64, new_tokens=32, tokens=32, config=SMOLLM2_CFG)
            add("hf", "hf SmolLM2-135M shape decode b1, 64+32 tokens", "tokens/s", build_hf_smol)

            # every other method at the same shape, decoding with the dynamic cache (method/stock)
            for method, params in HF_SIBLINGS:
                def build_hf_sibling(method=method, params=params, n=reps(5, 2)):
                    fs, fp = cached(f"hf_smol_{method}", lambda: hf_runs(batch=1, seq=64, new_tokens=32,
                                                                         cfg=SMOLLM2_CFG, method=method,
                                                                         params=params))["decode"]
                    return fs, fp, dict(reps=n, batch=1, prompt=64, new_tokens=32, tokens=32, config=SMOLLM2_CFG,
                                        method=method, params=params)
                add("hf", f"hf SmolLM2-135M shape decode b1, 64+32 tokens, {method}", "tokens/s", build_hf_sibling)
        if "fairseq" in args.only:
            for what, kind, n in (("train step", "time", reps(7, 3)), ("incremental decoding", "tokens/s", reps(5, 3))):
                def build_fs(what=what, n=n):
                    runs = cached("fairseq", lambda: fairseq_runs(args.tmp, batch=4, seq=256, new_tokens=32))
                    fs, fp = runs[what]
                    info = dict(reps=n, batch=4, seq=256, layers=6, dim=256, heads=8)
                    if what == "incremental decoding":
                        info.update(prompt=32, new_tokens=32, tokens=4 * (32 + 31))
                    return fs, fp, info
                label = "train step b4x256" if what == "train step" else "incremental decoding b4, 32+32 tokens"
                add("fairseq", f"fairseq transformer_lm {label}", kind, build_fs)
        if "size" in args.only:
            # the cost by width: deit_tiny (192, section timm), deit_small (384), deit_base (768); each step of
            # deit_base takes seconds on a CPU, so few repetitions and one warm-up pair
            for name, n, warm in (("deit_small_patch16_224", reps(3, 2), 1), ("deit_base_patch16_224", reps(2, 1), 1)):
                for compiled in (False, True):
                    vision("size", f"pid_{name}", name, "forward+backward", "compiled" if compiled else "time", n,
                           compiled=compiled, warmup=warm)

            def build_hf_base(n=reps(3, 1)):
                fs, fp = cached("hf_base", lambda: hf_runs(batch=2, seq=128, new_tokens=1, cfg=HF_BASE_CFG))["train step"]
                return fs, fp, dict(reps=n, warmup=1, batch=2, seq=128, config=HF_BASE_CFG)
            add("size", "hf Llama 12 layers hidden 768 (GQA 12/4) train step b2x128", "time", build_hf_base)
        if "core" in args.only:
            for n_tok, n in ((64, reps(9, 3)), (256, reps(7, 3)), (1024, reps(5, 3)), (4096, reps(3, 2))):
                def build_core(n_tok=n_tok, n=n):
                    stock, pid = cached("core", lambda: core_pair(depth=2, mlp=False))
                    b = max(1, 4096 // n_tok)  # 4096 tokens per batch at every length
                    x = torch.randn(b, n_tok, 192, generator=torch.Generator().manual_seed(0))
                    return fwd_bwd_fn(stock, x), fwd_bwd_fn(pid, x), dict(reps=n, batch=b, seq=n_tok, depth=2, dim=192,
                                                                         heads=3, min_time=0.05)
                add("core", f"core attention stack fwd+bwd N={n_tok}", None, build_core)
        if "compile" in args.only:
            for compiled in (False, True):
                def build_compile(compiled=compiled, n=reps(11, 3)):
                    stock, pid = cached("compile", lambda: core_pair(depth=6, mlp=True))
                    x = torch.randn(8, 197, 192, generator=torch.Generator().manual_seed(0))
                    if compiled:
                        cs, cp = cached("compiled", lambda: (torch.compile(stock), torch.compile(pid)))
                        return fwd_bwd_fn(cs, x), fwd_bwd_fn(cp, x), dict(reps=n, batch=8, seq=197, depth=6,
                                                                         compile="inductor")
                    return fwd_bwd_fn(stock, x), fwd_bwd_fn(pid, x), dict(reps=n, batch=8, seq=197, depth=6)
                kind = "compiled" if compiled else "time"
                label = "torch.compile" if compiled else "eager"
                add("compile", f"core transformer (attn+MLP) b8x197 fwd+bwd, {label}", kind, build_compile)
    return tasks


def memory_tasks(args) -> List[Tuple[str, Callable[[], Tuple[Callable, Callable]]]]:
    """(name, build) for the peak-memory section; each build returns forward+backward (or train step) fns."""
    out = []
    if "timm" in args.only or "memory" in args.only:
        def deit():
            s, p = timm_pair("pid_deit_tiny_patch16_224", "deit_tiny_patch16_224")
            x = torch.randn(8, 3, 224, 224)
            return vision_runs(s, p, x)["forward+backward"]
        out.append(("deit_tiny b8 forward+backward", deit))
    if "fan" in args.only or "memory" in args.only:
        def fan():
            s, p = timm_pair("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224")
            x = torch.randn(8, 3, 224, 224)
            return vision_runs(s, p, x)["forward+backward"]
        out.append(("fan_tiny b8 forward+backward", fan))
    if "mmseg" in args.only or "memory" in args.only:
        out.append(("mmseg Segmenter ViT-T 128x128 b2 train step", lambda: mmseg_pair(crop=128, batch=2)))
    if "hf" in args.only or "memory" in args.only:
        out.append(("hf Llama-GQA train step b4x256", lambda: hf_runs(4, 256, 32)["train step"]))
    if "fairseq" in args.only or "memory" in args.only:
        out.append(("fairseq transformer_lm train step b4x256", lambda: fairseq_runs(args.tmp, 4, 256, 32)["train step"]))
    return out


def host_tasks(args) -> List[Tuple[str, str, Any, int, bool]]:
    """(shape, method, parameters, repetitions, compiled) of the host section: every method, both tiny shapes, one
    thread; eager, then both models compiled (bench/host_cost.py)."""
    rows = []
    for compiled in (False, True):
        for shape in ("decode", "train"):
            reps = {(False, "decode"): host_cost.DECODE_REPS, (False, "train"): host_cost.TRAIN_REPS,
                    (True, "decode"): host_cost.COMPILED_DECODE_REPS,
                    (True, "train"): host_cost.COMPILED_TRAIN_REPS}[compiled, shape]
            for method, params in host_cost.DECODE_METHODS:
                rows.append((shape, method, params if shape == "decode" else None, 3 if args.quick else reps,
                             compiled))
    return rows


def vllm_rows(args) -> List[Dict[str, Any]]:
    """The vllm section: bench/vllm_serving.py run by vLLM's python (a subprocess), or rows saying why not."""
    threads = max(args.threads)
    if not os.path.exists(args.vllm_python):
        why = "not run (make test-vllm builds .venv-vllm)"
        return [{"section": "vllm", "workload": f"vLLM {shape}, {method}, torch.compile", "threads": threads,
                 "not_run": why, "target": target if shape != "tiny Llama" else "", "met": None}
                for shape in ("tiny Llama", "SmolLM2-135M shape")
                for method, target in (("pid", ">= 0.95"), ("neutreno", ">= 0.95"), ("value_residual", ">= 0.95"),
                                       ("twicing", ">= 0.80"), ("elliptical", ">= 0.80"))]
    out = os.path.join(args.tmp, "vllm_rows.json")
    command = [args.vllm_python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_serving.py"),
               "--out", out, "--threads", str(threads)] + (["--quick"] if args.quick else [])
    t_start = time.time()
    # the project's root first on the path: vLLM loads this checkout's pid_plugins
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench/vllm_serving.py failed ({args.vllm_python}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-4000:]}")
    with open(out) as f:
        rows = json.load(f)
    for row in rows:
        print(f"{row['workload']} [{threads} thr]: method/stock {row['ratio']:.3f} {row['target']} "
              f"({time.time() - t_start:.0f} s for the section)")
    return rows


# ---------------------------------------------------------------------------------------------- report
def verdict(kind: Optional[str], ratio: float) -> Tuple[str, Optional[bool]]:
    if kind is None:
        return "", None
    op, bound = TARGETS[kind]
    ok = ratio <= bound if op == "<=" else ratio >= bound
    return f"{op} {bound:.2f}", ok


def write_markdown(path: str, result: Dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs, "
        f"load average at start {m.get('load_average_at_start')}, Python {m['python']}, torch {m['torch']}, "
        f"timm {m.get('timm')}, transformers {m.get('transformers')}, mmseg {m.get('mmseg')}, "
        f"fairseq {m.get('fairseq')}. Run: {result['started']}, {result['elapsed_s']:.0f} s"
        f"{' (--quick)' if result['quick'] else ''}; glibc malloc: {result['malloc']}.",
        "",
        "| workload | threads | stock median | PID median | PID/stock | target | met? | of medians | of minima |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cross_check(r: Dict[str, Any], key: str) -> str:
        value = r.get(key)
        if value is None:
            return ""
        return f"{1.0 / value if r.get('unit') == 'tokens/s' else value:.3f}"  # throughput ratio for decoding

    for r in result["rows"]:
        if r.get("not_run"):
            lines.append(f"| {r['workload']} | {r.get('threads', '')} | {r['not_run']} | | | {r['target']} | | | |")
            continue
        unit = r.get("unit", "s")
        if unit == "tokens/s":
            s, p = f"{r['stock_tokens_per_s']:.0f} tok/s", f"{r['pid_tokens_per_s']:.0f} tok/s"
        elif unit == "MB":
            s, p = f"{r['stock_mb']:.1f} MB", f"{r['pid_mb']:.1f} MB"
        else:
            s, p = f"{r['stock_s'] * 1e3:.1f} ms", f"{r['pid_s'] * 1e3:.1f} ms"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        threads = r.get("threads", "")
        lines.append(f"| {r['workload']} | {threads} | {s} | {p} | {r['ratio']:.3f} | {r['target']} | {met} | "
                     f"{cross_check(r, 'ratio_of_medians')} | {cross_check(r, 'ratio_of_minima')} |")
    core = [r for r in result["rows"] if r["section"] == "core"]
    if len(core) >= 2:
        sweep = ", ".join(f"N={r['seq']}: {r['ratio']:.3f}" for r in core)
        falls = core[-1]["ratio"] < core[0]["ratio"]
        lines += ["", f"Scaling of the core attention stack (PID/stock, fwd+bwd, 4096 tokens per batch): {sweep}; "
                      f"the overhead {'falls' if falls else '**does not fall**'} as attention's quadratic cost grows."]
    lines += ["", "Times are medians of interleaved repetitions in one process; the ratio is the median over "
              "repetitions of PID/stock within a repetition (for decoding: PID/stock tokens/s); the last two columns, the "
              "ratio of the medians and of the fastest repetitions, are cross-checks. Peak memory: torch.profiler allocation events, "
              "running sum, maximum over one forward+backward (see bench/_harness.py)."]
    if any(r["section"] == "vllm" for r in result["rows"]):
        lines += ["", "vLLM rows (bench/vllm_serving.py, vLLM's environment): the stock and the method checkpoints "
                      "(same weights) served in one process, their generate calls interleaved round by round, under "
                      "vLLM's defaults (torch.compile); output tokens/s of a batch of greedy requests; the ratio is the "
                      "median over rounds of method/stock."]
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out", help="output directory (bench.json, bench.md)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    p.add_argument("--all-threads", action="store_true",
                   help="run every workload at every thread count (default: after the first thread count, only "
                        "the targeted ones: forward+backward, train steps, decoding)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--vllm-python", default=VLLM_PYTHON,
                   help="the python of vLLM's environment, for the vllm section (default: .venv-vllm's)")
    p.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                   help="glibc allocator settings for both models (see the module doc); default: tuned")
    args = p.parse_args()
    if args.malloc == "tuned" and any(os.environ.get(k) != v for k, v in MALLOC_TUNED.items()):
        # glibc reads its tunables at start-up: run this script again with them set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_TUNED})
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = args.only - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    os.makedirs(args.out, exist_ok=True)
    import tempfile

    from tqdm import tqdm

    _quiet()
    t_start = time.time()
    result: Dict[str, Any] = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "quick": args.quick, "threads": args.threads, "malloc": args.malloc,
                              "malloc_env": {k: os.environ.get(k) for k in MALLOC_TUNED}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        tasks = build_tasks(args)
        mem = memory_tasks(args) if "memory" in args.only else []
        host = host_tasks(args) if "host" in args.only else []
        total = sum(t[4].__defaults__[-1] for t in tasks) + len(mem) + sum(h[3] for h in host)
        bar = tqdm(total=total, desc="bench", unit="rep", dynamic_ncols=True)
        for section, name, kind, threads, build in tasks:
            bar.set_postfix_str(f"{name[:50]} [{threads} thr]")
            torch.set_num_threads(threads)
            t_row = time.time()  # building (and compiling) included: what the row costs `make bench`
            fs, fp, info = build()
            n = info.pop("reps")
            min_time = info.pop("min_time", 0.0)
            warmup = info.pop("warmup", 2)
            r = interleaved(fs, fp, reps=n, warmup=warmup, progress=bar.update, min_time=min_time)
            row: Dict[str, Any] = {"section": section, "workload": name, "threads": threads, **r, **info,
                                   "row_s": time.time() - t_row}
            ratio = r["ratio"]
            if kind == "tokens/s":
                tokens = info["tokens"]
                row.update(unit="tokens/s", stock_tokens_per_s=tokens / r["stock_s"],
                           pid_tokens_per_s=tokens / r["pid_s"])
                ratio = 1.0 / r["ratio"]  # throughput ratio PID/stock
            row["ratio"] = ratio
            row["target"], row["met"] = verdict(kind, ratio)
            result["rows"].append(row)
            tqdm.write(f"{name} [{threads} thr]: PID/stock {ratio:.3f} {row['target']} ({row['row_s']:.0f} s)")
        torch.set_num_threads(max(args.threads))
        for name, build in mem:
            bar.set_postfix_str("peak memory " + name[:40])
            fs, fp = build()
            fs(), fp()  # warm-up (lazy initialisation is not part of the peak)
            # the first profiled step still differs (gradients of the warm-up step freed inside it): measure 4
            # alternating times per side and take the median of the last 3
            peaks: Dict[str, List[int]] = {"stock": [], "pid": []}
            for _ in range(4):
                peaks["stock"].append(peak_memory_bytes(fs))
                peaks["pid"].append(peak_memory_bytes(fp))
            ms, mp = (sorted(peaks[k][1:])[1] for k in ("stock", "pid"))
            row = {"section": "memory", "workload": f"peak memory: {name}", "unit": "MB", "stock_mb": ms / 1e6,
                   "pid_mb": mp / 1e6, "ratio": mp / ms}
            row["target"], row["met"] = verdict("memory", row["ratio"])
            result["rows"].append(row)
            tqdm.write(f"peak memory {name}: PID/stock {row['ratio']:.3f}")
            bar.update()
        for shape, method, params, n, compiled in host:
            label = f"{'compiled ' if compiled else ''}{shape}"
            bar.set_postfix_str(f"host {label} {method} [1 thr]")
            t_row = time.time()  # compiling included
            row = host_cost.measure(shape, method, params, reps=n, progress=bar.update, compiled=compiled)
            unit = "tokens/s" if shape == "decode" else "time"
            row.update(section="host", workload=f"host: tiny {label}, {method}", kind=unit,
                       target=f"{'>=' if shape == 'decode' else '<='} {row['bound']:.2f}",
                       met=row["ratio"] >= row["bound"] if shape == "decode" else row["ratio"] <= row["bound"],
                       row_s=time.time() - t_row)
            result["rows"].append(row)
            result.setdefault("host", []).append(row)
            tqdm.write(f"host {label} {method}: method/stock {row['ratio']:.3f} {row['target']} "
                       f"({row['row_s']:.0f} s)")
        bar.close()
    if "floor" in args.only:
        import eager_reference

        tqdm.write("the eager floor: decoding (PID, NeuTRENO) and training (PID), three runs each")
        result["floor"] = eager_reference.floor_rows(1 if args.quick else 3, 2 if args.quick else eager_reference.REPS,
                                                     4 if args.quick else 120)
        tqdm.write(eager_reference.markdown(result["floor"]))
    if "vllm" in args.only:
        result["rows"] += vllm_rows(args)
    if "ops" in args.only:
        from op_counts import markdown as ops_markdown, op_rows

        result["op_counts"] = op_rows()
    result["elapsed_s"] = time.time() - t_start
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    text = write_markdown(os.path.join(args.out, "bench.md"), result)
    if "op_counts" in result:
        text += "\n" + ops_markdown(result["op_counts"])
    if "host" in result:
        text += "\n" + host_cost.markdown(result["host"])
    if "floor" in result:
        import eager_reference

        text += "\n" + eager_reference.markdown(result["floor"])
    if "op_counts" in result or "host" in result or "floor" in result:
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
