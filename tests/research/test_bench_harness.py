"""The benchmark harness (bench/): what `make bench` measures must be measured right.

Speed itself is not asserted here (the standards keep timings out of unit tests); these tests check the
method: interleaving, the peak-memory reading, target verdicts and the report.
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


harness = load("_harness")


def test_interleaved_alternates_and_counts():
    calls = []
    r = harness.interleaved(lambda: calls.append("s"), lambda: calls.append("p"), reps=6, warmup=2)
    assert calls[:4] == ["s", "p", "s", "p"]  # warm-up pairs
    timed = calls[4:]
    assert timed.count("s") == timed.count("p") == 6
    # the order of each pair flips every repetition, so neither side always runs first
    pairs = [tuple(timed[i:i + 2]) for i in range(0, 12, 2)]
    assert pairs[0] == ("s", "p") and pairs[1] == ("p", "s")
    assert r["reps"] == 6 and r["ratio_of_medians"] == pytest.approx(r["pid_s"] / r["stock_s"])
    assert r["ratio"] > 0


@pytest.mark.slow
def test_peak_memory_sees_a_known_allocation():
    n = 1_000_000  # 4 MB of float32

    def one_buffer():
        torch.empty(n).fill_(1.0)

    def two_live_buffers():
        a = torch.empty(n).fill_(1.0)
        b = torch.empty(n).fill_(2.0)
        return (a + b).sum()  # a third buffer of n while a and b are alive

    one, three = harness.peak_memory_bytes(one_buffer), harness.peak_memory_bytes(two_live_buffers)
    assert 4 * n <= one < 4.5 * n
    assert 12 * n <= three < 13 * n


def test_verdicts_and_markdown(tmp_path):
    run_all = load("run_all")
    assert run_all.verdict("time", 1.02) == ("<= 1.03", True)
    assert run_all.verdict("time", 1.05) == ("<= 1.03", False)
    assert run_all.verdict("tokens/s", 0.98) == (">= 0.97", True)
    assert run_all.verdict("memory", 1.2)[1] is False
    assert run_all.verdict(None, 3.0) == ("", None)
    rows = [
        dict(section="timm", workload="w1", threads=1, stock_s=0.1, pid_s=0.102, ratio=1.02, target="<= 1.03",
             met=True, ratio_of_medians=1.02, ratio_of_minima=1.01),
        dict(section="hf", workload="decode", threads=1, unit="tokens/s", stock_s=1.0, pid_s=1.1, ratio=1 / 1.1,
             stock_tokens_per_s=100.0, pid_tokens_per_s=90.9, target=">= 0.97", met=False, ratio_of_medians=1.1,
             ratio_of_minima=1.25),
        dict(section="core", workload="N=64", threads=1, seq=64, stock_s=1.0, pid_s=1.1, ratio=1.1, target="",
             met=None),
        dict(section="core", workload="N=4096", threads=1, seq=4096, stock_s=1.0, pid_s=1.01, ratio=1.01,
             target="", met=None),
    ]
    result = dict(machine=harness.machine(), started="now", elapsed_s=1.0, quick=True, malloc="tuned", rows=rows)
    text = run_all.write_markdown(str(tmp_path / "bench.md"), result)
    assert "| w1 | 1 | 100.0 ms | 102.0 ms | 1.020 | <= 1.03 | yes | 1.020 | 1.010 |" in text
    assert "| decode | 1 | 100 tok/s | 91 tok/s | 0.909 | >= 0.97 | **no** | 0.909 | 0.800 |" in text
    assert "N=64: 1.100, N=4096: 1.010; the overhead falls" in text
    json.dumps(result, default=str)


def test_vllm_rows_say_not_run_without_vllms_environment(tmp_path):
    import argparse

    run_all = load("run_all")
    args = argparse.Namespace(threads=[1, 2], quick=True, tmp=str(tmp_path), vllm_python=str(tmp_path / "none"))
    rows = run_all.vllm_rows(args)  # no such python: nothing runs
    assert [(r["section"], r["not_run"], r["target"]) for r in rows] == [
        ("vllm", "not run (make test-vllm builds .venv-vllm)", ""),
        ("vllm", "not run (make test-vllm builds .venv-vllm)", ">= 0.95")]
    served = dict(section="vllm", workload="vLLM w", threads=2, unit="tokens/s", stock_tokens_per_s=100.0,
                  pid_tokens_per_s=96.0, ratio=0.96, target=">= 0.95", met=True)
    result = dict(machine=harness.machine(), started="now", elapsed_s=1.0, quick=True, malloc="tuned",
                  rows=rows + [served])
    text = run_all.write_markdown(str(tmp_path / "bench.md"), result)
    assert "| vLLM SmolLM2-135M shape, pid, torch.compile | 2 | not run (make test-vllm builds .venv-vllm) |" in text
    assert "| vLLM w | 2 | 100 tok/s | 96 tok/s | 0.960 | >= 0.95 | yes |" in text
    assert "vLLM rows (bench/vllm_serving.py" in text


def test_size_rows_run_once_at_the_first_thread_count():
    import argparse

    run_all = load("run_all")
    args = argparse.Namespace(quick=False, threads=[1, 2], all_threads=False, only={"size"}, tmp="/nonexistent")
    tasks = run_all.build_tasks(args)  # builds nothing: each task's models are made when it runs
    names = [(name, kind, threads) for _, name, kind, threads, _ in tasks]
    assert names == [
        ("timm deit_small_patch16_224 b8 forward+backward", "time", 1),
        ("timm deit_small_patch16_224 b8 forward+backward, torch.compile", "compiled", 1),
        ("timm deit_base_patch16_224 b8 forward+backward", "time", 1),
        ("timm deit_base_patch16_224 b8 forward+backward, torch.compile", "compiled", 1),
        ("hf Llama 12 layers hidden 768 (GQA 12/4) train step b2x128", "time", 1),
    ]
    # the big models get fewer repetitions than deit_small
    reps = [build.__defaults__[-1] for *_, build in tasks]
    assert reps[0] > reps[2] and reps[4] <= 3 and max(reps) <= 3


def test_host_section_has_compiled_rows_for_every_method_with_issue_66_targets():
    """make bench's host section: every method at both tiny shapes, eager then both models compiled; the compiled
    rows carry issue 66's bounds and the host table shows them in their own columns."""
    run_all = load("run_all")
    host_cost = load("host_cost")

    class Args:
        quick = True

    rows = run_all.host_tasks(Args())
    methods = [m for m, _ in host_cost.DECODE_METHODS]
    assert {(shape, method, compiled) for shape, method, _, _, compiled in rows} == {
        (shape, method, compiled) for shape in ("decode", "train") for method in methods for compiled in (False, True)}
    assert host_cost.target("decode", "pid", compiled=True) == 0.97
    assert host_cost.target("decode", "elliptical", compiled=True) == 0.90
    assert host_cost.target("train", "twicing", compiled=True) == 1.10
    assert host_cost.target("train", "value_residual", compiled=True) == 1.02
    assert host_cost.target("train", "pid") == 1.07  # the eager bound is unchanged
    fake = [dict(method="pid", shape=shape, compiled=compiled, ratio=ratio, us_per_layer_step=1.0,
                 bound=host_cost.target(shape, "pid", compiled))
            for shape, compiled, ratio in (("decode", False, 0.9), ("train", False, 1.1), ("decode", True, 0.98),
                                           ("train", True, 1.05))]
    line = [l for l in host_cost.markdown(fake).splitlines() if l.startswith("| pid ")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == "0.980 (>= 0.97)" and cells[5] == "1.050 (<= 1.02 **no**)", cells


#: make bench's sections whose workloads the set-up test runs (vllm: its own environment; ops: counted, not run)
#: (size: deit_base's steps, a minute of one worker, in the integration tier; its set-up is the timm section's)
SETUP_SECTIONS = ("timm", "fan", "mmseg", "hf", "fairseq", "core", "compile", "memory", "host",
                  pytest.param("size", marks=pytest.mark.integration))


@pytest.mark.slow
@pytest.mark.parametrize("section", SETUP_SECTIONS)
def test_every_section_sets_up_and_runs_one_step(section, tmp_path, monkeypatch):
    """`make bench` as a user runs it, in a quick mode: each section's models are built, their weights shared, and
    each workload's stock and method step run once (the compiled rows with dynamo's eager backend: inductor's code is
    the compile tests'; generation with short prompts), so a change to the models cannot break the bench unseen (its
    mmseg row once stopped every row after it). Nothing is timed."""
    import argparse
    import functools

    run_all = load("run_all")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    runs = run_all.hf_runs
    monkeypatch.setattr(run_all, "hf_runs", lambda batch, seq, new_tokens, **kw: runs(batch, min(seq, 16), 2, **kw))
    args = argparse.Namespace(quick=True, threads=[1], all_threads=False, only={section}, tmp=str(tmp_path))
    if section == "host":
        host_cost = load("host_cost")
        for shape in ("decode", "train"):
            assert host_cost.measure(shape, "pid", reps=1)["ratio"] > 0
        return
    if section == "memory":
        args.only = set(run_all.SECTIONS)
        tasks = [(name, lambda build=build: (*build(), None)) for name, build in run_all.memory_tasks(args)]
        assert len(tasks) == 5
    else:
        tasks = [(name, build) for _, name, _, _, build in run_all.build_tasks(args)]
        assert tasks
    for name, build in tasks:
        stock, method, _ = build()
        stock(), method()
