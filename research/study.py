"""The first-layer / NeuTRENO / depth study (``python -m research study``), and side-by-side attention methods.

Arms, each trained from the softmax model's initial weights and data order: the built-in ones
(:data:`research.experiments.ARMS`: softmax, PID with the preset's gains and the first layer controlled
(eq. 25 as written), the same with a reference-only first layer (NeuTRENO's convention), and NeuTRENO as PID
gains) and any registered attention method with its parameters (``[label=]method[:params]``,
:func:`~research.experiments.parse_arm`). Vision: the demo's DeiT on
Fashion-MNIST at several depths; language: the demo's byte-level Llama. Per seed, the paired difference
arm - softmax of every measure; over seeds its mean +- std and whether a 95% paired t-interval excludes zero
("beyond seed noise").
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

__all__ = ["run_study", "write_study_record"]

# two-sided 95% Student t quantiles by degrees of freedom (n - 1 seeds)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _vision_spec(seed: int, depth: int, budget: Dict[str, Any], arms: Sequence[str]):
    from .experiments import VisionSpec

    return VisionSpec(
        data=budget["data"], depth=depth, seed=seed, arms=tuple(arms), epochs=budget["vision_epochs"],
        patch_size=budget["patch_size"], train_limit=budget["train_limit"], test_limit=budget["test_limit"],
        pgd_steps=budget["pgd_steps"], eps_sweep=(0.0, 1 / 255, 2 / 255, 3 / 255, 4 / 255),
    )


def _language_spec(seed: int, budget: Dict[str, Any], arms: Sequence[str]):
    from .experiments import LanguageSpec

    # the built-in neutreno arm is vision only (as in the committed record); method arms run in both parts
    return LanguageSpec(corpus=budget["corpus"], seed=seed, steps=budget["lm_steps"],
                        arms=tuple(a for a in arms if a.strip() != "neutreno"))


DEFAULT_BUDGET = dict(data="auto", corpus="wiki", vision_epochs=1.0, patch_size=7, train_limit=20000,
                      test_limit=500, pgd_steps=10, lm_steps=600)


def run_study(out_dir: str, seeds: Sequence[int] = (0, 1, 2), depths: Sequence[int] = (6, 12),
              arms: Sequence[str] = ("softmax", "pid", "pid_ref", "neutreno"),
              parts: Sequence[str] = ("vision", "language"), budget: Dict[str, Any] | None = None,
              log=print) -> Dict[str, Any]:
    """Train and evaluate every arm for every seed (and depth); write ``study.json``/``study.md``/``study.png``.

    Results are written per run (``vision_depth{d}/seed{s}/results.json``, ``language/seed{s}/results.json``)
    as they finish, so an interrupted study keeps what it did and ``write_study_record`` can aggregate it.
    """
    from .experiments import output_lock, run_language, run_vision, write_atomic

    budget = {**DEFAULT_BUDGET, **(budget or {})}
    out = Path(out_dir)

    def timed(run, spec, folder: Path, what: str) -> None:
        t0 = time.perf_counter()
        res = run(spec, folder, log)
        res["wall_seconds"] = time.perf_counter() - t0
        write_atomic(folder / "results.json", json.dumps(res, indent=1))
        log(f"study: {what} seed {spec.seed} done in {res['wall_seconds']:.0f} s")

    with output_lock(out):
        write_atomic(out / "budget.json", json.dumps(budget, indent=1))
        for seed in seeds:
            for depth in depths if "vision" in parts else ():
                timed(run_vision, _vision_spec(seed, depth, budget, arms), out / f"vision_depth{depth}" / f"seed{seed}",
                      f"vision depth {depth}")
            if "language" in parts:
                timed(run_language, _language_spec(seed, budget, arms), out / "language" / f"seed{seed}", "language")
        return write_study_record(out)


def _paired(values: Dict[str, List[float]], arm: str, base: str = "softmax") -> Dict[str, Any]:
    diffs = [a - s for a, s in zip(values[arm], values[base])]
    n = len(diffs)
    mean = statistics.fmean(diffs)
    std = statistics.stdev(diffs) if n > 1 else 0.0
    half = _T95.get(n - 1, 1.96) * std / math.sqrt(n) if n > 1 else math.inf
    return {"mean": mean, "std": std, "values": diffs, "ci95": [mean - half, mean + half],
            "beyond_noise": bool(n > 1 and (mean - half > 0 or mean + half < 0))}


def write_study_record(out_dir: str | Path) -> Dict[str, Any]:
    """Aggregate every ``*/seed*/results.json`` under ``out_dir`` into study.json, study.md and study.png (each
    setting lists its arms' ``methods``: the attention method and parameters of each arm)."""
    from .demo import _metrics
    from .experiments import atomic_path, write_atomic

    out = Path(out_dir)
    settings: Dict[str, Dict[str, Any]] = {}
    def order(folder: Path):  # vision by depth, then language
        depth = folder.name.removeprefix("vision_depth")
        return (0, int(depth), "") if depth.isdigit() else (1, 0, folder.name)

    for folder in sorted((p for p in out.iterdir() if p.is_dir()), key=order):
        runs = sorted(folder.glob("seed*/results.json"), key=lambda p: int(p.parent.name[4:]))
        if not runs:
            continue
        part = "vision" if folder.name.startswith("vision") else "language"
        results = [json.loads(p.read_text()) for p in runs]
        metrics = [_metrics({part: r}) for r in results]
        arms = list(metrics[0])
        summary: Dict[str, Dict[str, Any]] = {}
        for name in metrics[0]["softmax"]:
            if name.endswith("train seconds"):
                continue
            values = {arm: [m[arm][name] for m in metrics] for arm in arms}
            summary[name] = {
                "per_arm": {arm: {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
                                  "values": v} for arm, v in values.items()},
                "paired_vs_softmax": {arm: _paired(values, arm) for arm in arms if arm != "softmax"},
            }
            if "pid" in arms and "pid_ref" in arms:  # the first-layer question itself
                summary[name]["pid_ref_vs_pid"] = _paired(values, "pid_ref", base="pid")
        per_layer = {arm: [statistics.fmean(col) for col in zip(*(r["models"][arm]["collapse"]["mean_cosine"]
                                                                   for r in results))] for arm in arms}
        spec = results[0]["spec"]
        settings[folder.name] = {
            "part": part, "seeds": [int(p.parent.name[4:]) for p in runs], "arms": arms,
            "methods": {arm: _method_of(arm, results[0]["models"][arm], spec, part) for arm in arms}, "spec": spec,
            "summary": summary, "mean_cosine_per_layer": per_layer,
            "wall_seconds": sum(r.get("wall_seconds", 0.0) for r in results),
        }
    if not settings:
        raise ValueError(f"no */seed*/results.json under {out}: run the study first")
    record = {"budget": json.loads((out / "budget.json").read_text()) if (out / "budget.json").is_file() else None,
              "settings": settings}
    write_atomic(out / "study.json", json.dumps(record, indent=1))
    with atomic_path(out / "study.png") as tmp:
        png = _plot(settings, tmp)
    write_atomic(out / "study.md", _markdown(record, out / "study.png" if png else None))
    return record


def _method_of(arm: str, result: Dict[str, Any], spec: Dict[str, Any], part: str) -> Dict[str, Any]:
    """An arm's ``{"method", "attention_cfg"}``: from its results, or (records written before arms named their
    method: built-in arms only) from the arm's name and the spec."""
    if "method" in result:
        return {"method": result["method"], "attention_cfg": result.get("attention_cfg")}
    from .experiments import arm_record

    return arm_record(arm, spec.get("preset", "lm" if part == "language" else "deit"), part == "language",
                      spec.get("control_first_layer", True))


def _markdown(record: Dict[str, Any], png: Path | None) -> str:
    from .experiments import ARMS

    lines = ["# Study: first-layer convention, NeuTRENO, depth", ""]
    if record["budget"]:
        lines += ["Budget: " + ", ".join(f"{k}={v}" for k, v in record["budget"].items()), ""]
    lines += ["Each cell: paired difference arm - softmax over seeds, mean +- std; **bold** where the 95% paired "
              "t-interval excludes zero (beyond seed noise). Accuracies in points, mCE in % of softmax's, "
              "cosine in absolute units. Arms: `pid` = preset gains, first layer controlled (eq. 25 as written); "
              "`pid_ref` = same gains, reference-only first layer; `neutreno` = (0.6, 0, 0, 1) vision, "
              "(0.4, 0, 0, 1) language.", ""]
    for name, s in record["settings"].items():
        arms = [a for a in s["arms"] if a != "softmax"]
        spec = s["spec"]
        others = {a: m for a, m in s.get("methods", {}).items() if a not in ARMS}
        what = (f"depth {spec['depth']}, {spec['epochs']} epoch(s) on {spec.get('train_limit') or 'all'} images, "
                f"patch {spec['patch_size']}" if s["part"] == "vision" else
                f"{spec['num_layers']} layers, {spec['steps']} steps, preset {spec['preset']}")
        both = "pid" in arms and "pid_ref" in arms
        lines += [f"## {name} ({what}; seeds {s['seeds']}; {s['wall_seconds'] / 60:.0f} min of machine time)", "",
                  "| measure | softmax (mean +- std) | " + " | ".join(f"{a} - softmax" for a in arms)
                  + (" | pid_ref - pid" if both else "") + " |",
                  "|---|---|" + "---|" * (len(arms) + both)]
        if others:
            lines[-2:-2] = ["Method arms: " + "; ".join(
                f"`{a}` = `{m['method']}`" + (f" {json.dumps(m['attention_cfg'])}" if m["attention_cfg"] else "")
                for a, m in others.items()), ""]
        for measure, m in s["summary"].items():
            base = m["per_arm"]["softmax"]
            cells = []
            for p in [m["paired_vs_softmax"][a] for a in arms] + ([m["pid_ref_vs_pid"]] if both else []):
                cell = f"{p['mean']:+.3f} +- {p['std']:.3f}"
                cells.append(f"**{cell}**" if p["beyond_noise"] else cell)
            lines.append(f"| {measure} | {base['mean']:.3f} +- {base['std']:.3f} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("Mean pairwise cosine per block (mean over seeds): " + "; ".join(
            f"{a}: " + " ".join(f"{c:.2f}" for c in s["mean_cosine_per_layer"][a]) for a in s["arms"]))
        lines.append("")
    if png is not None:
        lines += [f"![study]({png.name})", ""]
    return "\n".join(lines)


