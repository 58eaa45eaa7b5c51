"""The method record in a transformers model's weights (pid_plugins.hf.record): ``save_pretrained`` writes
``pid_plugins_method`` with what the model ran; transformers without pid-plugins lists it in its default load report
when the folder is loaded with a stock attention; with the plugin the folder loads as saved with no report (also one
saved before the record existed, and with other parameters); ``convert`` adds and removes it, a stock model never has
one; dtype casts, device maps, strict ``load_state_dict`` and peft keep it."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import pid_plugins.hf as ph  # noqa: E402
from pid_plugins.core.record import RECORD_KEY, decode_record  # noqa: E402
from pid_plugins.hf.record import SIZE  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaForCausalLM  # noqa: E402

from zoo_cases import hf_ids, llama_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PID = {"lambda_p": 0.3, "beta": 0.2}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pid_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config("pid", PID, initializer_range=0.2)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _logits(model, x=None):
    with torch.no_grad():
        return model(hf_ids() if x is None else x).logits


def _record(state) -> dict:
    return decode_record(state[RECORD_KEY])


def _reports(caplog) -> list:
    """What transformers and pid-plugins logged at WARNING or above."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and r.name.split(".")[0] in ("transformers", "pid_plugins")]


def test_the_folder_records_what_the_model_ran(folder, saved):
    weights = load_file(folder / "model.safetensors")
    record = weights[RECORD_KEY]
    assert record.dtype == torch.uint8 and record.numel() % SIZE == 0
    want = ph.model_method_config(saved.config).to_dict()
    assert want["lambda_p"] == 0.3 and want["beta"] == 0.2
    assert decode_record(record) == {"method": "pid", "config": want}
    assert [k for k in weights if "pid_plugins" in k] == [RECORD_KEY]  # one record, on the outermost model
    assert [n for n, _ in saved.named_buffers() if "pid_plugins" in n] == [RECORD_KEY]


WITHOUT_THE_PLUGIN = """
import sys
import torch
from transformers import AutoModelForCausalLM

for implementation in ("sdpa", "eager"):
    print(f"== {implementation}", file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation=implementation)
    print(f"== loaded {model.config._attn_implementation}", file=sys.stderr, flush=True)
assert not [m for m in sys.modules if m == "pid_plugins" or m.startswith("pid_plugins.")]
"""


