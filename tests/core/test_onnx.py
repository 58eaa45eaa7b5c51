"""ONNX export (issue 32): timm's ``onnx_export`` with its defaults (TorchScript exporter) and with ``use_dynamo=True``
for every method, and the dynamo exporter on transformers models; onnxruntime equals eager at another batch size and
sequence length than exported."""
from __future__ import annotations

import inspect
import traceback
import warnings

import onnx
import onnxruntime as ort
import pytest
import torch

timm = pytest.importorskip("timm")
import pid_plugins.timm  # noqa: E402,F401
from timm.utils.onnx import onnx_export  # noqa: E402

from method_cases import BUILTIN, MODELS as CONTRACT_MODELS, method_cfg, variants  # noqa: E402

pytestmark = pytest.mark.slow  # every test here (make test-fast leaves them out)

MODELS = {"pid_deit_tiny_patch16_224": dict(img_size=32, depth=3), "pid_fan_tiny_12_p16_224": dict(img_size=64, depth=3)}
#: each timm name's model in the method table (tests/method_cases.py), whose parameters the methods run with here
CONTRACT = {"pid_deit_tiny_patch16_224": "timm-deit", "pid_fan_tiny_12_p16_224": "timm-fan"}
HF_CONTRACT = {"bert": "hf-bert", "llama": "hf-llama"}


def cfg_of(method, model):
    """The method's parameters on ``model`` (a key of the table's MODELS); softmax: none."""
    return method_cfg(BUILTIN[method], CONTRACT_MODELS[model]) if method in BUILTIN else None


def dynamo_cases(contract):
    """(name, method) of every built-in method whose dynamo-exporter test runs on that model (``onnx_dynamo_models``)."""
    return [(name, m.name) for m in BUILTIN.values() for name, model in contract.items()
            if model in m.onnx_dynamo_models]


def run_onnx(path, name, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [name]  # the image only: no flag became a graph input
    return torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def timm_model(name, method, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, attention=method, attention_cfg=cfg_of(method, CONTRACT[name]), **MODELS[name], **kw).eval()


def our_tracer_warnings(records):
    """TracerWarnings whose innermost frame outside torch is pid_plugins code (a branch of ours the trace froze)."""
    ours = []
    for record, stack in records:
        frames = [f for f in stack if "/torch/" not in f.filename and "warnings.py" not in f.filename]
        if frames and "pid_plugins" in frames[-1].filename:
            ours.append(f"{frames[-1].filename}:{frames[-1].lineno}: {record.message}")
    return ours


def export_recording_warnings(**kwargs):
    records = []

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, torch.jit.TracerWarning):
            records.append((warnings.WarningMessage(message, category, filename, lineno),
                            traceback.extract_stack()[:-1]))  # without this function's own frame

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        onnx_export(**kwargs)
    return records


@pytest.mark.parametrize("method", BUILTIN)
@pytest.mark.parametrize("name", MODELS)
def test_timm_onnx_export_with_timms_defaults(name, method, tmp_path):
    """TorchScript exporter: exported at batch 2, run at batch 3, equal to eager; no branch of ours frozen."""
    model = timm_model(name, method)
    size = MODELS[name]["img_size"]
    path = tmp_path / "model.onnx"
    records = export_recording_warnings(model=model, output_file=str(path), input_size=(3, size, size),
                                        batch_size=2, check=True)
    assert our_tracer_warnings(records) == []
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(run_onnx(path, "input0", x), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, timm_model(name, "softmax")(x), atol=1e-4)  # the method is in the graph


@pytest.mark.parametrize("variant", [key for key in variants(warmup_steps=10) if key not in BUILTIN])
def test_timm_onnx_export_of_learnable_gains_and_warmup(variant, tmp_path):
    """Learned parameters are exported as constants; under warm-up the graph holds this step's scale (eval: t
    fixed): every built-in method with learnable parameters, and with warm-up."""
    method, cfg = variants(warmup_steps=10)[variant]
    torch.manual_seed(0)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention=method, attention_cfg=cfg,
                              **MODELS["pid_deit_tiny_patch16_224"]).eval()
    if model.attention_warmup is not None:
        model.attention_warmup.step.fill_(4)  # scale 0.4
    path = tmp_path / "model.onnx"
    onnx_export(model, str(path), input_size=(3, 32, 32), batch_size=2, check=True)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(path, "input0", x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,method", dynamo_cases(CONTRACT))
def test_timm_onnx_export_with_the_dynamo_exporter(name, method, tmp_path):
    model = timm_model(name, method)
    size = MODELS[name]["img_size"]
    path = tmp_path / "model.onnx"
    if hasattr(torch.onnx, "ExportOptions") or "'dynamic_shapes' in export_args" in inspect.getsource(onnx_export):
        onnx_export(model, str(path), input_size=(3, size, size), batch_size=2, check=True, use_dynamo=True)
    else:  # timm < 1.0.31's helper calls torch.onnx.ExportOptions, which torch 2.14 removed: torch's exporter itself
        example = torch.randn(2, 3, size, size)  # as timm 1.0.31 exports: a named batch axis, traced at batch 2
        torch.onnx.export(model, (example,), str(path), dynamo=True, input_names=["input0"], output_names=["output0"],
                          dynamic_shapes=({0: "batch"},))
        onnx.checker.check_model(str(path))
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(path, "input0", x), model(x), rtol=1e-5, atol=1e-5)


class Outputs(torch.nn.Module):
    """The model as an exporter sees it: token ids in, one tensor out (logits, or the last hidden states)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        out = self.model(input_ids=ids, use_cache=False) if hasattr(self.model, "lm_head") else self.model(input_ids=ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("family,method", dynamo_cases(HF_CONTRACT))
def test_transformers_dynamo_export(family, method, tmp_path):
    """PID BERT (an encoder) and a causal Llama with 4 query / 2 key-value heads without a cache: exported with
    dynamic batch and sequence, run at other sizes."""
    from zoo_cases import bert_config, import_transformers, llama_config

    T = import_transformers()
    torch.manual_seed(0)
    if family == "llama":
        model = T.LlamaForCausalLM(llama_config(method, cfg_of(method, "hf-llama"))).eval()
    else:
        model = T.BertModel(bert_config(attn_implementation=method, **{method: cfg_of(method, "hf-bert")})).eval()
    wrapped = Outputs(model).eval()
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=32)
    path = tmp_path / "model.onnx"
    torch.onnx.export(wrapped, (ids,), str(path), dynamo=True, dynamic_shapes=({0: batch, 1: seq},),
                      input_names=["ids"])
    x = torch.randint(3, 90, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(path, "ids", x), wrapped(x), rtol=1e-5, atol=1e-5)
