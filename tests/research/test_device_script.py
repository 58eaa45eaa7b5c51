"""The prepared device run (bench/device/run.sh, gpu_bench.py) dry-run on the CPU with tiny shapes: the whole script,
its install step, one device test and every bench row, so the run on a lent GPU cannot fail on a typo."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.slow
def test_the_device_run_dry_runs_on_the_cpu_with_every_row(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    import pid_plugins

    out = tmp_path / "out"
    # (without this run's pytest-xdist variables: the script's own pytest is no worker of this one)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "DEVICE": "cpu", "OUT": str(out), "PYTHON": sys.executable, "SITE": str(tmp_path / "site"),
           "WHEELS": str(tmp_path / "no-wheels"), "WORKERS": "0",
           "PYTEST_ARGS": "-k 'switched_off and pid-hf-llama'", "BENCH_ARGS": "--tiny --compile-backend eager",
           "OMP_NUM_THREADS": "1"}
    proc_started = time.time()
    proc = subprocess.run(["bash", str(REPO / "bench/device/run.sh")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["env.txt", "gpu_bench.json", "gpu_bench.log", "gpu_bench.md", "gpu_profile.txt", "run.log",
                     "test_device.log", "test_device.xml"]
    assert len(files) <= 8  # the device tool brings back at most 8 files
    # installed: the project, --no-deps, into SITE (first on PYTHONPATH); torch stays this environment's
    assert (tmp_path / "site" / "pid_plugins" / "__init__.py").is_file()
    env_txt = (out / "env.txt").read_text()
    assert re.search(r"^torch \S+ ", env_txt, re.M) and "MISSING" not in env_txt
    assert f"pid_plugins {pid_plugins.__version__} " in env_txt
    assert (tmp_path / "site" / f"pid_plugins-{pid_plugins.__version__}.dist-info").is_dir()
    assert not (REPO / "build").exists() or (REPO / "build").stat().st_mtime < proc_started
    # the suite ran on the device asked for, one test selected, passed
    log = (out / "test_device.log").read_text()
    assert re.search(r"\b1 passed\b", log) and "failed" not in log, log[-2000:]
    assert 'tests="1"' in (out / "test_device.xml").read_text()
    # every row: each method's DeiT and Llama training step, decoding b1 and b8, and PID's compiled static-cache row,
    # each measured
    result = json.loads((out / "gpu_bench.json").read_text())
    assert result["environment"]["device"] == "cpu" and result["shapes"] == "tiny"
    rows = {(r["workload"], r["method"]): r for r in result["rows"]}
    # the methods a fresh process has (this pytest process may hold toy methods other tests registered)
    shipped = subprocess.run([sys.executable, "-c", "import pid_plugins; print(*pid_plugins.list_methods())"],
                             capture_output=True, text=True, check=True).stdout.split()
    methods = ["pid"] + [m for m in shipped if m != "pid"]
    workloads = ["deit-s train bf16 b2", "llama-1b train bf16 b2x16", "llama-1b decode b1 dynamic eager",
                 "llama-1b decode b8 dynamic eager"]
    want = {(w, m) for w in workloads for m in methods} | {("llama-1b decode b1 static compiled", "pid")}
    assert set(rows) == want
    for key in want:
        r = rows[key]
        assert "skipped" not in r, (key, r)
        assert r["stock_s"] > 0 and r["method_s"] > 0 and r["figure"] > 0 and isinstance(r["met"], bool)
    # the profile of PID's decoding step, stock and PID
    profile = (out / "gpu_profile.txt").read_text()
    assert "## stock:" in profile and "## pid eager:" in profile and "aten::" in profile
    md = (out / "gpu_bench.md").read_text()
    assert all(f"| {w} | {m} |" in md for w, m in rows)
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("[run.sh") and "done: exit 0" in last and "| deit-s train bf16 b2 | pid |" in proc.stdout


def test_make_device_wheels_downloads_the_pins_of_constraints_txt():
    """``make -n device-wheels``: pip download of transformers and timm at constraints.txt's pins, for the device
    image's Python (3.12), into the ignored .device-wheels/."""
    proc = subprocess.run(["make", "-n", "device-wheels"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pins = dict(re.findall(r"^(transformers|timm)==(\S+)$", (REPO / "constraints.txt").read_text(), re.M))
    assert set(pins) == {"transformers", "timm"}
    assert all(f"{name}=={version}" in proc.stdout for name, version in pins.items()), proc.stdout
    assert "--python-version 3.12" in proc.stdout and "--no-deps" in proc.stdout and ".device-wheels" in proc.stdout
    ignored = subprocess.run(["git", "check-ignore", "-q", ".device-wheels/x.whl"], cwd=REPO)
    assert ignored.returncode == 0, ".device-wheels/ must be ignored (it travels with the device tool's carry)"
