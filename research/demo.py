"""A small demonstration of the core: token collapse with softmax attention, and what PID control does.

Two experiments, both comparing softmax and PID on identical inputs:

1. *Fixed attention* (the paper's state-space view, Section 2): a fixed row-stochastic attention matrix K
   applied layer after layer. Softmax layers compute ``V <- K V`` and collapse to rank 1 (Lemma 2); PID
   layers compute ``V <- K V + PID term`` with :func:`pid_update` and keep the rank of the input.
2. *Randomly initialised attention stack*: 12 pre-norm residual self-attention blocks
   (:class:`PIDSelfAttention`, same weights for both), measuring mean pairwise cosine similarity of the
   tokens after every block.

Writes ``core_demo.json``, ``core_demo.png`` and ``report.md`` into the output directory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from pid_plugins.analysis.measures import consensus_distance, mean_pairwise_cosine, numerical_rank
from pid_plugins.core import PIDConfig, PIDSelfAttention, pid_update

__all__ = ["fixed_attention_trajectory", "attention_stack_trajectory", "run_core_demo"]


def random_attention(n: int, generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """A row-stochastic matrix with positive entries: the softmax of random scores."""
    return torch.softmax(torch.randn(n, n, generator=generator, dtype=torch.float64) / temperature, dim=-1)


def fixed_attention_trajectory(
    K: torch.Tensor, V0: torch.Tensor, depth: int, config: Optional[PIDConfig]
) -> list[torch.Tensor]:
    """``[V^1, V^2, ...]``: the tokens entering each of ``depth`` layers (and after the last).

    Softmax (``config=None``): ``V <- K V``. PID: ``V <- pid_update(K V, V, state)``.
    """
    out = [V0]
    V, state = V0, None
    for _ in range(depth):
        if config is None:
            V = K @ V
        else:
            V, state = pid_update(K @ V, V, state, config)
        out.append(V)
    return out


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, pid: Optional[PIDConfig]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = PIDSelfAttention(dim, heads, qkv_bias=True, pid=pid)

    def forward(self, x, state):
        y, state = self.attn(self.norm(x), state)
        return x + y, state


def attention_stack_trajectory(
    x: torch.Tensor, depth: int, dim: int, heads: int, config: Optional[PIDConfig], seed: int
) -> list[torch.Tensor]:
    """Token matrices after each block of a randomly initialised stack (weights fixed by ``seed``)."""
    torch.manual_seed(seed)
    blocks = nn.ModuleList(_Block(dim, heads, config) for _ in range(depth)).eval()
    outs, state = [x], None
    with torch.no_grad():
        for blk in blocks:
            x, state = blk(x, state)
            outs.append(x)
    return outs


def run_core_demo(out_dir: str | os.PathLike = "demo_out", seed: int = 0, depth: int = 24,
                  tokens: int = 64, dim: int = 32, preset: str = "deit") -> dict[str, Any]:
    """Run both experiments, write JSON + PNG + markdown report, and return the results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = PIDConfig.preset(preset)
    g = torch.Generator().manual_seed(seed)

    K = random_attention(tokens, g)
    V0 = torch.randn(tokens, dim, generator=g, dtype=torch.float64)
    results: dict[str, Any] = {"config": {"seed": seed, "depth": depth, "tokens": tokens, "dim": dim,
                                          "pid": cfg.to_dict(), "preset": preset}}
    fixed = {}
    for label, c in (("softmax", None), ("pid", cfg)):
        traj = fixed_attention_trajectory(K, V0, depth, c)
        fixed[label] = {
            "numerical_rank": [int(numerical_rank(v)) for v in traj],
            "mean_cosine": [float(mean_pairwise_cosine(v)) for v in traj],
            "consensus_distance": [float(consensus_distance(v)) for v in traj],
        }
    results["fixed_attention"] = fixed

    x = torch.randn(8, tokens, 96, generator=g)
    stack = {}
    for label, c in (("softmax", None), ("pid", cfg)):
        traj = attention_stack_trajectory(x, depth=12, dim=96, heads=3, config=c, seed=seed)
        stack[label] = {"mean_cosine": [float(mean_pairwise_cosine(v).mean()) for v in traj]}
    results["attention_stack"] = stack

    from .experiments import atomic_path, write_atomic

    write_atomic(out / "core_demo.json", json.dumps(results, indent=2))
    with atomic_path(out / "core_demo.png") as tmp:
        png = _plot(results, tmp)
    png = out / "core_demo.png" if png is not None else None
    write_atomic(out / "report.md", _report(results, png))
    return results


