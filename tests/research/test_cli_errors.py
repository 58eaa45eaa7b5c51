"""Every mistake a user can make on the command line: one `pid-plugins: error: ...` line (`research: error: ...`
for the experiments' `python -m research`), exit code 2, no traceback, nothing left in --out."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import research.cli
from pid_plugins.cli import main

REPO = Path(__file__).resolve().parents[2]
MMSEG_TINY = "configs/mmseg/segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"
TIMM = ["--model", "deit_tiny_patch16_224", "--model-kwargs",
        '{"img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 12, "depth": 2, "num_heads": 2}']


def _tiny_state():
    import timm

    return timm.create_model("deit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1, num_classes=10,
                             embed_dim=12, depth=2, num_heads=2).state_dict()


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("bad_inputs")
    rng = torch.Generator().manual_seed(0)
    noise = bytes(torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8).tolist())
    (d / "random.pth").write_bytes(noise)
    (d / "random.safetensors").write_bytes(noise)
    state = _tiny_state()
    torch.save(state, d / "good.pth")
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "good.safetensors"))
    for ext in ("pth", "safetensors"):
        data = (d / f"good.{ext}").read_bytes()
        (d / f"truncated.{ext}").write_bytes(data[: len(data) // 2])
    torch.save({"state_dict": state, "x": Evil(d / "pwned")}, d / "evil.pth")
    torch.save({"head.weight": torch.zeros(10, 12)}, d / "other.pth")
    (d / "not_a_folder").write_text("a file")
    images = d / "images" / "cat"
    images.mkdir(parents=True)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + noise[:100])
    (d / "broken_syntax.py").write_text("model = dict(type='EncoderDecoder'\n")
    (d / "broken_model.py").write_text("model = dict(type='NoSuchSegmentor')\n")
    hf = d / "hf_folder"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (d / "empty_runs").mkdir()
    return d


# (id, argv with {d} for the files folder and {out} for a fresh --out, words the error must contain)
CASES = [
    ("random .pth", ["diagnose", *TIMM, "--checkpoint", "{d}/random.pth", "--data", "digits"],
     "cannot read {d}/random.pth as a torch checkpoint"),
    ("truncated .pth", ["diagnose", *TIMM, "--checkpoint", "{d}/truncated.pth", "--data", "digits"],
     "cannot read {d}/truncated.pth as a torch checkpoint"),
    ("random .safetensors", ["diagnose", *TIMM, "--checkpoint", "{d}/random.safetensors", "--data", "digits"],
     "cannot read {d}/random.safetensors as safetensors"),
    ("truncated .safetensors", ["attack", *TIMM, "--checkpoint", "{d}/truncated.safetensors", "--data", "digits"],
     "cannot read {d}/truncated.safetensors as safetensors"),
    ("pickled code in .pth", ["diagnose", *TIMM, "--checkpoint", "{d}/evil.pth", "--data", "digits"],
     "refused to load {d}/evil.pth: not a plain state_dict file"),
    ("pickled code in an mmseg --checkpoint", ["diagnose", "--model", "{repo}/" + MMSEG_TINY, "--checkpoint",
                                              "{d}/evil.pth", "--data", "digits"],
     "cannot build a model from the mmseg config"),
    ("missing checkpoint", ["diagnose", *TIMM, "--checkpoint", "{d}/nope.pth", "--data", "digits"],
     "checkpoint not found: {d}/nope.pth"),
    ("unknown --model-kwargs key", ["diagnose", "--model", "deit_tiny_patch16_224", "--model-kwargs", '{"bogus": 1}',
                                    "--data", "digits"], "--model-kwargs ['bogus'] do not fit deit_tiny_patch16_224"),
    ("--model-kwargs not an object", ["diagnose", "--model", "deit_tiny_patch16_224", "--model-kwargs", "[1]",
                                      "--data", "digits"], "argument --model-kwargs: expected a JSON object"),
    ("--model-kwargs for a transformers folder", ["diagnose", "--model", "{d}/hf_folder", "--model-kwargs",
                                                  '{"hidden_size": 8}', "--data", "wiki"],
     "is a transformers folder: its config.json sets the model"),
    ("--model-kwargs for an mmseg config", ["diagnose", "--model", "{d}/broken_model.py", "--model-kwargs",
                                            '{"depth": 2}', "--data", "digits"], "is an mmseg config: it sets the model"),
    ("unreadable image", ["diagnose", *TIMM, "--data", "{d}/images"], "cannot read the image {d}/images/cat/broken.png"),
    ("broken mmseg config (syntax)", ["diagnose", "--model", "{d}/broken_syntax.py", "--data", "digits"],
     "cannot read the mmseg config {d}/broken_syntax.py"),
    ("broken mmseg config (model)", ["diagnose", "--model", "{d}/broken_model.py", "--data", "digits"],
     "cannot build a model from the mmseg config {d}/broken_model.py"),
    ("--seq-len 0", ["diagnose", *TIMM, "--data", "wiki", "--seq-len", "0"],
     "argument --seq-len: must be an integer >= 2, got 0"),
    ("--out names a file", ["diagnose", *TIMM, "--data", "digits", "--out", "{d}/not_a_folder"],
     "argument --out: {d}/not_a_folder exists and is not a folder"),
    ("--batch-size 0", ["diagnose", *TIMM, "--data", "digits", "--batch-size", "0"],
     "argument --batch-size: must be an integer >= 1, got 0"),
    ("--num-samples -5", ["attack", *TIMM, "--data", "digits", "--num-samples", "-5"],
     "argument --num-samples: must be an integer >= 1, got -5"),
    ("--passes -3", ["diagnose", *TIMM, "--data", "digits", "--passes", "-3"],
     "argument --passes: must be an integer >= 0, got -3"),
    ("--pgd-steps -2", ["attack", *TIMM, "--data", "digits", "--pgd-steps", "-2"],
     "argument --pgd-steps: must be an integer >= 1, got -2"),
    ("--spsa-iters 0", ["attack", *TIMM, "--data", "digits", "--spsa-iters", "0"],
     "argument --spsa-iters: must be an integer >= 1, got 0"),
    ("--noise=-0.5,nan", ["attack", *TIMM, "--data", "digits", "--noise=-0.5,nan"],
     "argument --noise: a noise sigma (>= 0) must be finite and in [0, inf], got -0.5"),
    ("--noise=0.1,nan", ["attack", *TIMM, "--data", "digits", "--noise=0.1,nan"],
     "argument --noise: a noise sigma (>= 0) must be finite and in [0, inf], got nan"),
    ("--eps 2", ["attack", *TIMM, "--data", "digits", "--eps", "2"], "argument --eps: an eps"),
    ("--eps-sweep 1/0", ["attack", *TIMM, "--data", "digits", "--eps-sweep", "1/0"],
     "argument --eps-sweep: cannot read '1/0'"),
    ("--rates 1.5", ["attack", *TIMM, "--data", "wiki", "--rates", "0,1.5"],
     "argument --rates: a substitution rate (0..1) must be finite and in [0, 1], got 1.5"),
    ("--severities 7", ["attack", *TIMM, "--data", "digits", "--severities", "1,7"], "argument --severities"),
    ("unknown attack", ["attack", *TIMM, "--data", "digits", "--attacks", "fgsm,cw"], "--attacks: unknown cw"),
    ("unknown corruption", ["attack", *TIMM, "--data", "digits", "--corruptions", "fog,nope"],
     "--corruptions: unknown nope"),
    ("--baseline not a model", ["attack", *TIMM, "--data", "digits", "--baseline", "x"], "--baseline 'x' must be one"),
    ("wrong checkpoint", ["diagnose", *TIMM, "--checkpoint", "{d}/other.pth", "--data", "digits"], "missing keys"),
    ("unknown model", ["diagnose", "--model", "no_such_model_xyz", "--data", "digits"], "unknown model 'no_such_model_xyz'"),
    ("misspelt model", ["diagnose", "--model", "pid_deit_tinyy_patch16_224", "--data", "digits"],
     "did you mean pid_deit_tiny_patch16_224"),
    ("unknown image dataset", ["diagnose", *TIMM, "--data", "cifar"], "unknown image dataset 'cifar'"),
    ("classes do not fit", ["diagnose", "--model", "deit_tiny_patch16_224", "--model-kwargs",
                            '{"num_classes": 3, "img_size": 32}', "--data", "digits"], "has 10 classes but"),
    ("language model on images", ["diagnose", "--model", "pid_fairseq_lm", "--data", "digits"], ""),
    ("image model on text", ["diagnose", *TIMM, "--data", "wiki"], "is an image model: give images"),
    ("demo --seed -1", ["demo", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    ("demo --out names a file", ["demo", "--out", "{d}/not_a_folder"], "argument --out: {d}/not_a_folder exists"),
    ("list unknown --zoo", ["list", "--zoo", "keras"], "argument --zoo: invalid choice: 'keras'"),
    ("demo unknown --preset", ["demo", "--parts", "core", "--preset", "nope"], "unknown PID preset 'nope'"),
    ("demo bad --parts", ["demo", "--parts", "core,audio"], "--parts takes a comma list"),
    ("demo unknown --data", ["demo", "--data", "cifar"], "--data 'cifar': use one of"),
    ("demo unknown --corpus", ["demo", "--corpus", "{d}/nope.txt"], "--corpus '{d}/nope.txt': use one of"),
    ("reproduce unknown --data", ["reproduce", "--data", "cifar"], "--data 'cifar': use one of"),
    ("reproduce --vision-epochs 0", ["reproduce", "--vision-epochs", "0"],
     "argument --vision-epochs: must be a finite number > 0, got 0"),
    ("reproduce --lm-steps 0", ["reproduce", "--lm-steps", "0"], "argument --lm-steps: must be an integer >= 1, got 0"),
    ("reproduce seed twice", ["reproduce", "--seeds", "1", "1"], "--seeds lists a seed twice"),
    ("reproduce bad --parts", ["reproduce", "--parts", "vision,core"], "--parts takes a comma list of vision, language"),
    ("reproduce --aggregate of no runs", ["reproduce", "--aggregate", "{d}/empty_runs"],
     "no seed*/results.json under {d}/empty_runs"),
]


# attention methods for diagnose/attack and the study's arms
CASES += [
    ("unknown --attention", ["diagnose", *TIMM, "--attention", "no_such_method", "--data", "digits"],
     "--attention: unknown attention method 'no_such_method': choose 'softmax' or one of ['"),
    ("attack unknown --attention", ["attack", *TIMM, "--attention", "no_such_method", "--data", "digits"],
     "--attention: unknown attention method 'no_such_method'"),
    ("--attention-cfg without --attention", ["diagnose", *TIMM, "--attention-cfg", "{}", "--data", "digits"],
     "--attention-cfg gives a method's parameters: name the method with --attention"),
    ("--attention-cfg not JSON", ["diagnose", *TIMM, "--attention", "pid", "--attention-cfg", "{lambda_p: 1}",
                                  "--data", "digits"], "argument --attention-cfg: expected a JSON object or a preset"),
    ("--attention for fewer models", ["diagnose", "--model", "pid_deit_tiny_patch16_224", "--model",
                                      "deit_tiny_patch16_224", "--attention", "pid", "--attention", "pid",
                                      "--attention", "pid", "--data", "digits"], "3 --attention for 2 models"),
    ("bad --attention-cfg field", ["diagnose", *TIMM, "--attention", "pid", "--attention-cfg", '{"lambda_q": 1}',
                                   "--data", "digits"], "lambda_q"),
    ("--attention and --model-kwargs", ["diagnose", "--model", "pid_deit_tiny_patch16_224", "--attention", "pid",
                                        "--model-kwargs", '{"attention": "pid"}', "--data", "digits"],
     "both choose the attention"),
    ("--attention for an mmseg config", ["diagnose", "--model", "{repo}/" + MMSEG_TINY, "--attention", "pid",
                                         "--data", "digits"], "is an mmseg config: it sets the attention"),
    ("study unknown arm", ["study", "--arms", "softmax,pid,no_such_method"], "--arms: unknown arm 'no_such_method'"),
    ("study bad arm parameters", ["study", "--arms", 'softmax,p5=pid:{"lambda_q": 0.5}'],
     "--arms: arm 'p5=pid:{\"lambda_q\": 0.5}': unknown PIDConfig field"),
    ("study arm label repeated", ["study", "--arms", "softmax,pid,pid=pid"], "--arms: arm 'pid=pid': 'pid' is a built-in arm"),
]


@pytest.mark.parametrize("argv, expected", [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_bad_input_is_one_clear_line(files, tmp_path, capsys, argv, expected):
    assert_one_clear_line(files, tmp_path, capsys, argv, expected)


def assert_one_clear_line(files, tmp_path, capsys, argv, expected):
    """``main(argv)`` exits with code 2 and one ``pid-plugins: error:`` line (``research: error:`` for the demo,
    reproduce and study of ``python -m research``) containing ``expected``, as the last line of stderr, without a
    traceback, and leaves nothing behind."""
    out = tmp_path / "out"
    argv = [a.replace("{d}", str(files)).replace("{repo}", str(REPO)) for a in argv]
    if "--out" not in argv and argv[0] != "list":
        argv += ["--out", str(out)]
    experiment = argv[0] in ("demo", "reproduce", "study")
    prefix = "research: error: " if experiment else "pid-plugins: error: "
    try:
        code = (research.cli.main if experiment else main)(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    # the zoo libraries may print their own warnings while importing; the error is the one last line
    errors = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    assert code == 2, err
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0] and "Traceback" not in err, err
    assert expected.replace("{d}", str(files)) in errors[0]
    assert not out.exists(), "a failed run left --out behind"
    assert not any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())
    assert not (files / "pwned").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_console_script_prints_no_traceback(files, tmp_path):
    """The installed entry point: the same one line on stderr, exit code 2."""
    script = Path(sys.executable).parent / "pid-plugins"
    for argv in (["diagnose", *TIMM, "--checkpoint", str(files / "truncated.pth"), "--data", "digits"],
                 ["attack", *TIMM, "--data", "digits", "--noise=-0.5,nan"]):
        proc = subprocess.run([str(script), *argv, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("pid-plugins: error: "), proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_good_checkpoints_still_load(files, tmp_path, capsys):
    """The same files, undamaged, run (so the errors above come from the damage)."""
    for ext in ("pth", "safetensors"):
        out = tmp_path / ext
        code = main(["diagnose", *TIMM, "--checkpoint", str(files / f"good.{ext}"), "--data", "digits",
                     "--num-samples", "8", "--batch-size", "8", "--passes", "0", "--out", str(out)])
        assert code == 0
        assert sorted(p.name for p in out.iterdir()) == ["diagnose.json", "diagnose.png"]
