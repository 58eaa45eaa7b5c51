"""The eager floor: PID and NeuTRENO written by hand as transformers attention functions, against the plugin.

    python bench/eager_reference.py                 # both methods, tiny Llama decode, interleaved medians
    python bench/eager_reference.py --reps 8        # a quicker look
    python bench/eager_reference.py --train         # PID's training step, tiny DeiT (timm)

Each reference is the few lines a user would write for one model: transformers' own ``sdpa_attention_forward``,
then the method's update with its gains as constants, the state in a per-forward container (a dict reset by layer
0), no checks and no refusals. Registered in ``AttentionInterface`` with sdpa's mask function, so transformers
builds the same mask as for ``"sdpa"``. Its logits equal the plugin's (tests/core/test_eager_reference.py), so the
plugin/reference ratio is what the plugin's glue costs: every check, lookup and object the hand-written lines do
without. Measured at the host-cost decode shape (bench/host_cost.py): tokens/s over stock ``"sdpa"`` of the
reference and of the plugin, in one process, interleaved (stock, reference, plugin), one thread, thread CPU time.

Training (``--train``): timm's stock DeiT whose attention is written by hand (timm's own forward, then PID's update
in five ops, the state in a dict) against the plugin's PID DeiT, at the host-bound training shape (a step: cross-entropy,
backward, SGD); step time over stock's, three runs of interleaved rounds, the run of the median gap.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: the methods with a hand-written reference: attn_implementation of the reference -> the plugin's method
METHODS = ("pid", "neutreno")
REPS = 16


def _gains() -> Dict[str, Any]:
    from pid_plugins.core import get_method

    pid = get_method("pid").configure(None, "hf")
    if not pid.control_first_layer:
        raise ValueError("the PID reference is written for control_first_layer=True (transformers' preset)")
    return {"pid": (pid.lambda_p, pid.lambda_i, pid.lambda_d, pid.beta),
            "neutreno": get_method("neutreno").configure(None, "hf").alpha}


_STATE: Dict[str, Any] = {}  # the per-forward container: layer 0 starts it afresh


def _views(query, value, out):
    """The query rows' values, ``(B, q, H_kv, 1, D)``, and the output viewed as ``(B, q, H_kv, r, D)``."""
    q_len = query.shape[2]
    v_q = value[:, :, -q_len:].transpose(1, 2).unsqueeze(3)
    return v_q, out.view(out.shape[0], q_len, value.shape[1], -1, value.shape[3])


def pid_by_hand(o, v, first: bool, state: dict, gains: tuple):
    """PID's update in the five ops a hand-written function makes (``state["pid"]``: the previous layer's)."""
    kp, ki, kd, beta = gains
    if first:
        b = v * beta
        e = b - v
        state["pid"] = (b, e, e)
        return torch.add(o, e, alpha=kp + ki)
    b, s, e_prev = state["pid"]
    e = b - v
    s = s + e
    u = torch.add(o, e, alpha=kp + kd)
    u.add_(s, alpha=ki)
    u.add_(e_prev, alpha=-kd)
    state["pid"] = (b, s, e)
    return u


def make_references() -> Dict[str, Callable]:
    """``{name: attention function}``: the hand-written PID and NeuTRENO (transformers' preset gains)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gains = _gains()
    alpha = gains["neutreno"]

    def ref_pid(module, query, key, value, mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
        v_q, o = _views(query, value, out)
        return pid_by_hand(o, v_q, module.layer_idx == 0, _STATE, gains["pid"]).view(out.shape), weights

    def ref_neutreno(module, query, key, value, mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
        v_q, o = _views(query, value, out)
        if module.layer_idx == 0:
            _STATE["neutreno"] = v_q
            return out, weights
        return torch.add(o, _STATE["neutreno"] - v_q, alpha=alpha).view(out.shape), weights

    return {"ref_pid": ref_pid, "ref_neutreno": ref_neutreno}


def register() -> None:
    """Register the references in transformers' ``AttentionInterface`` (with sdpa's mask function)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    for name, fn in make_references().items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)


