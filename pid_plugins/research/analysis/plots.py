"""PNG plots of the diagnostics and robustness results, one line per model (matplotlib, no display)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

__all__ = ["plot_diagnostics", "plot_image_robustness", "plot_lm_robustness", "plot_reproduction"]

_TITLES = {
    "mean_cosine": "mean pairwise cosine",
    "consensus_distance": "consensus distance E",
    "numerical_rank": "numerical rank",
    "effective_rank": "effective rank",
    "attention_sparsity": "attention sparsity S(a)",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, path: str | Path, title: Optional[str]) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_diagnostics(results: Mapping[str, Dict[str, Any]], path: str | Path, title: Optional[str] = None) -> Path:
    """Each measure vs depth (and E vs pass when present), one line per model label."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    with_passes = any("repeated_passes" in r for r in results.values())
    panels = list(_TITLES) + (["repeated_passes"] if with_passes else [])
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        for label, r in results.items():
            if key == "repeated_passes":
                ys = r.get("repeated_passes")
                if ys:
                    ax.plot(range(1, len(ys) + 1), ys, marker=".", label=label)
                continue
            ys = r.get(key) or []
            xs = [i + 1 for i, y in enumerate(ys) if y is not None]
            vals = [y for y in ys if y is not None]
            if vals:
                ax.plot(xs, vals, marker="o", ms=3, label=label)
        if key == "repeated_passes":
            ax.set_title("E after repeated passes")
            ax.set_xlabel("pass")
        else:
            ax.set_title(_TITLES[key])
            ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    return _finish(plt, fig, path, title)


def plot_image_robustness(results: Mapping[str, Dict[str, Any]], path: str | Path, title: Optional[str] = None) -> Path:
    """Accuracy vs eps (FGSM, PGD), vs noise sigma, and vs corruption severity, one colour per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (label, r) in enumerate(results.items()):
        c = colours[k % len(colours)]
        for name, style in (("fgsm", "-"), ("pgd", "--")):
            if name in r:
                xs = [e * 255 for e in r[name]["eps"]]
                axes[0].plot(xs, [100 * a for a in r[name]["top1"]], style, color=c, marker="o", ms=3,
                             label=f"{label} {name.upper()}")
        if "noise" in r:
            axes[1].plot(r["noise"]["sigma"], [100 * a for a in r["noise"]["top1"]], color=c, marker="o", ms=3,
                         label=label)
        if "corruptions" in r:
            sev = r["corruptions"]["severities"]
            per = r["corruptions"]["top1"]
            mean = [100 * sum(v[i] for v in per.values()) / len(per) for i in range(len(sev))]
            axes[2].plot(sev, mean, color=c, marker="o", ms=3, label=label)
        axes[0].axhline(100 * r["clean"]["top1"], color=c, lw=0.8, alpha=0.5)
    axes[0].set(title="adversarial attacks (l_inf)", xlabel="eps x 255", ylabel="top-1 accuracy (%)")
    axes[1].set(title="additive Gaussian noise", xlabel="sigma (pixels in [0, 1])", ylabel="top-1 accuracy (%)")
    axes[2].set(title="ImageNet-C corruptions (mean)", xlabel="severity", ylabel="top-1 accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _finish(plt, fig, path, title)


def plot_lm_robustness(results: Mapping[str, Dict[str, Any]], path: str | Path, title: Optional[str] = None) -> Path:
    """Perplexity vs token substitution rate, one line per model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for label, r in results.items():
        ax.plot([100 * x for x in r["substitution_rate"]], r["perplexity"], marker="o", label=label)
    ax.set(title=title or "perplexity under random token substitution", xlabel="tokens substituted (%)",
           ylabel="perplexity")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reproduction(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], path: str | Path,
                      title: Optional[str] = None) -> Path:
    """The reproduction record over seeds: attack accuracy vs eps (mean +- std), each seed's PID - softmax
    difference on the headline vision measures, and the last layer's token similarity."""
    import re

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
