"""The benchmark harness (bench/): what `make bench` measures is measured right (interleaving, the peak-memory
reading; no timing is asserted), and every section sets up and runs (its report's layout is the bench's own)."""
import importlib.util
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


#: make bench's sections whose workloads the set-up test runs (vllm: its own environment; ops: counted, not run)
#: (size: deit_base's steps, a minute of one worker, in the integration tier; its set-up is the timm section's)
SETUP_SECTIONS = ("timm", "fan", "mmseg", "hf", "fairseq", "core", "compile", "memory", "host", "floor",
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
    if section == "floor":  # the references' logits equal the plugin's; every row measured
        rows = load("eager_reference").floor_rows(runs=1, reps=1, train_reps=2)
        assert [r["method"] for r in rows] == ["pid (decoding)", "neutreno (decoding)", "pid (training)"]
        assert all(r["plugin"] > 0 and r["reference"] > 0 for r in rows)
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
