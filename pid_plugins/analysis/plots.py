"""PNG plots of the diagnostics and robustness results, one line per model (matplotlib, no display)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

__all__ = ["plot_diagnostics", "plot_image_robustness", "plot_lm_robustness"]

_TITLES = {"mean_cosine": "mean pairwise cosine", "consensus_distance": "consensus distance E",
           "numerical_rank": "numerical rank", "effective_rank": "effective rank",
           "attention_sparsity": "attention sparsity S(a)"}


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


def plot_diagnostics(results: Mapping[str, Dict[str, Any]], path: str | Path,
                     title: Optional[str] = None) -> Path:
    """Each measure vs depth (and E vs pass when present), one line per model label."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator
    with_passes = any("repeated_passes" in r for r in results.values())
    panels = list(_TITLES) + (["repeated_passes"] if with_passes else [])
    cols, rows = 3, (len(panels) + 2) // 3
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        passes = key == "repeated_passes"
        for label, r in results.items():
            points = [(i + 1, y) for i, y in enumerate(r.get(key) or []) if y is not None]
            if points:
                ax.plot(*zip(*points), label=label, **(dict(marker=".") if passes else dict(marker="o", ms=3)))
        ax.set_title("E after repeated passes" if passes else _TITLES[key])
        ax.set_xlabel("pass" if passes else "layer")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    return _finish(plt, fig, path, title)


def plot_image_robustness(results: Mapping[str, Dict[str, Any]], path: str | Path,
                          title: Optional[str] = None) -> Path:
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
            sev, per = r["corruptions"]["severities"], r["corruptions"]["top1"]
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


def plot_lm_robustness(results: Mapping[str, Dict[str, Any]], path: str | Path,
                       title: Optional[str] = None) -> Path:
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
    return _finish(plt, fig, path, None)
