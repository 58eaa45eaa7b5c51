"""timm's own scripts on a saved PID DeiT, run as a user runs them through ``pid-plugins run``."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

timm = pytest.importorskip("timm")

pytestmark = pytest.mark.integration

import pid_plugins.timm  # noqa: E402,F401
from tool_cases import ROOT, TOOLS_ENV, check, launch  # noqa: E402

NAME = "pid_deit_tiny_patch16_224"
CLASSES = 3
MODEL_KWARGS = ["img_size=32", "patch_size=8", "depth=2"]
SCRIPTS = Path(os.environ.get("PID_TIMM_SCRIPTS", ROOT / "tests" / "third_party" / "timm_scripts"))


def _build(name: str):
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=CLASSES, img_size=32, patch_size=8, depth=2).eval()


def _transform(model):
    from timm.data import create_transform, resolve_data_config

    return create_transform(**resolve_data_config({"img_size": 32}, model=model))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, checkpoint, {image path: PID logits}, softmax top-1 in %)."""
    from PIL import Image
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("timm_tools")
    pid = _build(NAME)
    transform = _transform(pid)
    rng = torch.Generator().manual_seed(1)
    images = [Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=rng, dtype=torch.uint8).numpy())
              for _ in range(64)]
    batch = torch.stack([transform(image) for image in images])
    with torch.no_grad():  # centre the classes over these images (a random head favours one class)
        pid.head.bias -= pid(batch).mean(0)
    softmax = _build("deit_tiny_patch16_224")
    softmax.load_state_dict({k: v for k, v in pid.state_dict().items() if k in softmax.state_dict()})
    checkpoint = folder / "pid.safetensors"
    save_file(pid.state_dict(), checkpoint)
    with torch.no_grad():
        ours, stock = pid(batch), softmax(batch)
    chosen = {}
    for k in range(CLASSES):  # two images per class, those on which softmax predicts another class first
        mine = [i for i in range(len(images)) if int(ours[i].argmax()) == k]
        mine.sort(key=lambda i: int(stock[i].argmax()) == k)
        assert len(mine) >= 2, f"class {k}: PID predicts it for {len(mine)} of the images"
        chosen[k] = [(images[i], ours[i], int(stock[i].argmax()) != k) for i in mine[:2]]
    logits, softmax_right = {}, 0
    for split in ("validation", "train"):
        for label, items in chosen.items():
            (folder / split / f"c{label}").mkdir(parents=True)
            for n, (image, logit, differs) in enumerate(items):
                image.save(folder / split / f"c{label}" / f"img{n}.png")
                if split == "validation":
                    logits[f"c{label}/img{n}.png"] = logit
                    softmax_right += not differs
    softmax_top1 = 100.0 * softmax_right / len(logits)
    assert softmax_top1 < 100.0, "softmax predicts as PID on every image: the tests could not fail"
    return folder, checkpoint, logits, softmax_top1


def _script(name: str) -> Path:
    path = SCRIPTS / name
    if not path.is_file():
        pytest.fail(f"timm's {name} is not in {SCRIPTS}: PID_TIMM_SCRIPTS names a folder without it (unset it to use "
                    "tests/third_party/timm_scripts)")
    return path


def _model_args(checkpoint: Path):
    return ["--model", NAME, "--checkpoint", checkpoint, "--num-classes", str(CLASSES), "--img-size", "32",
            "--device", "cpu", "--model-kwargs", *MODEL_KWARGS]


PREDICT = """
import json, sys
import timm, torch
from PIL import Image
from timm.data import create_transform, resolve_data_config

model = timm.create_model(sys.argv[1], checkpoint_path=sys.argv[2], num_classes=3, img_size=32, patch_size=8,
                          depth=2).eval()
transform = create_transform(**resolve_data_config({"img_size": 32}, model=model))
with torch.no_grad():
    out = {p: model(transform(Image.open(p).convert("RGB"))[None])[0].tolist() for p in sys.argv[4:]}
json.dump(out, open(sys.argv[3], "w"))
"""


def test_a_script_building_the_pid_model_by_name_computes_pid(case, tmp_path):
    """The route every timm script takes."""
    folder, checkpoint, logits, _ = case
    (tmp_path / "predict.py").write_text(PREDICT)
    images = [folder / "validation" / rel for rel in logits]
    check(launch(["python", "predict.py", NAME, checkpoint, "out.json", *images], tmp_path))
    out = json.loads((tmp_path / "out.json").read_text())
    for rel, ours in logits.items():
        assert torch.allclose(torch.tensor(out[str(folder / "validation" / rel)]), ours, atol=1e-4)
    bare = launch(["python", "predict.py", NAME, checkpoint, "out.json", *images], tmp_path, launcher=False)
    assert bare.returncode != 0 and "Unknown model" in bare.stderr, bare.stderr[-2000:]


