"""The study's arms and its record: arms share the softmax model's initial weights; the paired statistics are right."""
import json
from pathlib import Path

import pytest
import torch

from zoo_cases import weights as zc_weights

from research.experiments import ARMS, VisionSpec, arm_config, vision_models
from research.study import write_study_record

REPO = Path(__file__).resolve().parents[2]  # python -m research runs from the repository root


def test_arm_configs():
    assert arm_config("softmax", "deit") is None
    assert arm_config("pid", "deit").control_first_layer and arm_config("pid", "deit").gains == (0.8, 0.5, 0.05, 0.1)
    ref = arm_config("pid_ref", "deit")
    assert not ref.control_first_layer and ref.gains == (0.8, 0.5, 0.05, 0.1)
    assert arm_config("neutreno", "deit").gains == (0.6, 0.0, 0.0, 1.0)
    assert arm_config("neutreno", "lm", language=True).gains == (0.4, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="unknown arm"):
        arm_config("pidd", "deit")


def test_every_arm_starts_from_the_softmax_weights_and_differs_as_its_rule_says():
    timm = pytest.importorskip("timm")  # noqa: F841
    spec = VisionSpec(img_size=16, patch_size=4, embed_dim=24, depth=3, num_heads=2, arms=ARMS)
    models = vision_models(spec, num_classes=10)
    assert list(models) == list(ARMS)
    base = models["softmax"].state_dict()
    x = torch.randn(2, 1, 16, 16)
    first = {}
    for arm, model in models.items():
        assert all(torch.equal(base[k], v) for k, v in zc_weights(model.state_dict()).items())
        with torch.no_grad():
            first[arm] = model.forward_intermediates(x, indices=[0], intermediates_only=True)[0]
    # the first block: plain attention for softmax, pid_ref and neutreno (beta = 1: zero error); controlled for pid
    assert torch.equal(first["pid_ref"], first["softmax"]) and torch.equal(first["neutreno"], first["softmax"])
    assert not torch.allclose(first["pid"], first["softmax"])
    with pytest.raises(ValueError, match="must start with 'softmax'"):
        vision_models(VisionSpec(arms=("pid", "softmax")), num_classes=10)


