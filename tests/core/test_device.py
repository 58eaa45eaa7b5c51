"""Every method's device-independent properties on a chosen device: ``pytest tests/core/test_device.py --device cuda``
(or ``PID_TEST_DEVICE``; the default ``cpu`` is what ``make test`` runs)."""
from __future__ import annotations

import contextlib
import dataclasses
import copy

import pytest
import torch

import zoo_cases as zc
from method_cases import METHODS, MODELS, cases, method_cfg  # noqa: F401

ZOOS = ("timm-deit", "timm-fan", "hf-llama", "hf-bert")
ON_ZOOS = dict(models=lambda m: m.name in ZOOS)


@pytest.fixture(autouse=True)
def one_thread_and_the_toy(one_thread):
    """Tiny models: one intra-op thread (tests/conftest.py); the toy method registered (as the contract does)."""
    import toy_method  # noqa: F401

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def has_float64(device: torch.device) -> bool:
    return device.type not in ("mps",)


def on(device, *models):
    return [m.to(device) for m in models]


def run(model_case, model, x, device):
    """The model's output for inputs ``x`` (made on the CPU), computed on ``device``, back on the CPU."""
    with torch.no_grad():
        return model_case.out(model, x.to(device)).cpu()


def inputs(model_case, dtype=torch.float32):
    return model_case.inputs(dtype if model_case.zoo == "timm" else torch.float32)


def gap(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("method, model_case", cases(
    pair=lambda method, model: model.name in method.zero_models and model.name in ZOOS))
def test_switched_off_is_the_stock_model_bit_for_bit(method, model_case, device):
    model, stock = on(device, *model_case.pair(method.name, method.zero))
    x = inputs(model_case)
    got, want = run(model_case, model, x, device), run(model_case, stock, x, device)
    assert got.device.type == "cpu" and torch.isfinite(want).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("method, model_case", cases(**ON_ZOOS))
def test_matches_the_float64_reference_and_float32_stays_within_the_stock_drift(method, model_case, device):
    cfg = method_cfg(method, model_case)
    model, stock = model_case.pair(method.name, cfg)
    x = inputs(model_case)
    rule = method.rule(cfg, model_case)
    # the references: the stock modules by hand in float64 on the CPU (the method's rule), the stock model in float64
    ref_stock = copy.deepcopy(stock).double()
    x64 = inputs(model_case, torch.float64)
    with torch.no_grad():
        want = model_case.reference(ref_stock, x64, rule)
        want_stock = model_case.out(ref_stock, x64)
    assert not torch.allclose(want, want_stock)  # the method changes the output
    # float32 on the device: the method's distance to its reference within the stock model's own, with a margin
    model32, stock32 = on(device, model, stock)
    drift_stock = gap(run(model_case, stock32, x, device), want_stock)
    drift_method = gap(run(model_case, model32, x, device), want)
    assert drift_method <= 8 * drift_stock + 1e-5, (drift_method, drift_stock)
    if has_float64(device):
        # float64 on the device: within 1e-9 of the reference, or of the stock model's own float64 distance to its
        # reference there (on CUDA the zoos keep a few float32 steps in a float64 model, e.g. Llama's rotary angles,
        # and the device's float32 rounds them differently from the CPU's), with the same margin
        model64, stock64 = model32.double(), stock32.double()
        got = run(model_case, model64, x64, device)
        assert got.dtype == torch.float64
        drift64_stock = gap(run(model_case, stock64, x64, device), want_stock)
        assert gap(got, want) <= 8 * drift64_stock + 1e-9, (gap(got, want), drift64_stock)


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.name == "hf-llama"))
def test_cached_generate_equals_recomputation(method, model_case, device):
    (model,) = on(device, model_case.pair(method.name, method_cfg(method, model_case))[0])
    x = zc.hf_ids(length=6).to(device)
    with torch.no_grad():
        zc.assert_cached_generation(model, x)


def train_step(model_case, model, x, device, dtype):
    """One training step's (logits, loss, gradients) on ``device``, under autocast to ``dtype`` (None: float32)."""
    model.train()
    model.zero_grad()
    ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
        out = model_case.out(model, x.to(device))
        loss = out.float().square().mean()
    loss.backward()
    grads = [p.grad.float().cpu() for p in model.parameters() if p.grad is not None]
    model.eval()
    return out.detach().float().cpu(), loss.detach().float().cpu(), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method, model_case", cases(**ON_ZOOS))
