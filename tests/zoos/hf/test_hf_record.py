"""The method record in a transformers model's weights (pid_plugins.hf.record)."""
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
from pid_plugins.hf.record import SIZE, record_key  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaForCausalLM  # noqa: E402

from zoo_cases import hf_ids, llama_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PID = {"lambda_p": 0.3, "beta": 0.2}
KEY = f"model.embed_tokens.{RECORD_KEY}"


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


def _record(state, key: str = KEY) -> dict:
    return decode_record(state[key])


def _reports(caplog) -> list:
    """What transformers and pid-plugins logged at WARNING or above."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and r.name.split(".")[0] in ("transformers", "pid_plugins")]


def test_the_folder_records_what_the_model_ran(folder, saved):
    weights = load_file(folder / "model.safetensors")
    record = weights[KEY]
    assert record.dtype == torch.uint8 and record.numel() % SIZE == 0
    want = ph.model_method_config(saved.config).to_dict()
    assert want["lambda_p"] == 0.3 and want["beta"] == 0.2
    assert decode_record(record) == {"method": "pid", "config": want}
    assert [k for k in weights if "pid_plugins" in k] == [KEY]  # one record, beside the input embeddings
    assert [n for n, _ in saved.named_buffers() if "pid_plugins" in n] == [KEY] and record_key(saved) == KEY


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
    """A fresh interpreter, transformers' default logging, no pid_plugins importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", WITHOUT_THE_PLUGIN, str(folder)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = proc.stderr.split("== ")[1:]
    for implementation, loading, loaded in zip(("sdpa", "eager"), parts[0::2], parts[1::2]):
        assert loading.startswith(implementation) and loaded.startswith(f"loaded {implementation}")
        assert "LlamaForCausalLM LOAD REPORT" in loading
        assert any(KEY in line and "UNEXPECTED" in line for line in loading.splitlines()), loading


def test_with_the_plugin_the_folder_loads_as_saved_strictly_with_no_report(folder, saved, caplog):
    with caplog.at_level(logging.INFO):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not _reports(caplog)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    base, base_info = AutoModel.from_pretrained(folder, output_loading_info=True)  # the base model takes the record
    assert base_info["unexpected_keys"] == {"lm_head.weight"} and not base_info["missing_keys"]
    assert record_key(base) == "embed_tokens." + RECORD_KEY
    assert _record(base.state_dict(), record_key(base)) == _record(model.state_dict()) \
        == _record(load_file(folder / "model.safetensors"))
    assert torch.equal(_logits(model.eval()), _logits(saved))


def test_a_folder_saved_before_the_record_loads_with_no_missing_key(folder, saved, tmp_path, caplog):
    for name in os.listdir(folder):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights[KEY]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not _reports(caplog) and not info["missing_keys"] and not info["unexpected_keys"]
    assert decode_record(model.get_buffer(KEY)) == _record(saved.state_dict())
    assert torch.equal(_logits(model.eval()), _logits(saved))


def _legacy_folder(folder, path: Path) -> Path:
    """``folder`` as releases before the device-map fix saved it: the record on the outermost model."""
    path.mkdir()
    for name in os.listdir(folder):
        if (folder / name).is_file():
            (path / name).write_bytes((folder / name).read_bytes())
    weights = load_file(path / "model.safetensors")
    weights = {RECORD_KEY: weights.pop(KEY), **weights}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_folder_with_the_record_on_the_outermost_model_loads_as_saved(folder, saved, tmp_path, caplog):
    legacy = _legacy_folder(folder, tmp_path / "legacy")
    with caplog.at_level(logging.INFO):
        model, info = AutoModelForCausalLM.from_pretrained(legacy, output_loading_info=True)
    assert not _reports(caplog) and not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(_logits(model.eval()), _logits(saved))
    assert list(model.state_dict()).count(KEY) == 1 and RECORD_KEY not in model.state_dict()
    assert _record(model.state_dict()) == _record(saved.state_dict())
    model.load_state_dict(load_file(legacy / "model.safetensors"), strict=True)  # (load_state_dict: dropped too)
    assert _record(model.state_dict()) == _record(saved.state_dict())
    split = AutoModelForCausalLM.from_pretrained(legacy, device_map=_split_map(saved),
                                                 offload_folder=tmp_path / "offload").eval()
    assert torch.equal(_logits(split), _logits(saved))


