"""The fine-tuning examples of docs/finetuning.md, shortened, on the real SmolLM2-135M weights (one dequantized cache
for every run)."""
import json
from pathlib import Path

import pytest
from pyexec import run_python_script

pytest.importorskip("transformers")
pytest.importorskip("timm")

# slow; on one xdist worker with test_hf's SmolLM2 test: the session reads the GGUF file once (tests/conftest.py)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("smollm2")]

REPO = Path(__file__).resolve().parents[2]
SHORT_LM = ["--batch", "1", "--block", "32", "--valid-blocks", "1", "--steps", "2"]


@pytest.fixture(scope="module")
def cache(smollm2_cache):
    """The session's dequantized safetensors copy of SmolLM2-135M (written once by load_smollm2)."""
    return smollm2_cache


def run(args, cwd):
    """``python example.py args`` (forked from tests/pyexec.py's zygote: the zoos imported once, not per command)."""
    proc = run_python_script(*args, cwd=cwd, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_finetune_example_with_warm_up_and_learnable_gains(cache, tmp_path):
    out = tmp_path / "out"
    log = run([str(REPO / "examples" / "finetune_smollm2_pid.py"), *SHORT_LM, "--warmup-steps", "4",
               "--gain-scale", "0.1", "--learnable", "--cache", str(cache), "--out", str(out)], tmp_path)
    assert "fine-tune" in log  # the progress bar
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert set(runs) == {"softmax", "pid"}
    # warm-up: the PID model starts as the pretrained softmax model
    assert runs["pid"]["valid_ppl_before"] == pytest.approx(runs["softmax"]["valid_ppl_before"], rel=1e-6)


def test_finetune_study_lm_and_vision_records(cache, tmp_path):
    out = tmp_path / "study"
    run([str(REPO / "examples" / "finetune_study.py"), "lm", *SHORT_LM, "--warmup-steps", "2", "--scales", "0.1",
         "--first-layer-scale", "0.1", "--cache", str(cache), "--out", str(out / "lm")], tmp_path)
    lm = json.loads((out / "lm" / "lm.json").read_text())
    assert set(lm["arms"]) == {"softmax", "pid_x0.1", "pid_x0.1_reference_first_layer", "pid_learnable_from_zero"}
    soft = lm["arms"]["softmax"]
    for name, r in lm["arms"].items():
        assert r["valid_ppl_before"] == pytest.approx(soft["valid_ppl_before"], rel=1e-6), name  # t = 0: stock
        assert r["valid_ppl_after"] > 1 and r["valid_ppl_after_20pct_substituted"] > 1
        assert (r["warmup_counter_after"] == 2) == (name != "softmax")  # one count per training forward
    assert lm["arms"]["pid_x0.1"]["valid_ppl_switched_on_at_once"] != soft["valid_ppl_before"]
    gains = lm["arms"]["pid_learnable_from_zero"]["learned_gains"]
    assert len(gains["lambda_p"]) == 30 and all(g > 0 for g in gains["lambda_i"])
    assert "Largest `lm` gain scale" in (out / "lm" / "lm.md").read_text()

    run([str(REPO / "examples" / "finetune_study.py"), "vision", "--pretrain-epochs", "0.002", "--continue-epochs",
         "0.004", "--warmup-steps", "2", "--test-limit", "10", "--out", str(out / "vision")], tmp_path)
    # batches of 128: on Fashion-MNIST (60000 images) one pretraining step and two continued steps (on the digits
    # fallback, one each); every model evaluated on 10 test images
    vision = json.loads((out / "vision" / "vision.json").read_text())
    assert set(vision["models"]) == {"pretrained_softmax", "softmax", "pid_warmup", "pid_switched_on_at_once"}
    assert vision["models"]["pid_warmup"]["warmup_counter_after"] == vision["models"]["pid_warmup"]["train_steps"]
    png = run([str(REPO / "examples" / "finetune_study.py"), "plot", "--lm", str(out / "lm" / "lm.json"),
               "--vision", str(out / "vision" / "vision.json"), "--out", str(out / "plot.png")], tmp_path)
    assert (out / "plot.png").stat().st_size > 10_000, png
