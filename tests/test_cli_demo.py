import json
import subprocess
import sys

import pytest

from pid_plugins.cli import main


def test_cli_presets(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "deit" in out and "0.8" in out and "segmenter" in out and "lm" in out


def test_cli_list_runs(capsys):
    assert main(["list"]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_unknown_zoo_is_an_argparse_error():
    with pytest.raises(SystemExit):
        main(["list", "--zoo", "keras"])


def test_cli_bad_preset_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--preset", "nope"]) == 2
    assert "unknown PID preset 'nope'" in capsys.readouterr().err


def test_demo_writes_report_and_shows_collapse(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pid_plugins", "demo", "--out", str(tmp_path)],
                          check=True, capture_output=True, text=True)
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
