"""The versions pid-plugins declares (pyproject, the pin files and the docs agree with ``versions.TESTED``; outside the
range warns once) and the guard on the transformers internals (each holds; a faked change is refused with one error
naming the version and the range, before anything runs); importing the adapters changes nothing else."""
from __future__ import annotations

import functools
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from pyexec import run_python_c

from pid_plugins import versions
from pid_plugins.versions import TESTED, InternalChanged, UntestedVersionWarning, check_version

ROOT = Path(__file__).resolve().parents[2]
if sys.version_info >= (3, 11):
    import tomllib


def pins(path: Path) -> dict:
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), re.M)}


def hf():
    """transformers with the adapter imported, and a tiny grouped-query Llama config."""
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401

    return T, T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)


def test_the_pin_files_are_the_tested_range():
    newest, lowest = pins(ROOT / "constraints.txt"), pins(ROOT / "constraints-lowest.txt")
    # torch's lowest is vLLM's (the core and the vLLM plugin: constraints-vllm.txt), the zoos' is ZOO_TORCH
    lowest["torch"] = pins(ROOT / "constraints-vllm.txt")["torch"].split("+")[0]
    assert pins(ROOT / "constraints-lowest.txt")["torch"] == versions.ZOO_TORCH
    for dist, (low, high) in TESTED.items():
        assert newest[dist] == high, f"constraints.txt pins {dist}=={newest[dist]}, TESTED says newest {high}"
        assert lowest[dist] == low, f"constraints-lowest.txt pins {dist}=={lowest[dist]}, TESTED says lowest {low}"


def test_pyproject_bounds_every_extra_at_the_tested_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    declared = {}
    for req in requirements:
        m = re.match(r"^([A-Za-z0-9_.-]+)(.*)$", req)
        declared.setdefault(m.group(1).lower(), set()).add(m.group(2).replace(" ", ""))
    for dist, (low, high) in TESTED.items():
        assert dist in declared, f"{dist} is tested but no extra declares it"
        for spec in declared[dist]:
            assert f">={low}" in spec, f"pyproject: {dist}{spec} should admit {low} as its lowest version"
    minor = ".".join(TESTED["transformers"][1].split(".")[:2])
    upper = f"<{minor.split('.')[0]}.{int(minor.split('.')[1]) + 1}"
    assert all(upper in spec for spec in declared["transformers"]), \
        f"transformers should be capped below its next minor release ({upper}): its minor releases change internals"


def test_the_installed_zoos_are_inside_the_tested_range():
    for dist in TESTED:
        assert check_version.__wrapped__(dist), f"{dist} {versions.installed_version(dist)} is outside {TESTED[dist]}"


