"""The demo/reproduce model cache: the key inside the weights file, atomic writes, retraining of damaged or
mismatched caches, one run per output folder, seeds counted once."""
import json
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

import research.experiments as ex
from research.cli import main

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402


@dataclass
class Spec:
    seed: int = 0

    def training_key(self) -> str:
        return f"key-{self.seed}"


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def train_fn(model, calls):
    def train():
        calls.append(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        return {"train_loss": [1.0, 0.5], "train_seconds": 0.1, "steps": 2}

    return train


def trained(path, seed, logs, calls):
    model = make_model(seed)
    info = ex._trained(model, path, Spec(seed), train_fn(model, calls), logs.append)
    return model, info


def test_key_and_info_live_inside_the_weights_file(tmp_path):
    path, logs, calls = tmp_path / "m.safetensors", [], []
    model, info = trained(path, 0, logs, calls)
    assert calls == [1] and not info["cached"]
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["training_key"] == "key-0"
    assert json.loads(meta["info"])["train_loss"] == [1.0, 0.5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no side file, no temporary left
    again, info2 = trained(path, 0, logs, calls)
    assert calls == [1] and info2["cached"] and "loaded the cached model" in logs[-1]
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_weights_of_another_key_are_retrained(tmp_path):
    """The issue's case: seed-1 weights where the seed-0 model belongs."""
    logs, calls = [], []
    trained(tmp_path / "seed1.safetensors", 1, logs, calls)
    (tmp_path / "seed1.safetensors").rename(tmp_path / "m.safetensors")
    model, info = trained(tmp_path / "m.safetensors", 0, logs, calls)
    assert calls == [1, 1] and not info["cached"]
    assert "trained with another spec or code (key key-1, now key-0); retraining" in logs[-1]
    reference = make_model(0)
    train_fn(reference, [])()
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)  # trained from its own initial weights, not from the wrong cache


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "other model"])
def test_damaged_cache_is_retrained_with_a_message(tmp_path, damage):
    path, logs, calls = tmp_path / "m.safetensors", [], []
    trained(path, 0, logs, calls)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 10])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64 + data[64:])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # the right key on tensors of another shape
        from safetensors.torch import save_file

        save_file({"0.weight": torch.zeros(1)}, str(path), metadata={"training_key": "key-0", "info": "{}"})
    model, info = trained(path, 0, logs, calls)
    assert calls == [1, 1] and not info["cached"]
    assert "the cached model is damaged or incomplete" in logs[-1] and "retraining" in logs[-1]
    _, info = trained(path, 0, logs, calls)  # and the rewritten cache is good
    assert info["cached"] and calls == [1, 1]


def test_a_run_killed_while_saving_leaves_the_old_cache_intact(tmp_path, monkeypatch):
    path, logs, calls = tmp_path / "m.safetensors", [], []
    trained(path, 0, logs, calls)
    before = path.read_bytes()

    def killed(*args, **kwargs):
        with open(args[1], "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        trained(path, 1, logs, calls)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_training_key_covers_gains_and_code(monkeypatch):
    spec = ex.VisionSpec()
    key = spec.training_key()
    assert replace(spec, seed=1).training_key() != key
    assert ex.LanguageSpec().training_key() != ex.LanguageSpec(preset="deit").training_key()
    from pid_plugins.core import PIDConfig

    original = PIDConfig.preset.__func__

    def other_gains(cls, name, **overrides):
        return original(cls, name, **{"lambda_p": 0.123, **overrides})

    with monkeypatch.context() as m:
        m.setattr(PIDConfig, "preset", classmethod(other_gains))
        assert spec.training_key() != key  # same preset name, other gain values
    assert spec.training_key() == key

    def _train_classifier(clf, train, spec, label, log):  # another training loop
        return {}

    with monkeypatch.context() as m:
        m.setattr(ex, "_train_classifier", _train_classifier)
        assert spec.training_key() != key


@pytest.mark.integration
@pytest.mark.slow
def test_concurrent_runs_into_one_folder_are_refused(tmp_path, capsys):
    out = tmp_path / "demo"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from research.experiments import output_lock\n"
         f"with output_lock({str(out)!r}):\n    print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code = main(["demo", "--parts", "core", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2
        assert f"research: error: another pid-plugins run (pid {holder.pid}) is writing into {out}" in err
        assert not (out / "report.md").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["demo", "--parts", "core", "--out", str(out)]) == 0  # the lock went with the process
    assert (out / "report.md").is_file()
    with ex.output_lock(out):
        with pytest.raises(ValueError, match="another pid-plugins run"):
            with ex.output_lock(out):
                pass