def test_other_parameters_load_and_the_record_follows_the_config(folder):
    config = AutoConfig.from_pretrained(folder)
    config.pid = {"lambda_p": 0.7, "lambda_i": 0.1, "lambda_d": 0.05, "beta": 0.45, "warmup_steps": 4,
                  "learnable": True}
    model = AutoModelForCausalLM.from_pretrained(folder, config=config)  # a record of another length: loaded
    assert _record(model.state_dict())["config"] == ph.model_method_config(model.config).to_dict()
    model.config.pid = {"lambda_p": 0.5}
    assert _record(model.state_dict())["config"]["lambda_p"] == 0.5
    model.set_attn_implementation("sdpa")  # runs no method: saves no record
    assert KEY not in model.state_dict()
    model.set_attn_implementation("pid")
    assert _record(model.state_dict())["method"] == "pid"


def test_a_model_switched_by_set_attn_implementation_is_refused_then_convert_gives_it_the_record():
    model = LlamaForCausalLM(llama_config()).eval()
    model.set_attn_implementation("pid")
    with pytest.raises(RuntimeError, match=r"Call pid_plugins\.hf\.convert\(model, 'pid'\) once"):
        _logits(model)  # a stock model carries nothing of ours: switched later, it is refused
    assert not [k for k in model.state_dict() if "pid_plugins" in k]
    ph.convert(model, "pid")
    _logits(model)
    assert [k for k in model.state_dict() if "pid_plugins" in k] == [KEY]
    assert _record(model.state_dict())["method"] == "pid"
    assert record_key(model.model) is None  # one record, held by the outermost model
    model.set_attn_implementation("sdpa")
    assert KEY not in model.state_dict()


def test_a_replaced_record_module_gets_the_record_back(saved):
    model = LlamaForCausalLM(llama_config("pid", PID)).eval()
    want = _record(model.state_dict())
    old = model.get_input_embeddings()
    model.set_input_embeddings(torch.nn.Embedding(old.num_embeddings, old.embedding_dim, padding_idx=0))
    state = model.state_dict()  # the new module is given the record
    assert _record(state) == want and [k for k in state if "pid_plugins" in k] == [KEY]
    model.load_state_dict(saved.state_dict(), strict=True)
    assert _record(model.state_dict()) == want and torch.equal(_logits(model), _logits(saved))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_casts_keep_the_record(folder, saved, dtype, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    assert model.get_buffer(KEY).dtype == torch.uint8 and model.model.embed_tokens.weight.dtype == dtype
    want = _record(saved.state_dict())
    assert _record(model.state_dict()) == want
    for cast in (model.float, model.half, model.bfloat16, model.double):
        cast()
        assert _record(model.state_dict()) == want
    model.to(dtype).save_pretrained(tmp_path)
    assert decode_record(load_file(tmp_path / "model.safetensors")[KEY]) == want


def test_strict_load_state_dict_keeps_the_models_record(saved):
    state = saved.state_dict()
    other = LlamaForCausalLM(llama_config("neutreno")).eval()
    own = _record(other.state_dict())
    assert own["method"] == "neutreno"
    other.load_state_dict(state, strict=True)  # a record of another method: the model keeps its own
    assert _record(other.state_dict()) == own
    other.load_state_dict({k: v for k, v in state.items() if k != KEY}, strict=True)  # saved before it
    assert _record(other.state_dict()) == own
    stock = LlamaForCausalLM(llama_config(attn_implementation="sdpa")).eval()
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{KEY}"'):
        stock.load_state_dict(state, strict=True)


def _split_map(model, embeddings: str = "cpu") -> dict:
    """The map a user writes to split a Llama between the CPU and the disk, module by module (no record named)."""
    layers = {f"model.layers.{i}": "cpu" if i == 0 else "disk" for i in range(model.config.num_hidden_layers)}
    return {"model.embed_tokens": embeddings, **layers, "model.norm": "cpu", "model.rotary_emb": "cpu",
            "lm_head": "disk"}


DEVICE_MAP_CASES = {"pid": (PID, "auto, all on disk"), "neutreno": ({"alpha": 0.3}, "split, record's module on disk"),
                    "pid_learnable": ({**PID, "learnable": True}, "auto, cpu and disk"),
                    "value_residual_learnable": ({"lambda_1": 0.3, "learnable": True}, "bfloat16")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DEVICE_MAP_CASES))