def test_autocast_training_step_is_finite_and_within_the_stock_drift(method, model_case, dtype, device):
    if dtype == torch.float16 and device.type == "cpu" and not torch.amp.is_autocast_available("cpu"):
        pytest.skip("no autocast on this CPU build")
    model, stock = on(device, *model_case.pair(method.name, method_cfg(method, model_case)))
    x = inputs(model_case)
    drifts = []
    for m in (stock, model):
        full, _, full_grads = train_step(model_case, m, x, device, None)
        low, loss, grads = train_step(model_case, m, x, device, dtype)
        assert torch.isfinite(loss) and torch.isfinite(low).all()
        assert len(grads) == len(full_grads) and all(torch.isfinite(g).all() for g in grads)
        drifts.append(gap(low, full) / full.abs().max().item())
    drift_stock, drift_method = drifts
    assert 0 < drift_stock  # autocast did lower the precision
    assert drift_method <= 4 * drift_stock + 1e-3, (drift_method, drift_stock)


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [pytest.param(getattr(SDPBackend, name), id=name.lower()) for name in
            ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")]


def sdpa_kernels(fn):
    """(result of ``fn()``, the names of the scaled-dot-product aten ops it ran, as the profiler records them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    names = {e.name for e in prof.events() if "scaled_dot_product" in e.name and e.name.startswith("aten::_")}
    return result, names


@pytest.mark.parametrize("backend", sdpa_backends())
@pytest.mark.parametrize("method, model_case", cases(**ON_ZOOS))
def test_each_sdpa_backend_the_stock_model_uses_is_the_methods_too(method, model_case, backend, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # on CUDA in bf16: flash attention and cuDNN take no float32 (the stock model would skip them)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = method_cfg(method, model_case)
    model, stock = (m.to(dtype) for m in on(device, *model_case.pair(method.name, cfg)))
    off = None
    if model_case.name in method.zero_models:
        (off,) = on(device, model_case.pair(method.name, method.zero)[0].to(dtype))
    x = inputs(model_case, dtype)
    if model_case.zoo == "timm":
        zc.set_fused([m for m in (model, stock, off) if m is not None], True)
    with sdpa_kernel([backend]):
        try:
            want, stock_ops = sdpa_kernels(lambda: run(model_case, stock, x, device))
        except RuntimeError as err:  # torch: "No available kernel. Aborting execution." with the reasons warned
            if backend == SDPBackend.MATH or (device.type == "cpu" and backend == SDPBackend.FLASH_ATTENTION):
                raise  # every device has the math backend, and the CPU its flash kernel: these never skip
            pytest.skip(f"the stock model does not run under {backend.name} on {device}: {str(err)[:200]}")
        got, method_ops = sdpa_kernels(lambda: run(model_case, model, x, device))
        assert stock_ops, "the stock model calls SDPA"
        assert torch.isfinite(got).all() and not torch.allclose(got, want)  # the method is on
        # every method computes A v with SDPA: the stock model's fused kernel, none other
        assert method_ops == stock_ops, (method_ops, stock_ops)
        if off is not None:
            got_off, off_ops = sdpa_kernels(lambda: run(model_case, off, x, device))
            assert torch.equal(got_off, want)
            assert off_ops == stock_ops


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.name in ("hf-llama", "hf-bert", "timm-deit")))
def test_on_meta_every_added_tensor_follows_the_model(method, model_case):
    """Built on the CPU and moved to ``meta``: every parameter and buffer (those the method adds too) is on meta, and
    a forward there runs (a tensor the method made on the CPU would meet the model's meta tensors and fail)."""
    model, _ = model_case.pair(method.name, method_cfg(method, model_case))
    model = model.to("meta")
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert tensors and all(t.device.type == "meta" for t in tensors.values()), \
        [n for n, t in tensors.items() if t.device.type != "meta"]
    x = inputs(model_case).to("meta")
    with torch.no_grad():
        out = model_case.out(model, x)
    assert out.device.type == "meta"


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.name in ("hf-llama", "timm-deit")))
def test_built_or_converted_on_meta_in_bf16_every_added_tensor_is_there_too(method, model_case):
    """A model built on ``meta`` in bf16 (timm: ``create_model`` under ``torch.device("meta")``; transformers: the
    stock model converted there): every parameter and buffer the method adds is on meta and, floating, in bf16 (the
    methods with learnable parameters have them on: they are what a method adds)."""
    cfg = method_cfg(method, model_case)
    learnable = "learnable" in {f.name for f in dataclasses.fields(method.config_type())}
    if learnable:
        cfg = {**(cfg or {}), "learnable": True}
    if model_case.zoo == "timm":
        timm = zc.import_timm()
        name, _, args = zc.TIMM[model_case.kind]
        with torch.device("meta"):
            model = timm.create_model(name, attention=method.name, attention_cfg=cfg, **args).to(torch.bfloat16)
    else:
        T = zc.import_transformers()
        import pid_plugins.hf as ph

        with torch.device("meta"):
            model = T.LlamaForCausalLM(zc.llama_config("sdpa")).to(torch.bfloat16)
        before = {n for n, _ in model.named_parameters()}
        ph.convert(model, method.name, cfg)
        if learnable:  # it adds its parameters: the check below sees them
            assert {n for n, _ in model.named_parameters()} - before
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    wrong = [(n, t.device, t.dtype) for n, t in tensors
             if t.device.type != "meta" or (t.is_floating_point() and t.dtype != torch.bfloat16)]
    assert tensors and not wrong, wrong
