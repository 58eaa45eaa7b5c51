import json
from pathlib import Path

import pytest
from pyexec import run_python_m  # python -m from a fork of an interpreter with the zoos (not pid_plugins) imported

from pid_plugins.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_cli_presets(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "deit" in out and "0.8" in out and "segmenter" in out and "lm" in out


def test_cli_list_runs(capsys):
    assert main(["list"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.integration
@pytest.mark.slow
def test_demo_writes_report_and_shows_collapse(tmp_path):
    proc = run_python_m("research", "demo", "--parts", "core", "--out", str(tmp_path), cwd=REPO)
    proc.check_returncode()
    assert "report.md" in proc.stdout
    res = json.loads((tmp_path / "core_demo.json").read_text())
    fixed = res["fixed_attention"]
    assert fixed["softmax"]["numerical_rank"][0] == fixed["pid"]["numerical_rank"][0] == 32
    assert fixed["softmax"]["numerical_rank"][-1] == 1
    assert fixed["pid"]["numerical_rank"][-1] == 32
    stack = res["attention_stack"]
    assert stack["pid"]["mean_cosine"][-1] < stack["softmax"]["mean_cosine"][-1]
    assert (tmp_path / "core_demo.png").stat().st_size > 10_000
    assert "![softmax vs PID](core_demo.png)" in (tmp_path / "report.md").read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_quick_demo_trains_both_models_on_real_data_and_reports(tmp_path):
    """`python -m research demo --quick`: the main job end to end, through the timm and transformers adapters."""
    import math

    proc = run_python_m("research", "demo", "--quick", "--out", str(tmp_path), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vision (" in proc.stdout and "language (" in proc.stdout
    res = json.loads((tmp_path / "demo.json").read_text())
    v, lang = res["vision"], res["language"]
    chance = 1.0 / 10
    for label in ("softmax", "pid"):
        rb = v["models"][label]["robustness"]
        assert rb["clean"]["top1"] > 2 * chance, f"vision {label} did not learn"
        assert all(a <= rb["clean"]["top1"] for a in rb["pgd"]["top1"])
        coll = v["models"][label]["collapse"]
        assert all(math.isfinite(x) for x in coll["mean_cosine"] + coll["consensus_distance"])
        ppl = lang["models"][label]["valid_perplexity"]
        assert math.isfinite(ppl) and ppl < 64, f"language {label} did not learn (uniform bytes: 256)"
        first, last = lang["models"][label]["train_loss"][:5], lang["models"][label]["train_loss"][-5:]
        assert sum(last) < sum(first)
    for png in ("vision_robustness.png", "vision_collapse.png", "language_robustness.png", "language_collapse.png",
                "training_curves.png", "core_demo.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG", png
    report = (tmp_path / "report.md").read_text()
    assert "| clean top-1 |" in report and "| validation perplexity (bytes) |" in report
    assert "nan" not in report.lower()
    # the trained models are cached: a rerun goes straight to evaluation
    again = run_python_m("research", "demo", "--quick", "--parts", "vision", "--out", str(tmp_path), cwd=REPO,
                         timeout=600)
    assert again.returncode == 0 and "loaded the cached model" in again.stderr
    res2 = json.loads((tmp_path / "demo.json").read_text())
    assert res2["vision"]["models"]["pid"]["robustness"]["clean"] == v["models"]["pid"]["robustness"]["clean"]
    # the reproduction record aggregates per-seed results of this shape (here: the same run twice -> std 0)
    from research.demo import write_reproduction_record

    rec = write_reproduction_record([dict(res, seed=0), dict(res, seed=1)], tmp_path / "rep", vision_epochs=0.15,
                                    lm_steps=60, corpus="wiki")
    clean = rec["summary"]["vision clean top-1 %"]["pid"]
    assert clean["std"] == 0 and clean["mean"] == 100 * v["models"]["pid"]["robustness"]["clean"]["top1"]
    ppl = rec["summary"]["language valid perplexity"]["softmax"]["mean"]
    assert ppl == lang["models"]["softmax"]["valid_perplexity"]
    assert rec["lm_steps"] == lang["spec"]["steps"]  # the budget is read from the results
    import copy

    longer = copy.deepcopy(res)
    longer["vision"]["spec"]["epochs"] = 2 * res["vision"]["spec"]["epochs"]
    with pytest.raises(ValueError, match="different budgets"):
        write_reproduction_record([dict(res, seed=0), dict(longer, seed=1)], tmp_path / "rep2")
    record_md = (tmp_path / "rep" / "reproduce.md").read_text()
    clean_row = next(line for line in record_md.splitlines() if line.startswith("| vision clean top-1 % |"))
    paired = 100 * v["models"]["pid"]["robustness"]["clean"]["top1"] - 100 * v["models"]["softmax"]["robustness"]["clean"]["top1"]
    assert clean_row.split("|")[4].strip() == f"{paired:+.3f} +- 0.000"  # PID - softmax, paired by seed
    assert (tmp_path / "rep" / "reproduce.png").read_bytes()[:4] == b"\x89PNG"