@pytest.mark.slow
def test_inference_py_logits_are_pid(case, tmp_path):
    folder, checkpoint, logits, _ = case
    script = _script("inference.py")
    extra = [TOOLS_ENV] if (TOOLS_ENV / ".installed").is_file() else []  # inference.py writes with pandas
    if not extra:
        pytest.importorskip("pandas", reason="timm's inference.py needs pandas (make tools-env installs it)")
    command = ["python", script, folder / "validation", *_model_args(checkpoint), "--topk", str(CLASSES),
               "--output-type", "logit", "--include-index", "--results-dir", tmp_path, "--results-file", "out",
               "--results-format", "json", "--fullname", "--label-type", "none", "--batch-size", "2"]
    check(launch(command, tmp_path, adapters="timm", extra_path=extra))
    rows = json.loads((tmp_path / "out.json").read_text())
    assert len(rows) == len(logits)
    for name, row in rows.items():
        rel = Path(name)
        rel = (rel.relative_to(folder / "validation") if rel.is_absolute() else rel).as_posix()
        got = torch.zeros(CLASSES)
        got[torch.tensor(row["index"])] = torch.tensor(row["logit"], dtype=torch.float32)
        assert torch.allclose(got, logits[rel], atol=1e-4), (rel, got, logits[rel])


def _validate_top1(results: Path) -> float:
    return float(json.loads(results.read_text())["top1"])


@pytest.mark.slow
def test_validate_py_top1_is_pid(case, tmp_path):
    folder, checkpoint, _, softmax_top1 = case
    script = _script("validate.py")
    command = ["python", script, folder, *_model_args(checkpoint), "--batch-size", "2", "--workers", "0",
               "--results-file", tmp_path / "results.json", "--results-format", "json"]
    check(launch(command, tmp_path, adapters="timm"))
    assert _validate_top1(tmp_path / "results.json") == 100.0 != softmax_top1
    stock = ["python", script, folder, *_model_args(checkpoint), "--batch-size", "2", "--workers", "0"]
    stock[stock.index(NAME)] = "deit_tiny_patch16_224"  # the stock name on a PID checkpoint: refused (the record)
    for launcher in (False, True):
        bare = launch(stock, tmp_path, adapters="timm" if launcher else None, launcher=launcher)
        assert bare.returncode != 0 and 'Unexpected key(s) in state_dict: "pid_plugins_method"' in bare.stderr, \
            bare.stderr[-2000:]


@pytest.mark.slow
def test_benchmark_py_builds_the_pid_model(case, tmp_path):
    """benchmark.py exits 0 even when the model cannot be built (the error is inside its JSON): read the JSON."""
    _, checkpoint, _, _ = case
    script = _script("benchmark.py")
    command = ["python", script, "--model", NAME, "--bench", "inference", "--device", "cpu", "--batch-size", "2",
               "--num-classes", str(CLASSES), "--img-size", "32", "--model-kwargs", *MODEL_KWARGS,
               "--num-warm-iter", "1", "--num-bench-iter", "5", "--results-file", tmp_path / "bench.json",
               "--results-format", "json"]
    check(launch(command, tmp_path, adapters="timm"))
    result = json.loads((tmp_path / "bench.json").read_text())
    result = result[0] if isinstance(result, list) else result
    assert "error" not in result and result["model"] == NAME and result["infer_samples_per_sec"] > 0, result
    assert result["param_count"] == pytest.approx(sum(p.numel() for p in _build(NAME).parameters()) / 1e6, abs=0.01)
    check(launch(command, tmp_path, launcher=False))  # exits 0 all the same...
    bare = json.loads((tmp_path / "bench.json").read_text())
    bare = bare[0] if isinstance(bare, list) else bare
    assert "error" in bare, bare  # ...with the refusal inside its JSON


@pytest.mark.slow
def test_train_py_trains_and_evaluates_pid(case, tmp_path):
    """One epoch of train.py at learning rate 0 (`--lr-base 0`: train.py replaces `--lr 0`) from the PID checkpoint."""
    folder, checkpoint, _, softmax_top1 = case
    script = _script("train.py")
    command = ["python", script, "--data-dir", folder, "--model", NAME, "--initial-checkpoint", checkpoint,
               "--num-classes", str(CLASSES), "--img-size", "32", "--model-kwargs", *MODEL_KWARGS, "--device", "cpu",
               "--epochs", "1", "--batch-size", "2", "--validation-batch-size", "2", "--workers", "0", "--opt", "sgd",
               "--lr-base", "0", "--warmup-lr", "0", "--min-lr", "0", "--warmup-epochs", "0", "--weight-decay", "0",
               "--output", tmp_path / "out", "--experiment", "exp", "--no-prefetcher", "--log-interval", "1"]
    check(launch(command, tmp_path, adapters="timm"))
    with open(tmp_path / "out" / "exp" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["eval_top1"]) == 100.0 != softmax_top1, rows
    saved = torch.load(tmp_path / "out" / "exp" / "last.pth.tar", map_location="cpu", weights_only=False)
    _build(NAME).load_state_dict(saved["state_dict"], strict=True)