def test_aggregate_counts_each_seed_once(tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, seeds in ((a, (0, 1)), (b, (1, 2)), (c, (1,))):
        for seed in seeds:
            (folder / f"seed{seed}").mkdir(parents=True)
            extra = {"note": "other run"} if folder == c else {}
            (folder / f"seed{seed}" / "results.json").write_text(json.dumps({"seed": seed, **extra}))
    assert main(["reproduce", "--aggregate", str(a), str(b), str(a), "--out", str(tmp_path / "rec")]) == 0
    captured = capsys.readouterr()
    assert "seed 1: identical results in 2 folders, counted once" in captured.err
    assert json.loads((tmp_path / "rec" / "reproduce.json").read_text())["seeds"] == [0, 1, 2]
    assert main(["reproduce", "--aggregate", str(a), str(c), "--out", str(tmp_path / "rec2")]) == 2
    err = capsys.readouterr().err
    assert "research: error: seed 1 has different results in" in err and "each seed counts once" in err
    from research.demo import write_reproduction_record

    with pytest.raises(ValueError, match=r"seed\(s\) \[1\] appear more than once"):
        write_reproduction_record([{"seed": 1}, {"seed": 1}], tmp_path / "rec3")


def test_report_says_what_the_training_times_are():
    from research.demo import TIMING_NOTE, language_rows

    lang = {"spec": {"rates": [0.0, 0.1]}, "models": {
        k: {"valid_perplexity": 2.0, "bits_per_byte": 1.0, "robustness": {"perplexity": [2.0, 3.0]},
            "collapse": {"mean_cosine": [0.1, 0.2]}, "train_seconds": t, "cached": cached}
        for k, t, cached in (("softmax", 120.0, False), ("pid", 348.0, True))}}
    row = [r for r in language_rows(lang) if r[0].startswith("training wall time")]
    assert row == [("training wall time (sequential, see note)", "120 s", "348 s (cached)")]
    assert "not a speed comparison" in TIMING_NOTE and "make bench" in TIMING_NOTE


def test_a_run_that_writes_nothing_leaves_no_folder(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with ex.output_lock(out):
            raise RuntimeError("failed before writing anything")
    assert not out.exists()
    with ex.output_lock(out):
        (out / "result.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == [ex.LOCK_NAME, "result.json"]


@pytest.mark.slow
def test_real_models_round_trip_through_the_cache(tmp_path):
    """run_vision / run_language on tiny specs: the second run loads every arm from its file, same results."""
    vspec = ex.VisionSpec(data="digits", epochs=0.05, batch_size=64, embed_dim=12, depth=2, num_heads=2, test_limit=32,
                          pgd_steps=1, eps_sweep=(0.0, 2 / 255), noise_sigmas=(0.1,), corruptions=("contrast",),
                          severities=(1,), diag_samples=16)
    lspec = ex.LanguageSpec(corpus="shakespeare", seq_len=32, hidden_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, steps=3, batch_size=4, valid_blocks=4)
    for run, spec, prefix in ((ex.run_vision, vspec, "vision"), (ex.run_language, lspec, "language")):
        logs = []
        first = run(spec, tmp_path, logs.append)
        assert not any("cached" in m for m in logs)
        used = replace(spec, **{k: first["spec"][k] for k in ("img_size", "patch_size") if k in first["spec"]})
        for arm in spec.arms:  # (digits are 8x8: run_vision adapts the image and patch size)
            with safe_open(str(tmp_path / f"{prefix}_{arm}.safetensors"), framework="pt") as f:
                assert f.metadata()["training_key"] == used.training_key()
        logs = []
        second = run(spec, tmp_path, logs.append)
        assert sum("loaded the cached model" in m for m in logs) == len(spec.arms)
        for arm in spec.arms:
            a, b = first["models"][arm], second["models"][arm]
            assert not a["cached"] and b["cached"]
            assert a["train_loss"] == b["train_loss"]
            key = "valid_perplexity" if prefix == "language" else "robustness"
            assert a[key] == b[key]