def test_every_device_map_of_the_stock_checkpoint_loads_the_method_checkpoint_exactly(case, tmp_path):
    """The map a user writes to split the model (naming no record), and one more placement per case, each loading the
    stock checkpoint: the method checkpoint, saved whole and sharded, loads with the same map (the same placement),
    its logits equal the method model loaded whole (bfloat16: loaded whole in bfloat16), its record the saved one."""
    method = case.removesuffix("_learnable")
    torch.manual_seed(0)
    params, extra = DEVICE_MAP_CASES[case]
    source = LlamaForCausalLM(llama_config(method, params, initializer_range=0.2)).eval()
    learned = [p for n, p in source.named_parameters() if ".attention_params." in n]
    assert bool(learned) == case.endswith("_learnable")
    with torch.no_grad():
        for p in learned:  # trained: a load that skipped them would not compute the saved model
            p.add_(0.05)
    source.save_pretrained(tmp_path / "whole")
    source.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    stock = LlamaForCausalLM(llama_config(attn_implementation="sdpa")).eval()
    stock.load_state_dict({k: v for k, v in source.state_dict().items() if "pid_plugins" not in k
                           and ".attention_params." not in k})
    stock.save_pretrained(tmp_path / "stock")
    x = hf_ids()
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").eval()
    want, saved = _logits(whole, x), _record(load_file(tmp_path / "whole" / "model.safetensors"))
    assert saved["method"] == method and _record(whole.state_dict()) == saved
    assert torch.equal(want, _logits(source, x))
    maps = {"split": _split_map(source), "split, record's module on disk": _split_map(source, "disk"),
            "auto, all on disk": ("auto", {"cpu": "40KB"}), "auto, cpu and disk": ("auto", {"cpu": "120KB"})}
    for label, device_map in maps.items():
        if label not in ("split", extra):
            continue
        memory = None
        if isinstance(device_map, tuple):
            device_map, memory = device_map
        kwargs = dict(device_map=device_map, max_memory=memory, offload_folder=tmp_path / "offload" / label)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", **kwargs)  # the stock checkpoint loads
        if memory is not None:
            device_map = base.hf_device_map  # the method model's "auto" places the same modules
            assert "disk" in device_map.values(), label
            kwargs["offload_folder"] = tmp_path / "offload" / f"{label}, method"
        for folder in ("whole", "sharded"):
            model = AutoModelForCausalLM.from_pretrained(tmp_path / folder, **kwargs).eval()
            assert model.hf_device_map == device_map, (label, folder)
            assert torch.equal(_logits(model, x), want), (label, folder)
            assert _record(model.state_dict()) == saved, (label, folder)
    if extra == "bfloat16":
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16,
                                                     device_map=_split_map(source),
                                                     offload_folder=tmp_path / "bf16").eval()
        cast = AutoModelForCausalLM.from_pretrained(tmp_path / "whole", dtype=torch.bfloat16).eval()
        assert model.model.norm.weight.dtype == torch.bfloat16 and torch.equal(_logits(model, x), _logits(cast, x))
        assert _record(model.state_dict()) == saved


def test_peft_keeps_the_record_out_of_the_adapter_and_in_the_merged_model(saved, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(saved.config._name_or_path)
    want = _record(model.state_dict())
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert decode_record(wrapped.state_dict()[f"base_model.model.{KEY}"]) == want
    wrapped.save_pretrained(tmp_path / "adapter")
    assert not [k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if "pid_plugins" in k]
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert decode_record(load_file(tmp_path / "merged" / "model.safetensors")[KEY]) == want
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(_logits(again), _logits(merged.eval())) and not torch.equal(_logits(again), _logits(saved))