_COLORS = {"softmax": "tab:red", "pid": "tab:blue", "pid_ref": "tab:green", "neutreno": "tab:purple"}


def _plot(settings: Dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    vision = {k: v for k, v in settings.items() if v["part"] == "vision"}
    if not vision:
        return None
    fig, axes = plt.subplots(2, len(vision), figsize=(5 * len(vision), 7), squeeze=False)
    for col, (name, s) in enumerate(vision.items()):
        ax = axes[0][col]
        for arm in s["arms"]:
            cosine = s["mean_cosine_per_layer"][arm]
            ax.plot(range(1, len(cosine) + 1), cosine, "o-", label=arm, color=_COLORS.get(arm))
        ax.set(title=f"{name}: token similarity", xlabel="block", ylabel="mean pairwise cosine")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        measures = [m for m in s["summary"] if "PGD" in m or "FGSM" in m or "clean" in m]
        arms = [a for a in s["arms"] if a != "softmax"]
        width = 0.8 / max(1, len(arms))
        for i, arm in enumerate(arms):
            means = [s["summary"][m]["paired_vs_softmax"][arm]["mean"] for m in measures]
            stds = [s["summary"][m]["paired_vs_softmax"][arm]["std"] for m in measures]
            ax.bar([j + i * width for j in range(len(measures))], means, width, yerr=stds, label=arm, capsize=2,
                   color=_COLORS.get(arm))
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(measures))])
        ax.set_xticklabels([m.replace("vision ", "").replace(" top-1 %", "") for m in measures], rotation=45,
                           ha="right", fontsize=8)
        ax.set(ylabel="arm - softmax (points), mean +- std over seeds")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