@pytest.mark.parametrize("version, side", [("99.0.0", "newer than the newest"), ("0.0.1", "older than the oldest")])
def test_a_version_outside_the_range_warns_once_naming_the_range(version, side):
    low, high = TESTED["transformers"]
    with pytest.warns(UntestedVersionWarning, match=rf"transformers {re.escape(version)} is {side} release .*"
                                                    rf"\({re.escape(low)} to {re.escape(high)}\)"):
        assert not check_version("transformers", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_version("transformers", version)  # once per version: the second call is silent
    assert check_version("transformers", high)
    assert check_version("torch", "2.15.0+cu132")  # a local build tag is the release it was built from


def test_a_changed_static_cache_internal_is_refused_before_anything_runs(monkeypatch, fresh_checks):
    """A release whose StaticLayer no longer keeps ``cumulative_length`` as a tensor: a method decoder is refused when
    it is built (discovery checks what its forwards will read), where it would otherwise read the wrong rows of the
    value buffer; and a model built before the change stops at its first static-cache forward."""
    T, config = hf()
    from transformers import cache_utils

    built = T.LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    original = cache_utils.StaticLayer.__init__

    def changed(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.cumulative_length = 0  # what a release might keep instead

    monkeypatch.setattr(cache_utils.StaticLayer, "__init__", changed)
    low, high = TESTED["transformers"]
    version = versions.installed_version("transformers")
    message = (rf"transformers {re.escape(version)} changed an internal pid-plugins reads: "
               rf"StaticLayer.cumulative_length.*tested with transformers {re.escape(low)} to {re.escape(high)}")
    with pytest.raises(InternalChanged, match=message):
        T.LlamaForCausalLM._from_config(config, attn_implementation="pid")
    with pytest.raises(InternalChanged, match=message):
        with torch.no_grad():
            built(torch.tensor([[3, 4, 5]]), past_key_values=T.StaticCache(config=config, max_cache_len=8),
                  use_cache=True)


def test_a_cache_under_an_unknown_keyword_is_refused(monkeypatch, fresh_checks):
    """A release that passes the cache under a new keyword (as 5.24 did with ``cache``): refused, never run without
    the method seeing the cache."""
    T, config = hf()
    from pid_plugins.hf import internals

    model = T.LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    with pytest.raises(InternalChanged, match=r"the forward keyword carrying the KV cache .*got the cache as kv_cache="):
        model.model(torch.tensor([[3, 4, 5]]), kv_cache=T.DynamicCache(config=config))
    # and the keyword list itself: a release whose models name neither keyword is refused at discovery
    monkeypatch.setattr(internals, "CACHE_KEYWORDS", ("a_keyword_no_release_uses",))
    with pytest.raises(InternalChanged, match=r"the forward keyword carrying the KV cache"):
        T.LlamaForCausalLM._from_config(config, attn_implementation="pid")


def test_a_changed_loader_internal_stops_the_import(monkeypatch, fresh_checks):
    """What ``import pid_plugins.hf`` changes in transformers relies on three internals: a release without them
    stops the import with the message (no half-installed adapter)."""
    pytest.importorskip("transformers")
    from transformers import PreTrainedModel

    from pid_plugins.hf import install, internals

    monkeypatch.setattr(install, "_INSTALLED", [False])
    monkeypatch.delattr(PreTrainedModel, "_initialize_weights")
    with pytest.raises(InternalChanged, match=r"PreTrainedModel._initialize_weights"):
        install.install()
    assert not install._INSTALLED[0]
    assert internals.INITIALIZE_WEIGHTS in internals.INTERNALS


def test_the_getting_started_page_gives_the_tested_range():
    """docs/index.md's table of supported versions is TESTED."""
    index = (ROOT / "docs" / "index.md").read_text()
    for dist, (low, high) in TESTED.items():
        assert re.search(rf"^\| {re.escape(dist)} \| {re.escape(low)} \| {re.escape(high)} \|", index, re.M), dist


def test_learnable_parameters_under_tensor_parallelism_need_the_tp_plan_style(monkeypatch, fresh_checks):
    """A release without the plan style that sums a replicated parameter's gradients (transformers < 5.24): a model
    with learnable parameters builds and runs, adds no plan entry, and its first forward under tensor parallelism is
    refused (the gains would drift apart on the ranks), before anything is computed."""
    import dataclasses

    T, config = hf()
    from pid_plugins.hf import discovery, gains, internals

    older = dataclasses.replace(internals.TP_PLAN, check=lambda: False)
    for module in (internals, discovery, gains):  # every module that reads it
        monkeypatch.setattr(module, "TP_PLAN", older)
    config.pid = {"learnable": True}
    ids = torch.tensor([[3, 4, 5]])
    model = T.LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    assert not any("attention_params" in k for k in (model.tp_plan or {}))
    with torch.no_grad():
        model(ids)  # not tensor-parallel: runs
    model = T.LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    monkeypatch.setattr(discovery, "_tensor_parallel", lambda module: True)
    with pytest.raises(InternalChanged, match=r"replicated_with_grad_allreduce.*runs tensor parallelism with "
                                              r"learnable parameters"):
        with torch.no_grad():
            model(ids)


def _doctor_says(internal):
    """What :func:`pid_plugins.versions.doctor` finds of ``internal`` (None: it holds)."""
    [(_, problem)] = versions.doctor([internal])
    return problem


def test_a_release_whose_checkpointing_forgets_the_reentrant_choice_is_refused(monkeypatch, fresh_checks):
    """A release whose ``_set_gradient_checkpointing`` no longer keeps ``use_reentrant`` on the layers' function:
    the doctor's probe finds it, and a method model's training forward under checkpointing is refused (the choice
    cannot be read, so it counts as reentrant) before anything runs; a stock model still trains."""
    T, config = hf()
    from pid_plugins.hf import internals
    from transformers import PreTrainedModel

    assert _doctor_says(internals.CHECKPOINTING) is None
    original = PreTrainedModel._set_gradient_checkpointing

    def forgetful(self, enable=True, gradient_checkpointing_func=None, **kwargs):
        original(self, enable=enable, **kwargs)
        for m in self.modules():
            if getattr(m, "gradient_checkpointing", False):
                m._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint  # the keywords dropped

    monkeypatch.setattr(PreTrainedModel, "_set_gradient_checkpointing", forgetful)
    assert "its probe found it changed" in _doctor_says(internals.CHECKPOINTING)
    ids = torch.tensor([[3, 4, 5]])
    for name, refused in (("sdpa", False), ("pid", True)):
        model = T.LlamaForCausalLM._from_config(config, attn_implementation=name).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if refused:
            with pytest.raises(ValueError, match="needs non-reentrant gradient checkpointing"):
                model(ids, use_cache=False)
        else:
            model(ids, use_cache=False).logits.sum().backward()


def test_a_continuous_batching_entry_that_skips_init_continuous_batching_is_refused(monkeypatch, fresh_checks):
    """A release whose ``generate_batch`` no longer starts at ``init_continuous_batching`` (where a method model is
    refused): the check fails and building a method model stops with the message; a stock model still builds."""
    T, config = hf()
    from pid_plugins.hf import internals
    from transformers.generation.continuous_batching import ContinuousMixin

    assert internals.CONTINUOUS_BATCHING.check()
    monkeypatch.setattr(ContinuousMixin, "generate_batch", lambda self, inputs, *args, **kwargs: {})
    assert not internals.CONTINUOUS_BATCHING.check()
    assert _doctor_says(internals.CONTINUOUS_BATCHING) == "its check found it changed"
    T.LlamaForCausalLM._from_config(config)  # stock: nothing to refuse
    with pytest.raises(InternalChanged, match=r"init_continuous_batching"):
        T.LlamaForCausalLM._from_config(config, attn_implementation="pid")


def test_an_attention_class_that_names_the_interface_but_bypasses_it_is_refused(monkeypatch, fresh_checks):
    """The discovery signal is text (the interface's name in the attention class's source, transformers' own heuristic);
    its guard is behaviour."""
    T, config = hf()
    from pid_plugins.hf import forward, internals
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama import modeling_llama

    ids = torch.tensor([[3, 4, 5]])
    checked = T.LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    with torch.no_grad():
        checked(ids)
    assert checked.model.__dict__[forward.PLAN].verified

    class AlwaysSdpa:
        def get_interface(self, name, default):
            return sdpa_attention_forward

    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", AlwaysSdpa())
    assert internals.INTERFACE_SOURCE.check()  # the text is still there
    assert "ran none of its attention layers" in _doctor_says(internals.INTERFACE_SOURCE)
    model = T.LlamaForCausalLM._from_config(config, attn_implementation="pid").eval()
    with pytest.raises(InternalChanged, match=r"ALL_ATTENTION_FUNCTIONS.*ran none of its attention layers"):
        with torch.no_grad():
            model(ids)
    with torch.no_grad():
        checked(ids)  # (checked before the change: the check is not made again)


def test_the_real_path_checks_build_nothing_under_a_construction_context(fresh_checks):
    """Under accelerate's ``init_empty_weights`` (and any process-wide construction context) a method model builds:
    the checks it runs are types, signatures and source text, never a model of their own."""
    accelerate = pytest.importorskip("accelerate")
    T, config = hf()
    from pid_plugins.hf import internals

    with accelerate.init_empty_weights():
        model = T.LlamaForCausalLM._from_config(config, attn_implementation="pid")
        versions.require(*internals.INTERNALS[:-1])  # (TP_PLAN: from 5.24)
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta


def test_the_doctor_finds_every_internal_holding_and_leaves_torch_as_it_was():
    """``pid-plugins doctor``: every internal of every installed zoo holds under the pinned releases (make test and
    make test-compat run it), each probe runs once, and torch's RNG, default dtype and thread count are as before."""
    pytest.importorskip("timm")
    from pid_plugins import cli
    from pid_plugins.timm import internals as tm

    calls = []
    probes = [i for i in tm.INTERNALS if i.probe is not None]
    counted = [functools.partial(lambda i, p: calls.append(i.name) or p(), i, i.probe) for i in probes]
    rng, dtype, threads = torch.random.get_rng_state(), torch.get_default_dtype(), torch.get_num_threads()
    problems = [p for _, p in versions.doctor(
        [__import__("dataclasses").replace(i, probe=c) for i, c in zip(probes, counted)])]
    assert problems == [None] * len(probes) and calls == [i.name for i in probes]
    assert cli.main(["doctor"]) == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert (torch.get_default_dtype(), torch.get_num_threads()) == (dtype, threads)


#: what importing the adapters does beyond registering names (../shared/tools/import-effects counts the same)
IMPORT_EFFECTS = r"""
import json, sys, threading
import torch, transformers, timm, mmseg, mmengine  # noqa: F401  (the zoos' own import is not measured)
from torch.overrides import _get_current_function_mode_stack
built = [0]
original = torch.nn.Module.__init__
def counting(self, *args, **kwargs):
    built[0] += 1
    return original(self, *args, **kwargs)
torch.nn.Module.__init__ = counting
threads, names = torch.get_num_threads(), {t.name for t in threading.enumerate()}
modes, rng = len(_get_current_function_mode_stack()), torch.random.get_rng_state()
for adapter in sys.argv[1:]:
    __import__(adapter)
print(json.dumps({"modules": built[0], "threads": sorted({t.name for t in threading.enumerate()} - names),
                  "intra_op": torch.get_num_threads() - threads, "modes": len(_get_current_function_mode_stack()) - modes,
                  "rng": torch.equal(rng, torch.random.get_rng_state())}))
"""


def test_importing_the_adapters_registers_names_and_changes_nothing_else():
    """Importing every adapter builds no module, starts no thread, leaves torch's intra-op thread count, function
    modes and RNG as they were (a fresh process: the zoos imported first)."""
    pytest.importorskip("mmseg")
    import json

    adapters = ["pid_plugins.hf", "pid_plugins.timm", "pid_plugins.mmseg", "pid_plugins.fairseq"]
    proc = run_python_c(IMPORT_EFFECTS, timeout=600, args=adapters)
    assert proc.returncode == 0, proc.stderr[-3000:]
    effects = json.loads(proc.stdout.strip().splitlines()[-1])
    assert effects == {"modules": 0, "threads": [], "intra_op": 0, "modes": 0, "rng": True}, effects


#: import each adapter, fork, and run intra-op parallel kernels in the child: a child of a process whose OpenMP thread
#: pool had started deadlocks in its first parallel kernel (GNU OpenMP is not fork-safe)
FORK_AFTER_IMPORT = """
import os, signal, sys
import torch
for adapter in sys.argv[1:]:
    __import__(adapter)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a deadlocked child ends by SIGALRM (it computes in well under a second)
        x = torch.randn(4, 2, 64, 64)
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
        torch.randn(512, 512) @ torch.randn(512, 512)
        os._exit(0)
    print("forked after", adapter, os.waitpid(pid, 0)[1], flush=True)
"""


@pytest.mark.integration  # a fresh interpreter that imports every zoo and forks (13 s)
@pytest.mark.slow
def test_importing_an_adapter_leaves_a_forked_child_able_to_compute(tmp_path):
    """The adapters' import computes nothing: it starts no OpenMP thread pool, so a process forked after it (``torch.multiprocessing.start_processes(start_method="fork")``,
    as docs/scaling.md's pipeline example does) computes instead of deadlocking. Two threads, as a user of a 2-core
    machine has by default: the test run's workers keep one per worker (tests/conftest.py)."""
    import os

    adapters = ["pid_plugins.hf", "pid_plugins.timm", "pid_plugins.mmseg", "pid_plugins.fairseq"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    proc = run_python_c(FORK_AFTER_IMPORT, cwd=tmp_path, env=env, timeout=600, fork=False, args=adapters)
    assert proc.returncode == 0, proc.stderr[-3000:]
    forked = [line.split()[2:] for line in proc.stdout.splitlines() if line.startswith("forked after ")]
    assert forked == [[a, "0"] for a in adapters], (proc.stdout, proc.stderr[-3000:])