def _plot(results: dict[str, Any], path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    fixed, stack = results["fixed_attention"], results["attention_stack"]
    style = {"softmax": dict(color="tab:red", marker="o"), "pid": dict(color="tab:blue", marker="s")}
    for label, series in fixed.items():
        axes[0].plot(series["numerical_rank"], label=label, ms=3, **style[label])
        axes[1].plot(series["mean_cosine"], label=label, ms=3, **style[label])
    for label, series in stack.items():
        axes[2].plot(series["mean_cosine"], label=label, ms=3, **style[label])
    axes[0].set(title="fixed attention K: numerical rank", xlabel="layer", ylabel="rank (rtol 1e-3)")
    axes[1].set(title="fixed attention K: mean pairwise cosine", xlabel="layer", ylabel="cosine")
    axes[2].set(title="random 12-block attention stack", xlabel="block", ylabel="mean pairwise cosine")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"softmax vs PID attention (preset {results['config']['preset']}: "
                 f"{results['config']['pid']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _report(results: dict[str, Any], png: Optional[Path]) -> str:
    fixed, stack = results["fixed_attention"], results["attention_stack"]
    c = results["config"]
    lines = [
        "# pid-plugins core demo",
        "",
        f"Fixed row-stochastic attention K ({c['tokens']} tokens, dim {c['dim']}, {c['depth']} layers) and a "
        f"randomly initialised 12-block attention stack; preset `{c['preset']}` {c['pid']}.",
        "",
        "| experiment | measure | softmax (first -> last) | PID (first -> last) |",
        "|---|---|---|---|",
    ]
    for key in ("numerical_rank", "mean_cosine", "consensus_distance"):
        s, p = fixed["softmax"][key], fixed["pid"][key]
        lines.append(f"| fixed K | {key} | {s[0]:.4g} -> {s[-1]:.4g} | {p[0]:.4g} -> {p[-1]:.4g} |")
    s, p = stack["softmax"]["mean_cosine"], stack["pid"]["mean_cosine"]
    lines.append(f"| attention stack | mean_cosine | {s[0]:.4g} -> {s[-1]:.4g} | {p[0]:.4g} -> {p[-1]:.4g} |")
    lines.append("")
    if png is not None:
        lines.append(f"![softmax vs PID]({png.name})")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# The main job: softmax vs PID on real data through the zoo adapters (``python -m research demo``).
def demo_specs(quick: bool, seed: int = 0, data: str = "auto", corpus: str = "wiki", control_first_layer: bool = True):
    """The default (or ``--quick``) vision and language specs; ``control_first_layer=False`` gives the PID models a
    reference-only first layer."""
    from dataclasses import replace

    from .experiments import LanguageSpec, VisionSpec

    if quick:
        # smaller models than the full run's (the same code paths: timm's blocks, transformers' GQA Llama)
        vision = VisionSpec(data=data, embed_dim=64, depth=4, num_heads=2, epochs=0.15, test_limit=200, pgd_steps=3,
                            eps_sweep=(0.0, 2 / 255, 4 / 255), noise_sigmas=(0.1, 0.3),
                            corruptions=("gaussian_noise", "contrast"), severities=(1, 3, 5), diag_samples=64, seed=seed)
        language = LanguageSpec(corpus=corpus, seq_len=64, hidden_size=64, num_layers=3, steps=60, valid_blocks=16,
                                seed=seed)
    else:
        vision = VisionSpec(data=data, epochs=1.0, test_limit=500, pgd_steps=10, seed=seed)
        language = LanguageSpec(corpus=corpus, steps=800, valid_blocks=64, seed=seed)
    return (replace(vision, control_first_layer=control_first_layer),
            replace(language, control_first_layer=control_first_layer))


def _at(xs, ys, x):
    """y at the x nearest to ``x``."""
    i = min(range(len(xs)), key=lambda j: abs(xs[j] - x))
    return ys[i]


def vision_rows(v: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(measure, softmax, PID) rows of the vision comparison."""
    s, p = v["models"]["softmax"], v["models"]["pid"]
    rows = []

    def pct(f):
        return lambda r: f"{100 * f(r):.1f}%"

    eps3 = 3 / 255
    checks = [
        ("clean top-1", pct(lambda r: r["robustness"]["clean"]["top1"])),
        (f"FGSM top-1 (eps {round(255 * _near(v, 'fgsm', eps3))}/255)",
         pct(lambda r: _at(r["robustness"]["fgsm"]["eps"], r["robustness"]["fgsm"]["top1"], eps3))),
        (f"PGD-{v['spec']['pgd_steps']} top-1 (eps {round(255 * _near(v, 'pgd', eps3))}/255)",
         pct(lambda r: _at(r["robustness"]["pgd"]["eps"], r["robustness"]["pgd"]["top1"], eps3))),
        (f"Gaussian noise top-1 (sigma {v['spec']['noise_sigmas'][-1]})", pct(lambda r: r["robustness"]["noise"]["top1"][-1])),
        ("mean corruption error", pct(lambda r: r["robustness"]["corruptions"]["mean_corruption_error"])),
        ("mCE vs softmax (100 = same)", lambda r: f"{r['robustness']['corruptions']['mce_vs_softmax']:.1f}"),
        ("mean cosine, first -> last block",
         lambda r: f"{r['collapse']['mean_cosine'][0]:.3f} -> {r['collapse']['mean_cosine'][-1]:.3f}"),
        ("effective rank, last block", lambda r: f"{r['collapse']['effective_rank'][-1]:.1f}"),
        ("training wall time (sequential, see note)", _train_time),
    ]
    for name, fmt in checks:
        rows.append((name, fmt(s), fmt(p)))
    return rows


def _train_time(r: dict[str, Any]) -> str:
    return f"{r['train_seconds']:.0f} s" + (" (cached)" if r.get("cached") else "")


TIMING_NOTE = (
    "Training wall times are those of the two trainings run one after the other on this machine, under whatever "
    "else it was doing at the time (on a shared machine one run read 120 s softmax, 348 s PID for the same work); "
    "\"(cached)\" marks a time from the earlier run that trained the cached model. They are not a speed comparison: "
    "`make bench` measures PID/softmax time ratios with the two models interleaved."
)


def _near(v, attack, eps):
    xs = v["models"]["softmax"]["robustness"][attack]["eps"]
    return min(xs, key=lambda e: abs(e - eps))


def language_rows(lang: dict[str, Any]) -> list[tuple[str, str, str]]:
    s, p = lang["models"]["softmax"], lang["models"]["pid"]
    rates = lang["spec"]["rates"]
    rows = [
        ("validation perplexity (bytes)", f"{s['valid_perplexity']:.3f}", f"{p['valid_perplexity']:.3f}"),
        ("bits per byte", f"{s['bits_per_byte']:.3f}", f"{p['bits_per_byte']:.3f}"),
        (f"perplexity, {100 * rates[-1]:g}% bytes substituted", f"{s['robustness']['perplexity'][-1]:.3f}",
         f"{p['robustness']['perplexity'][-1]:.3f}"),
        ("mean cosine, first -> last layer",
         f"{s['collapse']['mean_cosine'][0]:.3f} -> {s['collapse']['mean_cosine'][-1]:.3f}",
         f"{p['collapse']['mean_cosine'][0]:.3f} -> {p['collapse']['mean_cosine'][-1]:.3f}"),
        ("training wall time (sequential, see note)", _train_time(s), _train_time(p)),
    ]
    return rows


def plot_reproduction(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], path: str | Path,
                      title: Optional[str] = None) -> Path:
    """The reproduction record over seeds: attack accuracy vs eps (mean +- std), each seed's PID - softmax
    difference on the headline vision measures, and the last layer's token similarity."""
    import re

    from pid_plugins.analysis.plots import _finish, _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = [k for k in ("softmax", "pid") if any(k in by for by in summary.values())]
    for k, label in enumerate(labels):
        for attack, style in (("FGSM", "-"), ("PGD", "--")):
            pts = []
            for name, by in summary.items():
                m = re.fullmatch(rf"vision {attack} (\d+)/255 top-1 %", name)
                if m and label in by:
                    pts.append((int(m.group(1)), by[label]["mean"], by[label]["std"]))
            clean = summary.get("vision clean top-1 %", {}).get(label)
            if clean:
                pts.append((0, clean["mean"], clean["std"]))
            if pts:
                xs, ms, ss = zip(*sorted(pts))
                axes[0].errorbar(xs, ms, yerr=ss, fmt=style, marker="o", ms=3, capsize=3, color=colours[k],
                                 label=f"{label} {attack}")
    axes[0].set(title="attacks (l_inf), mean +- std over seeds", xlabel="eps x 255", ylabel="top-1 accuracy (%)")
    # each seed's paired difference (same seed, data order and initialisation for both models)
    headline = [(n, n.replace("vision ", "").replace(" top-1 %", "")) for n in summary
                if n.startswith("vision") and n.endswith("top-1 %")
                and ("clean" in n or "3/255" in n or "noise" in n)]
    if "vision mean corruption error %" in summary:
        headline.append(("vision mean corruption error %", "corruption error (lower = better)"))
    for i, (name, _) in enumerate(headline):
        by = summary[name]
        if "pid" in by and "softmax" in by:
            diffs = [p - s for p, s in zip(by["pid"]["values"], by["softmax"]["values"])]
            axes[1].scatter(diffs, [i] * len(diffs), color=colours[1], s=18, zorder=3)
            axes[1].plot([sum(diffs) / len(diffs)] * 2, [i - 0.3, i + 0.3], color="black", lw=2)
    axes[1].axvline(0, color="grey", lw=0.8)
    axes[1].set_yticks(range(len(headline)), [s for _, s in headline], fontsize=8)
    axes[1].set(title="PID - softmax per seed (bar: mean)", xlabel="percentage points")
    names = [n for n in ("vision last-block mean cosine", "language last-layer mean cosine") if n in summary]
    width = 0.38
    for k, label in enumerate(labels):
        ms = [summary[n][label]["mean"] for n in names]
        ss = [summary[n][label]["std"] for n in names]
        axes[2].bar([j + (k - 0.5) * width for j in range(len(names))], ms, width, yerr=ss, capsize=3,
                    color=colours[k], label=label)
    axes[2].set_xticks(range(len(names)), [n.split(" last")[0] for n in names])
    axes[2].set(title="last layer's mean pairwise cosine", ylabel="cosine")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    return _finish(plt, fig, path, title)


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    lines = ["| measure | softmax | PID |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return lines


def plot_training_curves(results: dict[str, Any], path: Path) -> Path:
    from pid_plugins.analysis.plots import _pyplot

    plt = _pyplot()
    parts = [k for k in ("vision", "language") if k in results]
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 3.6), squeeze=False)
    for ax, part in zip(axes.flat, parts):
        for label, r in results[part]["models"].items():
            loss = r["train_loss"]
            w = max(1, len(loss) // 50)
            smooth = [sum(loss[max(0, i - w + 1):i + 1]) / len(loss[max(0, i - w + 1):i + 1]) for i in range(len(loss))]
            ax.plot(range(1, len(loss) + 1), smooth, label=label)
        ax.set(title=f"{part}: training loss (moving mean)", xlabel="step", ylabel="cross-entropy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(out_dir: str | os.PathLike = "demo_out", *, quick: bool = False, parts: tuple[str, ...] = ("core", "vision", "language"),
             seed: int = 0, data: str = "auto", corpus: str = "wiki", preset: str = "deit",
             control_first_layer: bool = True, log=print) -> dict[str, Any]:
    """Run the demo's parts, write ``report.md``, JSON and PNGs into ``out_dir``, return the results.

    Two runs into one ``out_dir`` at once are refused (:func:`~research.experiments.output_lock`).
    """
    from .experiments import output_lock

    out = Path(out_dir)
    vision_spec, language_spec = demo_specs(quick, seed, data, corpus, control_first_layer)
    with output_lock(out):
        return _run_demo(out, quick, parts, seed, preset, vision_spec, language_spec, log)


def _run_demo(out: Path, quick: bool, parts: tuple[str, ...], seed: int, preset: str, vision_spec: Any,
              language_spec: Any, log) -> dict[str, Any]:
    import time

    from pid_plugins.analysis.plots import plot_diagnostics, plot_image_robustness, plot_lm_robustness
    from .experiments import atomic_path, run_language, run_vision, write_atomic

    results: dict[str, Any] = {"quick": quick}
    t0 = time.perf_counter()
    if "core" in parts:
        results["core"] = run_core_demo(out, seed=seed, preset=preset)
    if "vision" in parts:
        v = run_vision(vision_spec, out, log)
        results["vision"] = v
        with atomic_path(out / "vision_robustness.png") as tmp:
            plot_image_robustness({k: r["robustness"] for k, r in v["models"].items()}, tmp,
                                  title=f"small DeiT on {v['data']}: softmax vs PID")
        with atomic_path(out / "vision_collapse.png") as tmp:
            plot_diagnostics({k: r["collapse"] for k, r in v["models"].items()}, tmp,
                             title=f"small DeiT on {v['data']}: collapse measures per block")
    if "language" in parts:
        lang = run_language(language_spec, out, log)
        results["language"] = lang
        with atomic_path(out / "language_robustness.png") as tmp:
            plot_lm_robustness({k: r["robustness"] for k, r in lang["models"].items()}, tmp,
                               title="byte-level Llama: perplexity under byte substitution")
        with atomic_path(out / "language_collapse.png") as tmp:
            plot_diagnostics({k: r["collapse"] for k, r in lang["models"].items()}, tmp,
                             title=f"byte-level Llama on {lang['spec']['corpus']}: collapse measures per layer")
    if "vision" in parts or "language" in parts:
        with atomic_path(out / "training_curves.png") as tmp:
            plot_training_curves(results, tmp)
    results["seconds"] = time.perf_counter() - t0
    write_atomic(out / "demo.json", json.dumps(results, indent=1))
    write_atomic(out / "report.md", demo_report(results))
    return results


def demo_report(results: dict[str, Any]) -> str:
    lines = ["# pid-plugins demo: softmax vs PID attention on real data", ""]
    lines.append(f"{'Quick run (`--quick`): tiny budgets, for smoke tests only. ' if results['quick'] else ''}"
                 f"Total time {results['seconds']:.0f} s on this machine.")
    lines.append("")
    if "vision" in results:
        v = results["vision"]
        sp = v["spec"]
        lines += [
            f"## Vision: small DeiT (timm adapter) on {v['data']}", "",
            f"{sp['depth']} blocks, dim {sp['embed_dim']}, {sp['num_heads']} heads, {sp['img_size']} px images in "
            f"{sp['patch_size']} px patches ({v['models']['softmax']['params'] / 1e6:.2f} M parameters); "
            f"{sp['epochs']} epoch(s) over {v['train_size']} training images, AdamW lr {sp['lr']}, batch "
            f"{sp['batch_size']}; softmax and PID (preset `{sp['preset']}`) from the same initial weights and the same "
            f"data order. Evaluated on {v['test_size']} test images; attacks are l_inf on the 0..1 pixels.", "",
        ]
        lines += _table(vision_rows(v)) + ["", "![robustness](vision_robustness.png)", "",
                                             "![collapse](vision_collapse.png)", ""]
    if "language" in results:
        lang = results["language"]
        sp = lang["spec"]
        s = lang["models"]["softmax"]
        lines += [
            f"## Language: byte-level Llama (transformers adapter) on `{sp['corpus']}`", "",
            f"{sp['num_layers']} layers, hidden {sp['hidden_size']}, {sp['num_heads']} query / {sp['num_kv_heads']} "
            f"key-value heads ({s['params'] / 1e6:.2f} M parameters), context {sp['seq_len']} bytes; {sp['steps']} steps "
            f"of batch {sp['batch_size']}, AdamW lr {sp['lr']}; softmax (`sdpa`) and PID (`attn_implementation='pid'`, "
            f"preset `{sp['preset']}`) from the same weights and batches. Validation: {lang['valid_blocks']} held-out "
            "blocks (the last 10% of the text).", "",
        ]
        lines += _table(language_rows(lang)) + ["", "![perplexity under noise](language_robustness.png)", "",
                                                 "![collapse](language_collapse.png)", ""]
    if "vision" in results or "language" in results:
        lines += ["## Training curves", "", "![training curves](training_curves.png)", "", TIMING_NOTE, ""]
    if "core" in results:
        lines += ["## The theory in one picture (core only, no training)", ""]
        lines += _report(results["core"], Path("core_demo.png")).splitlines()[2:]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# The reproduction record (``python -m research reproduce``): the same comparison, larger budget, several seeds.
def _metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Scalar metrics per model for aggregation over seeds."""
    out: dict[str, dict[str, float]] = {}
    v = results.get("vision")
    if v:
        for label, r in v["models"].items():
            rb = r["robustness"]
            m = out.setdefault(label, {})
            m["vision clean top-1 %"] = 100 * rb["clean"]["top1"]
            for e, a in zip(rb["fgsm"]["eps"], rb["fgsm"]["top1"]):
                if e > 0:
                    m[f"vision FGSM {round(255 * e)}/255 top-1 %"] = 100 * a
            for e, a in zip(rb["pgd"]["eps"], rb["pgd"]["top1"]):
                if e > 0:
                    m[f"vision PGD {round(255 * e)}/255 top-1 %"] = 100 * a
            m["vision noise sigma %g top-1 %%" % v["spec"]["noise_sigmas"][-1]] = 100 * rb["noise"]["top1"][-1]
            m["vision mean corruption error %"] = 100 * rb["corruptions"]["mean_corruption_error"]
            m["vision mCE vs softmax"] = rb["corruptions"]["mce_vs_softmax"]
            m["vision last-block mean cosine"] = r["collapse"]["mean_cosine"][-1]
            m["vision train seconds"] = r["train_seconds"]
    lang = results.get("language")
    if lang:
        for label, r in lang["models"].items():
            m = out.setdefault(label, {})
            m["language valid perplexity"] = r["valid_perplexity"]
            m["language bits per byte"] = r["bits_per_byte"]
            m["language ppl, %g%% substituted" % (100 * lang["spec"]["rates"][-1])] = r["robustness"]["perplexity"][-1]
            m["language last-layer mean cosine"] = r["collapse"]["mean_cosine"][-1]
            m["language train seconds"] = r["train_seconds"]
    return out


def run_reproduce(out_dir: str | os.PathLike, seeds: tuple[int, ...] = (0, 1, 2), vision_epochs: float = 3.0,
                  lm_steps: int = 2000, data: str = "auto", corpus: str = "wiki",
                  parts: tuple[str, ...] = ("vision", "language"), log=print) -> dict[str, Any]:
    """Run the demo comparison for each seed with a larger budget; write mean +- std to reproduce.md/json."""
    from .experiments import output_lock

    out = Path(out_dir)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {list(seeds)} list a seed twice")
    with output_lock(out):
        return _run_reproduce(out, seeds, vision_epochs, lm_steps, data, corpus, parts, log)


def _run_reproduce(out: Path, seeds: tuple[int, ...], vision_epochs: float, lm_steps: int, data: str, corpus: str,
                   parts: tuple[str, ...], log) -> dict[str, Any]:
    from dataclasses import replace

    from .experiments import run_language, run_vision, write_atomic

    per_seed = []
    for seed in seeds:
        vspec, lspec = demo_specs(False, seed, data, corpus)
        vspec = replace(vspec, epochs=vision_epochs, test_limit=1000)
        lspec = replace(lspec, steps=lm_steps, valid_blocks=128)
        res: dict[str, Any] = {"seed": seed}
        if "vision" in parts:
            res["vision"] = run_vision(vspec, out / f"seed{seed}", log)
        if "language" in parts:
            res["language"] = run_language(lspec, out / f"seed{seed}", log)
        per_seed.append(res)
        (out / f"seed{seed}").mkdir(parents=True, exist_ok=True)
        write_atomic(out / f"seed{seed}" / "results.json", json.dumps(res, indent=1))
    return write_reproduction_record(per_seed, out, vision_epochs=vision_epochs, lm_steps=lm_steps, corpus=corpus)


def write_reproduction_record(per_seed: list[dict[str, Any]], out: Path, *, vision_epochs: Optional[float] = None,
                              lm_steps: Optional[int] = None, corpus: Optional[str] = None) -> dict[str, Any]:
    """Mean +- std over the seeds' results (``seed*/results.json`` of one or several runs) to reproduce.md/json.

    The budget (epochs, steps, corpus) is read from the results; runs with different budgets are refused.
    """
    import statistics

    from .experiments import atomic_path, write_atomic

    if not per_seed:
        raise ValueError("no seed results to aggregate")
    seen = [r.get("seed") for r in per_seed]
    twice = sorted({s for s in seen if seen.count(s) > 1}, key=str)
    if twice:
        raise ValueError(f"seed(s) {twice} appear more than once in the results: each seed counts once; aggregate "
                         "folders that hold different seeds")
    budgets = {(r.get("vision", {}).get("spec", {}).get("epochs"), r.get("language", {}).get("spec", {}).get("steps"),
                r.get("language", {}).get("spec", {}).get("corpus")) for r in per_seed}
    if len(budgets) > 1:
        raise ValueError(f"the seeds' results come from runs with different budgets (vision epochs, LM steps, corpus): "
                         f"{sorted(budgets, key=str)}; aggregate runs of one budget only")
    run_epochs, run_steps, run_corpus = budgets.pop()
    vision_epochs = run_epochs if run_epochs is not None else vision_epochs
    lm_steps = run_steps if run_steps is not None else lm_steps
    corpus = run_corpus if run_corpus is not None else corpus
    metrics = [_metrics(r) for r in per_seed]
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for label in metrics[0]:
        for name in metrics[0][label]:
            vals = [m[label][name] for m in metrics]
            summary.setdefault(name, {})[label] = {
                "mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "values": vals}
    seeds = [r["seed"] for r in per_seed]
    record = {"seeds": seeds, "vision_epochs": vision_epochs, "lm_steps": lm_steps,
              "vision_data": per_seed[0].get("vision", {}).get("data"), "corpus": corpus, "summary": summary}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "reproduce.json", json.dumps(record, indent=1))
    lines = [f"# Reproduction record: seeds {seeds}, vision {vision_epochs} epochs on "
             f"{record['vision_data']}, language {lm_steps} steps on `{corpus}`", "",
             "| measure | softmax (mean +- std) | PID (mean +- std) | PID - softmax, paired by seed (mean +- std) |",
             "|---|---|---|---|"]
    for name, by in summary.items():
        cells = [f"{by[k]['mean']:.3f} +- {by[k]['std']:.3f}" for k in ("softmax", "pid")]
        diffs = [p - s for p, s in zip(by["pid"]["values"], by["softmax"]["values"])]
        spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {statistics.fmean(diffs):+.3f} +- {spread:.3f} |")
    if any(name.startswith("vision") for name in summary):
        with atomic_path(out / "reproduce.png") as tmp:
            plot_reproduction(summary, tmp, title=f"softmax vs PID over seeds {seeds}")
        lines += ["", "![reproduction record](reproduce.png)"]
    write_atomic(out / "reproduce.md", "\n".join(lines) + "\n")
    return record
