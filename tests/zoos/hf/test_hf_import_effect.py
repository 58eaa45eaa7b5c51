"""What ``import pid_plugins.hf`` changes in transformers and torch, measured in a fresh process."""
import functools
import json

import pytest
from pyexec import run_python_c

pytest.importorskip("transformers")

PROBE = r"""
import json, torch
import torch.nn.modules.module as M
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel, PretrainedConfig
from transformers.models.auto import auto_factory
from transformers.generation.continuous_batching import ContinuousMixin

CLASSES = [PreTrainedModel, PretrainedConfig, auto_factory._BaseAutoModelClass, ContinuousMixin, torch.nn.Module]
HOOKS = sorted(n for n in dir(M) if n.startswith("_global_") and isinstance(getattr(M, n), dict))

def snapshot():
    attrs = {(c.__name__, k): v for c in CLASSES for k, v in vars(c).items()}
    hooks = {n: dict(getattr(M, n)) for n in HOOKS}
    registries = {n: set(i._global_mapping) for n, i in (("attention", AttentionInterface),
                                                          ("mask", AttentionMaskInterface))}
    return attrs, hooks, registries

(a0, h0, r0) = snapshot()
import pid_plugins, pid_plugins.hf
(a1, h1, r1) = snapshot()
print(json.dumps({
    "replaced": sorted(".".join(k) for k in set(a0) | set(a1) if a0.get(k) is not a1.get(k)),
    "hooks": {n: len(h1[n]) - len(h0[n]) for n in h1 if h1[n] != h0[n]},
    "hook_registries": len(h1),
    "registered": {n: sorted(r1[n] - r0[n]) for n in r1},
    "methods": pid_plugins.list_methods(),
}))
"""

DOCUMENTED = [
    "PreTrainedModel.__init__",  # the one class-level construction hook (before and after transformers' own)
]


def test_the_import_changes_the_two_registries_and_the_documented_class_attributes_only():
    proc = run_python_c(PROBE, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    effect = json.loads(proc.stdout.strip().splitlines()[-1])
    assert effect["hook_registries"] >= 5  # the probe saw torch's global hook registries (forward, registration, ...)
    assert effect["hooks"] == {}, "import pid_plugins.hf added a torch-global hook"
    assert effect["replaced"] == DOCUMENTED
    assert effect["registered"]["attention"] == sorted(effect["methods"])
    assert effect["registered"]["mask"] == sorted(effect["methods"])


def test_a_model_gets_its_own_initialisation_and_continuous_batching_refusal_and_its_class_keeps_transformers():
    """The per-model part."""
    import pid_plugins.hf  # noqa: F401
    from transformers import LlamaForCausalLM, PreTrainedModel
    from transformers.generation.continuous_batching import ContinuousMixin

    from zoo_cases import llama_config

    model = LlamaForCausalLM(llama_config("pid"))
    assert {"_initialize_weights", "init_continuous_batching"} <= set(vars(model))
    assert vars(LlamaForCausalLM).get("_initialize_weights") is None
    assert PreTrainedModel._initialize_weights.__module__.startswith("transformers.")
    assert ContinuousMixin.init_continuous_batching.__module__.startswith("transformers.")
    with pytest.raises(ValueError, match="cannot run under continuous batching"):
        model.init_continuous_batching()



STOCK = r"""
import hashlib, json, os, sys, tempfile, torch
if sys.argv[1] == "import":
    import pid_plugins.hf  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
model = LlamaForCausalLM(config)
folder = tempfile.mkdtemp()
model.save_pretrained(folder)
digest = hashlib.sha256()
for key, tensor in model.state_dict().items():
    digest.update(key.encode()), digest.update(tensor.numpy().tobytes())
print(json.dumps({
    "hooks": sorted(f"{name}:{getattr(h, '__module__', None)}" for name, m in model.named_modules()
                    for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks,
                                  m._state_dict_hooks, m._load_state_dict_pre_hooks) for h in hooks.values()),
    "attributes": {name: sorted(vars(m)) for name, m in model.named_modules()},
    "config_attributes": sorted(vars(model.config)),
    "config_json": open(os.path.join(folder, "config.json")).read(),
    "state_dict": digest.hexdigest(),
}))
if sys.argv[1] == "import":  # then a stock model switched later, in the same fresh process
    exec(sys.argv[2])
"""


@functools.lru_cache(maxsize=None)
def _stock(imported: bool) -> tuple:
    """What the fresh process printed: the stock model's findings and (after the import) the switched models'."""
    proc = run_python_c(STOCK, timeout=600, args=("import" if imported else "plain", SWITCHED))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{"))


def test_a_stock_model_built_after_the_import_is_the_model_built_without_it():
    """In fresh processes."""
    plain, imported = _stock(False)[0], _stock(True)[0]
    assert imported["hooks"] == plain["hooks"] == []
    assert imported["attributes"] == plain["attributes"]
    assert imported["config_attributes"] == plain["config_attributes"]
    assert "attn_implementation" not in imported["config_json"]
    assert imported["config_json"] == plain["config_json"]
    assert imported["state_dict"] == plain["state_dict"]


SWITCHED = r"""
import json, logging, tempfile, torch
import pid_plugins.hf as ph
from transformers import LlamaConfig, LlamaForCausalLM

def config():
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)

torch.manual_seed(0)
method = LlamaForCausalLM._from_config(config(), attn_implementation="pid").eval()
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    want = method(ids).logits
found = {}
for how in ("set_attn_implementation", "config"):
    stock = LlamaForCausalLM(config()).eval()
    assert stock.load_state_dict(method.state_dict(), strict=False).unexpected_keys == \
        ["model.embed_tokens.pid_plugins_method"]
    if how == "config":
        stock.config._attn_implementation = "pid"
    else:
        stock.set_attn_implementation("pid")
    try:
        with torch.no_grad():
            stock(ids)
        found[how] = "ran"
    except RuntimeError as exc:
        found[how] = str(exc)
    ph.convert(stock, "pid")
    with torch.no_grad():
        found[how + " converted"] = torch.equal(stock(ids).logits, want)
folder = tempfile.mkdtemp()
method.save_pretrained(folder)
as_saved = LlamaForCausalLM.from_pretrained(folder, attn_implementation=None).eval()
found["as saved"] = as_saved.config._attn_implementation
with torch.no_grad():
    found["as saved equal"] = torch.equal(as_saved(ids).logits, want)
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("pid_plugins.hf.install").addHandler(handler)
stock = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
found["warned"] = [r.getMessage() for r in records]
found["stock hooks"] = sum(len(m._forward_pre_hooks) for m in stock.modules())
print(json.dumps(found))
"""


def test_a_stock_model_switched_later_is_refused_with_the_convert_line_that_works():
    """In a fresh process."""
    found = _stock(True)[1]
    for how in ("set_attn_implementation", "config"):
        assert "Call pid_plugins.hf.convert(model, 'pid') once" in found[how], found[how]
        assert found[how + " converted"] is True
    assert found["as saved"] == "pid" and found["as saved equal"] is True
    assert len(found["warned"]) == 1 and "attn_implementation='sdpa' loads its weights into the stock attention" \
        in found["warned"][0]
    assert found["stock hooks"] == 0