def _fake_run(path, seed, top1):
    models = {arm: {"robustness": {"clean": {"top1": t}, "fgsm": {"eps": [0.0, 1 / 255], "top1": [t, t / 2]},
                                   "pgd": {"eps": [0.0, 1 / 255], "top1": [t, t / 4]}, "noise": {"top1": [t]},
                                   "corruptions": {"mean_corruption_error": 1 - t, "mce_vs_softmax": 100.0}},
                    "collapse": {"mean_cosine": [0.1, 0.2]}, "train_seconds": 1.0}
              for arm, t in top1.items()}
    res = {"spec": {"depth": 2, "epochs": 1.0, "train_limit": 10, "patch_size": 7, "noise_sigmas": [0.3]},
           "models": models}
    (path / f"seed{seed}").mkdir(parents=True)
    (path / f"seed{seed}" / "results.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_record_pairs_by_seed_and_marks_only_what_is_beyond_noise(tmp_path):
    folder = tmp_path / "vision_depth2"
    # pid is 2 points better in every seed although seeds differ by 20 points: beyond noise when paired;
    # pid_ref is +1, -1, +3: not beyond noise
    for seed, (s, p, r) in enumerate([(0.5, 0.52, 0.51), (0.7, 0.72, 0.69), (0.6, 0.62, 0.63)]):
        _fake_run(folder, seed, {"softmax": s, "pid": p, "pid_ref": r})
    record = write_study_record(tmp_path)
    clean = record["settings"]["vision_depth2"]["summary"]["vision clean top-1 %"]["paired_vs_softmax"]
    assert clean["pid"]["mean"] == pytest.approx(2.0) and clean["pid"]["std"] == pytest.approx(0.0, abs=1e-9)
    assert clean["pid"]["beyond_noise"]
    assert clean["pid_ref"]["mean"] == pytest.approx(1.0) and not clean["pid_ref"]["beyond_noise"]
    md = (tmp_path / "study.md").read_text()
    assert "**+2.000 +- 0.000**" in md and "| +1.000 +- 2.000 |" in md


@pytest.mark.integration
@pytest.mark.slow
def test_study_command_runs_end_to_end_and_refuses_bad_arms(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "research", "study", "--out", str(out), "--seeds", "0", "1", "--depths", "2",
           "--arms", "softmax,pid_ref", "--parts", "vision", "--data", "digits", "--train-limit", "64",
           "--test-limit", "16", "--pgd-steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "study.json").read_text())
    setting = record["settings"]["vision_depth2"]
    assert setting["seeds"] == [0, 1] and setting["arms"] == ["softmax", "pid_ref"]
    assert (out / "study.png").stat().st_size > 0 and "pid_ref - softmax" in (out / "study.md").read_text()
    bad = subprocess.run(cmd[:5] + [str(tmp_path / "bad"), "--arms", "pid,softmax"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.startswith("research: error: --arms")
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_demo_option_gives_the_pid_models_a_reference_only_first_layer():
    from dataclasses import replace

    from research.cli import build_parser
    from research.demo import demo_specs

    vision, language = demo_specs(True, control_first_layer=False)
    assert not vision.control_first_layer and not language.control_first_layer
    assert arm_config("pid", "deit", False, vision.control_first_layer).control_first_layer is False
    # the cache key tells the two conventions apart (the model file is vision_pid either way)
    assert vision.training_key() != replace(vision, control_first_layer=True).training_key()
    assert language.training_key() != replace(language, control_first_layer=True).training_key()
    args = build_parser().parse_args(["demo", "--pid-first-layer", "reference"])
    assert args.pid_first_layer == "reference"


def test_arm_specs_name_any_registered_method_with_its_parameters():
    import toy_method  # noqa: F401  (registers scaled_reference)

    from research.experiments import arm_choice, arm_record, parse_arm, split_arms

    arms = split_arms('softmax,pid,scaled_reference,sr2=scaled_reference:{"gamma": 2, "x": [1, 2]},p5=pid:strong')
    assert arms == ("softmax", "pid", "scaled_reference", 'sr2=scaled_reference:{"gamma": 2, "x": [1, 2]}',
                    "p5=pid:strong")
    assert parse_arm("scaled_reference") == ("scaled_reference", "scaled_reference", None)
    assert parse_arm('sr2=scaled_reference:{"gamma": 2}') == ("sr2", "scaled_reference", {"gamma": 2})
    assert arm_record("scaled_reference", "deit") == {"method": "scaled_reference", "attention_cfg": {"gamma": 0.5}}
    assert arm_record("sr=scaled_reference:strong", "deit")["attention_cfg"] == {"gamma": 2.0}
    # a pid method arm starts from the spec's preset; the built-in arms are PID gains as before
    assert arm_choice('p=pid:{"lambda_p": 0.3}', "deit").config.gains == (0.3, 0.5, 0.05, 0.1)
    assert arm_record("neutreno", "deit") == arm_record('n=pid:{"lambda_p": 0.6, "lambda_i": 0, "lambda_d": 0, '
                                                        '"beta": 1}', "deit")
    for bad, message in [("sr=scaled_reference:[1]", "a JSON object of parameters or a preset name"),
                         ("sr=scaled_reference:nope", "preset 'nope'"), ("1x=scaled_reference", "Python identifier"),
                         ("pid_ref=scaled_reference", "built-in arm"), ("sr=softmax", "unknown arm")]:
        with pytest.raises(ValueError, match=message):
            arm_choice(bad, "deit")
    # the cache key covers the method arms' methods and parameters (the built-in arms' gains as before)
    spec = VisionSpec(arms=("softmax", "pid", "sr=scaled_reference"))
    keys = {spec.training_key(), VisionSpec(arms=("softmax", "pid", "sr=scaled_reference:strong")).training_key(),
            VisionSpec(arms=("softmax", "pid")).training_key()}
    assert len(keys) == 3
    assert VisionSpec(arms=("softmax", "pid_ref")).training_key() == VisionSpec(arms=("softmax", "pid")).training_key()


@pytest.mark.slow
def test_study_compares_softmax_pid_and_a_registered_method(tmp_path, capsys):
    """The study with a method the test registers, on a tiny budget: every arm trained from the softmax weights,
    the record names each arm's method, a rerun loads the cached models, and a changed parameter retrains."""
    timm = pytest.importorskip("timm")  # noqa: F841
    import toy_method  # noqa: F401

    from research.cli import main

    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--seeds", "0", "--depths", "2", "--parts", "vision", "--data", "digits",
            "--train-limit", "32", "--test-limit", "8", "--pgd-steps", "1", "--vision-epochs", "0.5"]
    arms = 'softmax,pid,sr=scaled_reference:{"gamma": 2}'
    assert main([*argv, "--arms", arms]) == 0
    setting = json.loads((out / "study.json").read_text())["settings"]["vision_depth2"]
    assert setting["arms"] == ["softmax", "pid", "sr"]
    assert setting["methods"]["sr"] == {"method": "scaled_reference", "attention_cfg": {"gamma": 2.0}}
    assert setting["methods"]["softmax"]["method"] == "softmax" and setting["methods"]["pid"]["method"] == "pid"
    results = json.loads((out / "vision_depth2" / "seed0" / "results.json").read_text())
    assert results["models"]["sr"]["method"] == "scaled_reference"
    assert "`sr` = `scaled_reference` {\"gamma\": 2.0}" in (out / "study.md").read_text()
    assert "| sr - softmax |" in (out / "study.md").read_text()
    capsys.readouterr()
    assert main([*argv, "--arms", arms]) == 0
    assert "vision sr: loaded the cached model" in capsys.readouterr().err
    assert main([*argv, "--arms", 'softmax,pid,sr=scaled_reference:{"gamma": 1}']) == 0
    assert "vision sr: loaded" not in capsys.readouterr().err  # another parameter: trained again


@pytest.mark.slow
def test_study_arms_take_value_residual(tmp_path, capsys):
    """``value_residual`` as a study arm (fixed and learnable lambdas): resolved in both parts' zoos, a bad parameter
    refused before anything runs, and a tiny vision study trains and records it."""
    pytest.importorskip("timm")
    from pid_plugins.core.siblings.value_residual import ValueResidualConfig
    from research.cli import main
    from research.experiments import arm_choice, arm_record, check_arms

    assert arm_record("value_residual", "deit") == {
        "method": "value_residual", "attention_cfg": {"lambda_1": 0.5, "lambda_2": 0.5, "learnable": False}}
    assert arm_choice('vr=value_residual:{"lambda_1": 0.25}', "lm", language=True).config == ValueResidualConfig(
        lambda_1=0.25)
    assert arm_choice("vr=value_residual:resformer", "deit").config == ValueResidualConfig()
    check_arms(("softmax", "pid", "vr=value_residual", 'vrl=value_residual:{"learnable": true}'))
    with pytest.raises(ValueError, match="lambda_1 must be a finite number"):
        arm_choice('vr=value_residual:{"lambda_1": NaN}', "deit")
    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--seeds", "0", "--depths", "2", "--parts", "vision", "--data", "digits",
            "--train-limit", "32", "--test-limit", "8", "--pgd-steps", "1", "--vision-epochs", "0.5"]
    assert main([*argv, "--arms", 'softmax,vr=value_residual:{"lambda_3": 1}']) == 2
    assert "--arms: arm 'vr=value_residual:{\"lambda_3\": 1}': unknown ValueResidualConfig field" in \
        capsys.readouterr().err
    assert main([*argv, "--arms", 'softmax,pid,vr=value_residual,vrl=value_residual:{"learnable": true}']) == 0
    setting = json.loads((out / "study.json").read_text())["settings"]["vision_depth2"]
    assert setting["arms"] == ["softmax", "pid", "vr", "vrl"]
    assert setting["methods"]["vr"] == {"method": "value_residual",
                                        "attention_cfg": {"lambda_1": 0.5, "lambda_2": 0.5, "learnable": False}}
    assert setting["methods"]["vrl"]["attention_cfg"]["learnable"] is True
    results = json.loads((out / "vision_depth2" / "seed0" / "results.json").read_text())
    assert results["models"]["vr"]["method"] == results["models"]["vrl"]["method"] == "value_residual"
    assert "| vr - softmax |" in (out / "study.md").read_text()


def test_records_written_before_arms_named_their_method_still_aggregate(tmp_path):
    import shutil
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "docs" / "reproduce" / "study"
    for folder in ("vision_depth6", "language"):
        shutil.copytree(committed / folder, tmp_path / folder)
    record = write_study_record(tmp_path)
    methods = record["settings"]["vision_depth6"]["methods"]
    assert methods["softmax"] == {"method": "softmax", "attention_cfg": None}
    assert methods["neutreno"]["attention_cfg"]["lambda_p"] == 0.6 and methods["pid_ref"]["method"] == "pid"
    assert not methods["pid_ref"]["attention_cfg"]["control_first_layer"]
    assert record["settings"]["language"]["methods"]["pid"]["attention_cfg"]["lambda_p"] == arm_config("pid", "lm").lambda_p
