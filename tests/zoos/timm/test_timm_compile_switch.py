"""timm's compile switches, for every method (fixed gains, learnable gains, gain warm-up)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from compile_switch import Dynamo, assert_close_state, assert_variant_trained, variants

timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
STEPS = 3


def _pair(method, cfg):
    """(compiled-to-be model, eager twin) with the same weights, training mode."""
    torch.manual_seed(0)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention=method, attention_cfg=cfg or None, **TINY)
    twin = timm.create_model("pid_deit_tiny_patch16_224", attention=method, attention_cfg=cfg or None, **TINY)
    twin.load_state_dict(model.state_dict(), strict=True)
    return model.train(), twin.train()


def _train(model, call, steps=STEPS, after_first=None):
    """``steps`` SGD steps of cross-entropy on fixed batches through ``call``; the losses."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 5, (2,), generator=g)) for _ in range(steps)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(call(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if i == 0 and after_first is not None:
            after_first()
    return torch.stack(losses)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("method,cfg", variants("timm-deit", layers=TINY["depth"]))
def test_torch_compile_trains_like_eager_without_breaks_or_recompiles(method, cfg):
    plain = "learnable" not in cfg and "warmup_steps" not in cfg
    backend = "inductor" if plain else "aot_eager"
    model, twin = _pair(method, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Dynamo() as dynamo:
        compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
        patch = torch._dynamo.config.patch(error_on_recompile=True)
        try:
            got = _train(model, compiled, after_first=patch.__enter__)  # after the first step: no recompile
        finally:
            patch.__exit__(None, None, None)
        assert dynamo.graph_breaks == {} and dynamo.graphs == 1
    want = _train(twin, twin)
    tol = dict(rtol=1e-4, atol=1e-5) if backend == "inductor" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    assert_close_state(model.state_dict(), twin.state_dict(), moved_from=before, **tol)
    assert_variant_trained(model, cfg, before, STEPS)


TRAIN_METHODS = [p.values[0] for p in variants("timm-deit", layers=TINY["depth"]) if not set(p.values[1]) & {"learnable", "warmup_steps"}]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """``train/c<k>/`` and ``validation/c<k>/``: three classes of two random 32 x 32 images each."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("timm_compile")
    g = torch.Generator().manual_seed(1)
    for split in ("train", "validation"):
        for k in range(3):
            (folder / split / f"c{k}").mkdir(parents=True)
            for i in range(2):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / split / f"c{k}" / f"img{i}.png")
    return folder


def _train_py(script, folder, out, method, compile_backend=None):
    from tool_cases import check, launch

    command = ["python", script, "--data-dir", folder, "--model", "pid_deit_tiny_patch16_224", "--num-classes", "3",
               "--img-size", "32", "--model-kwargs", "img_size=32", "patch_size=8", "depth=2", "embed_dim=32",
               "num_heads=2", f"attention={method}", "--device", "cpu", "--epochs", "1", "--batch-size", "2",
               "--validation-batch-size", "2", "--workers", "0", "--opt", "sgd", "--lr", "0.1", "--warmup-epochs", "0",
               "--weight-decay", "0", "--output", out, "--experiment", "exp", "--no-prefetcher", "--log-interval", "1",
               "--seed", "0"]
    if compile_backend is not None:
        command += ["--torchcompile", compile_backend]
    proc = check(launch(command, out.parent, adapters="timm", TORCH_LOGS="graph_breaks,recompiles"))
    state = torch.load(out / "exp" / "last.pth.tar", map_location="cpu", weights_only=False)["state_dict"]
    return proc.stdout + proc.stderr, state


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("method", TRAIN_METHODS)
def test_train_py_torchcompile_trains_like_eager(method, image_folder, tmp_path):
    """train.py ``--torchcompile`` (inductor for PID; ``--torchcompile aot_eager`` for the other methods, the same
    graphs for a fraction of the compile time) against an eager train.py run: one epoch of three SGD steps."""
    from test_tools_timm import _script  # the scripts (tests/third_party/timm_scripts)

    script = _script("train.py")
    backend = "inductor" if method == "pid" else "aot_eager"
    log, compiled = _train_py(script, image_folder, tmp_path / "compiled", method, backend)
    assert f"Compiling task components with backend={backend}" in log
    assert "Graph break" not in log, log[-4000:]
    reasons = re.findall(r"\[__recompiles\]\s+- \d+/\d+: (.*)", log)
    assert len(re.findall(r"Recompiling function", log)) == 1 and len(reasons) == 1, log[-4000:]
    assert "grad_mode" in reasons[0], reasons
    _, eager = _train_py(script, image_folder, tmp_path / "eager", method)
    assert compiled.keys() == eager.keys()
    tol = dict(rtol=1e-4, atol=1e-5)
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], **tol, msg=lambda m: f"{k}: {m}")