def test_without_the_plugin_a_stock_attention_lists_the_record_by_default(folder):
    """A fresh interpreter, transformers' default logging, no pid_plugins importable: each stock load of the folder
    shows transformers' LOAD REPORT naming the record as UNEXPECTED."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", WITHOUT_THE_PLUGIN, str(folder)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = proc.stderr.split("== ")[1:]
    for implementation, loading, loaded in zip(("sdpa", "eager"), parts[0::2], parts[1::2]):
        assert loading.startswith(implementation) and loaded.startswith(f"loaded {implementation}")
        assert "LlamaForCausalLM LOAD REPORT" in loading
        assert any(RECORD_KEY in line and "UNEXPECTED" in line for line in loading.splitlines()), loading


def test_with_the_plugin_the_folder_loads_as_saved_strictly_with_no_report(folder, saved, caplog):
    with caplog.at_level(logging.INFO):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not _reports(caplog)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    base, base_info = AutoModel.from_pretrained(folder, output_loading_info=True)  # the base model takes the record
    assert base_info["unexpected_keys"] == {"lm_head.weight"} and not base_info["missing_keys"]
    assert _record(base.state_dict()) == _record(model.state_dict()) == _record(load_file(folder / "model.safetensors"))
    assert torch.equal(_logits(model.eval()), _logits(saved))


def test_a_folder_saved_before_the_record_loads_with_no_missing_key(folder, saved, tmp_path, caplog):
    for name in os.listdir(folder):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights[RECORD_KEY]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not _reports(caplog) and not info["missing_keys"] and not info["unexpected_keys"]
    # transformers made the missing buffer with torch.empty: it holds the record of what the model runs
    assert decode_record(model.get_buffer(RECORD_KEY)) == _record(saved.state_dict())
    assert torch.equal(_logits(model.eval()), _logits(saved))


def test_other_parameters_load_and_the_record_follows_the_config(folder):
    config = AutoConfig.from_pretrained(folder)
    config.pid = {"lambda_p": 0.7, "lambda_i": 0.1, "lambda_d": 0.05, "beta": 0.45, "warmup_steps": 4,
                  "learnable": True}
    model = AutoModelForCausalLM.from_pretrained(folder, config=config)  # a record of another length: loaded
    assert _record(model.state_dict())["config"] == ph.model_method_config(model.config).to_dict()
    model.config.pid = {"lambda_p": 0.5}
    assert _record(model.state_dict())["config"]["lambda_p"] == 0.5
    model.set_attn_implementation("sdpa")  # runs no method: saves no record
    assert RECORD_KEY not in model.state_dict()
    model.set_attn_implementation("pid")
    assert _record(model.state_dict())["method"] == "pid"


def test_convert_adds_and_removes_it_and_a_stock_model_has_none(saved):
    stock = LlamaForCausalLM(llama_config()).eval()
    assert RECORD_KEY not in stock.state_dict() and not [n for n, _ in stock.named_buffers() if "pid_plugins" in n]
    assert not stock._state_dict_pre_hooks and not stock._load_state_dict_pre_hooks
    assert "pid_plugins" not in str(stock._keys_to_ignore_on_load_missing)
    keys = list(stock.state_dict())
    ph.convert(stock, "value_residual", {"lambda_1": 0.25})
    assert list(stock.state_dict()) == [RECORD_KEY, *keys]
    assert _record(stock.state_dict()) == {"method": "value_residual", "config": stock.config.value_residual}
    ph.convert(stock, "softmax")
    assert list(stock.state_dict()) == keys and not stock._state_dict_pre_hooks
    assert not stock._load_state_dict_pre_hooks
    assert "pid_plugins" not in str(stock._keys_to_ignore_on_load_missing)


def test_a_model_switched_by_set_attn_implementation_is_refused_then_convert_gives_it_the_record():
    model = LlamaForCausalLM(llama_config()).eval()
    model.set_attn_implementation("pid")
    with pytest.raises(RuntimeError, match=r"Call pid_plugins\.hf\.convert\(model, 'pid'\) once"):
        _logits(model)  # a stock model carries nothing of ours: switched later, it is refused
    assert RECORD_KEY not in model.state_dict()
    ph.convert(model, "pid")
    _logits(model)
    assert list(model.state_dict())[0] == RECORD_KEY and _record(model.state_dict())["method"] == "pid"
    assert RECORD_KEY not in model.model.state_dict()  # one record, on the outermost model
    model.set_attn_implementation("sdpa")
    assert RECORD_KEY not in model.state_dict()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_casts_keep_the_record(folder, saved, dtype, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    assert model.get_buffer(RECORD_KEY).dtype == torch.uint8 and model.model.embed_tokens.weight.dtype == dtype
    want = _record(saved.state_dict())
    assert _record(model.state_dict()) == want
    for cast in (model.float, model.half, model.bfloat16, model.double):
        cast()
        assert _record(model.state_dict()) == want
    model.to(dtype).save_pretrained(tmp_path)
    assert decode_record(load_file(tmp_path / "model.safetensors")[RECORD_KEY]) == want


def test_strict_load_state_dict_keeps_the_models_record(saved):
    state = saved.state_dict()
    other = LlamaForCausalLM(llama_config("neutreno")).eval()
    own = _record(other.state_dict())
    assert own["method"] == "neutreno"
    other.load_state_dict(state, strict=True)  # a record of another method: the model keeps its own
    assert _record(other.state_dict()) == own
    other.load_state_dict({k: v for k, v in state.items() if k != RECORD_KEY}, strict=True)  # saved before it
    assert _record(other.state_dict()) == own
    stock = LlamaForCausalLM(llama_config(attn_implementation="sdpa")).eval()
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{RECORD_KEY}"'):
        stock.load_state_dict(state, strict=True)


def test_device_maps_place_the_record(folder, saved, tmp_path):
    x = hf_ids()
    want = _logits(saved, x)
    for device_map in ("cpu", "auto", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map).eval()
        assert torch.equal(_logits(model, x), want), device_map
    # accelerate's dispatch (disk offload) checks that its map covers every state_dict key: "auto" maps the root's
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": "40KB"},
                                                 offload_folder=tmp_path / "auto").eval()
    assert set(model.hf_device_map.values()) == {"disk"} and torch.allclose(_logits(model, x), want, atol=1e-6)
    # a hand-written map that splits the model names the record too (as the warm-up counter): refused by name
    split = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "disk", "model.rotary_emb": "cpu",
             "lm_head": "disk"}
    with pytest.raises(ValueError, match=f"does not give any device for the following parameters: {RECORD_KEY}"):
        AutoModelForCausalLM.from_pretrained(folder, device_map=split, offload_folder=tmp_path / "split")
    model = AutoModelForCausalLM.from_pretrained(folder, device_map={**split, RECORD_KEY: "cpu"},
                                                 offload_folder=tmp_path / "split").eval()
    assert torch.allclose(_logits(model, x), want, atol=1e-6)


def test_peft_keeps_the_record_out_of_the_adapter_and_in_the_merged_model(saved, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(saved.config._name_or_path)
    want = _record(model.state_dict())
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert decode_record(wrapped.state_dict()[f"base_model.model.{RECORD_KEY}"]) == want
    wrapped.save_pretrained(tmp_path / "adapter")
    assert not [k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if "pid_plugins" in k]
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert decode_record(load_file(tmp_path / "merged" / "model.safetensors")[RECORD_KEY]) == want
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(_logits(again), _logits(merged.eval())) and not torch.equal(_logits(again), _logits(saved))
