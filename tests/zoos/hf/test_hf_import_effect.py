"""What ``import pid_plugins.hf`` changes in transformers and torch, measured in a fresh process: the attributes of
transformers' model, config, auto-class and continuous-batching classes and torch's module-level hook registries
before and after the import. The list is the one docs/architecture.md gives, each with its reason; a change that adds
a replaced attribute or a torch-global hook fails here until it is documented there."""
import json
import subprocess
import sys

import pytest

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

#: docs/architecture.md, "transformers": each with its reason there
DOCUMENTED = [
    "Module.smart_apply",  # transformers' own, at its first model build (the import's probes build tiny Llamas)
    "PreTrainedModel.__init__",  # the one class-level construction hook (before and after transformers' own)
]


def test_the_import_changes_the_two_registries_and_the_documented_class_attributes_only():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    effect = json.loads(out.strip().splitlines()[-1])
    assert effect["hook_registries"] >= 5  # the probe saw torch's global hook registries (forward, registration, ...)
    assert effect["hooks"] == {}, "import pid_plugins.hf added a torch-global hook"
    assert effect["replaced"] == DOCUMENTED
    # every registered method, in both of transformers' registries, under its own name
    assert effect["registered"]["attention"] == sorted(effect["methods"])
    assert effect["registered"]["mask"] == sorted(effect["methods"])


def test_a_model_gets_its_own_initialisation_and_continuous_batching_refusal_and_its_class_keeps_transformers():
    """The per-model part: a model built after the import has its own ``_initialize_weights`` and
    ``init_continuous_batching`` (instance attributes), its class's are transformers' own."""
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