def llama(attn: str, cfg: Optional[Dict[str, Any]] = None):
    """The host-cost decode shape's tiny Llama with ``attn`` (seed 0: the same weights for every ``attn``)."""
    from host_cost import DECODE_CFG
    from transformers import LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf  # noqa: F401

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**(cfg or DECODE_CFG), attn_implementation=attn)).eval()


def measure(method: str, reps: int = REPS, progress: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Tokens/s over stock ``"sdpa"`` of the hand-written ``method`` and of the plugin: interleaved (stock, reference,
    plugin; reversed every other round), medians, one thread, thread CPU time."""
    from host_cost import DECODE_CFG, NEW_TOKENS, PROMPT

    register()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = {"stock": llama("sdpa"), "reference": llama(f"ref_{method}"), "plugin": llama(method)}
        prompt = torch.randint(0, DECODE_CFG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))

        def decode(m) -> float:
            start = time.thread_time()
            with torch.no_grad():
                m.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)
            return time.thread_time() - start

        with torch.no_grad():
            err = (models["reference"](prompt).logits - models["plugin"](prompt).logits).abs().max().item()
        for m in models.values():
            decode(m)
            decode(m)
        times: Dict[str, List[float]] = {n: [] for n in models}
        for rep in range(reps):
            for name in (list(models) if rep % 2 == 0 else list(reversed(models))):
                times[name].append(decode(models[name]))
            if progress is not None:
                progress()
    finally:
        torch.set_num_threads(threads)
    med = {n: statistics.median(t) for n, t in times.items()}
    reference, plugin = med["stock"] / med["reference"], med["stock"] / med["plugin"]
    return dict(method=method, reference=reference, plugin=plugin, gap=reference - plugin, logits_max_diff=err,
                stock_s=med["stock"], reference_s=med["reference"], plugin_s=med["plugin"], reps=reps,
                config=DECODE_CFG, bound=0.02)


def markdown(rows: List[Dict[str, Any]]) -> str:
    """The eager-floor table: reference and plugin over stock, and the gap (goal: <= 0.02)."""
    lines = ["The eager floor (host-cost shapes, one thread): the method written by hand (logits equal to the "
             "plugin's) against the plugin, both over stock; decoding tokens/s (higher is faster), training step "
             "time (lower is faster); interleaved medians; the run of the median gap, every run's gap listed.",
             "", "| method | hand-written / stock | plugin / stock | gap (goal <= 0.02) | gaps of the runs |",
             "|---|---|---|---|---|"]
    for r in rows:
        ok = "" if r["gap"] <= r["bound"] else " **no**"
        gaps = ", ".join(f"{g:.3f}" for g in r.get("gaps", [r["gap"]]))
        lines.append(f"| {r['method']} | {r['reference']:.3f} | {r['plugin']:.3f} | {r['gap']:.3f}{ok} | {gaps} |")
    return "\n".join(lines) + "\n"


def floor_rows(runs: int = 3, reps: int = REPS, train_reps: int = 120,
               progress: Optional[Callable[[], None]] = None) -> List[Dict[str, Any]]:
    """``make bench``'s floor: decoding (PID, NeuTRENO) and PID's training step, each the run of the median gap of
    ``runs`` runs, the references measured in the same run."""
    rows = []
    for method in METHODS:
        measured = sorted((measure(method, reps, progress) for _ in range(runs)), key=lambda r: r["gap"])
        rows.append(dict(measured[len(measured) // 2], method=f"{method} (decoding)",
                         gaps=[r["gap"] for r in measured]))
    train = measure_train(train_reps, runs)
    rows.append(dict(train, gaps=sorted(p - q for q, p in train["runs"])))
    return rows


# ------------------------------------------------------------------------------------- training (timm DeiT)
#: the host-bound training shape: a tiny DeiT, batch 2
TRAIN_CFG = dict(img_size=32, patch_size=8, embed_dim=64, depth=6, num_heads=2, num_classes=10)


def _ref_attention(self, x, attn_mask=None, is_causal=False, *, layer: int, gains: tuple, state: dict):
    """timm's ``Attention.forward`` (its fused path, the modules it calls kept) with PID's update written in: timm's
    preset, the paper's first layer."""
    import torch.nn.functional as F

    b_, n, c = x.shape
    q, k, v = self.qkv(x).reshape(b_, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training
                                       else 0.0, is_causal=is_causal)
    u = pid_by_hand(o, v, layer == 0, state, gains)
    return self.proj_drop(self.proj(self.norm(u.transpose(1, 2).reshape(b_, n, c))))


def deit(kind: str, cfg: Optional[Dict[str, Any]] = None):
    """The training shape's tiny DeiT: ``"stock"``, ``"reference"`` (stock, its attention by hand) or ``"plugin"``
    (``pid_deit``), each with the stock weights of seed 0."""
    import timm

    import pid_plugins.timm  # noqa: F401
    from pid_plugins.core import get_method

    cfg = cfg or TRAIN_CFG
    torch.manual_seed(0)
    stock = timm.create_model("deit_tiny_patch16_224", **cfg)
    if kind == "stock":
        return stock
    if kind == "plugin":
        model = timm.create_model("pid_deit_tiny_patch16_224", **cfg)
        model.load_state_dict(stock.state_dict(), strict=False)
        return model
    pid = get_method("pid").configure(None, "timm")
    if not pid.control_first_layer:
        raise ValueError("the PID reference is written for control_first_layer=True (timm's preset)")
    gains, state = (pid.lambda_p, pid.lambda_i, pid.lambda_d, pid.beta), {}
    for i, block in enumerate(stock.blocks):
        block.attn.forward = types.MethodType(functools.partial(_ref_attention, layer=i, gains=gains, state=state),
                                              block.attn)
    return stock


def measure_train(reps: int = 120, runs: int = 3, cfg: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Training-step time over stock's of the hand-written PID DeiT and of the plugin's (lower is faster): ``runs``
    runs of ``reps`` interleaved rounds, one thread, thread CPU time; the run with the median gap."""
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = {k: deit(k, cfg) for k in ("stock", "reference", "plugin")}
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        y = torch.tensor([1, 7])
        with torch.no_grad():
            logits = {n: m.eval()(x) for n, m in models.items()}
        err = ((logits["reference"] - logits["plugin"]).abs().max() / logits["reference"].abs().max()).item()
        opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}

        def step(n: str) -> float:
            start = time.thread_time()
            opts[n].zero_grad(set_to_none=True)
            F.cross_entropy(models[n].train()(x), y).backward()
            opts[n].step()
            return time.thread_time() - start

        for n in models:
            for _ in range(3):
                step(n)
        measured = []
        for _ in range(runs):
            times: Dict[str, List[float]] = {n: [] for n in models}
            for rep in range(reps):
                for n in (list(models) if rep % 2 == 0 else list(reversed(models))):
                    times[n].append(step(n))
            med = {n: statistics.median(t) for n, t in times.items()}
            measured.append((med["reference"] / med["stock"], med["plugin"] / med["stock"]))
    finally:
        torch.set_num_threads(threads)
    reference, plugin = sorted(measured, key=lambda r: r[1] - r[0])[len(measured) // 2]
    return dict(method="pid (training)", reference=reference, plugin=plugin, gap=plugin - reference,
                logits_rel_diff=err, equals_stock=bool(torch.allclose(logits["plugin"], logits["stock"])),
                runs=measured, reps=reps, config=cfg or TRAIN_CFG, bound=0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--train", action="store_true", help="PID's training step (tiny DeiT) instead of decoding")
    args = p.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.train:
        r = measure_train()
        print(f"training step over stock's: hand-written {r['reference']:.3f}, plugin {r['plugin']:.3f}, gap "
              f"{r['gap']:.3f} (goal <= 0.02; logits differ by {r['logits_rel_diff']:.1e} relative; runs: "
              + ", ".join(f"{p:.3f}/{q:.3f}" for q, p in r["runs"]) + ")")
        return
    rows = []
    for method in args.methods.split(","):
        rows.append(measure(method, args.reps))
        r = rows[-1]
        print(f"{method}: reference {r['reference']:.3f}, plugin {r['plugin']:.3f}, gap {r['gap']:.3f} "
              f"(logits differ by {r['logits_max_diff']:.1e})", flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
