"""The versions pid-plugins declares and the guard on the zoo internals its adapters read.

* pyproject's bounds, constraints.txt (make test) and constraints-lowest.txt (make test-compat) agree with
  :data:`pid_plugins.versions.TESTED`, and the installed zoos are inside the tested range;
* a version outside the range warns at import, once, naming the range;
* every internal the transformers adapter lists holds under the installed transformers, and a faked change of one
  (monkeypatch) is refused with one clear error naming the version and the tested range, before anything runs.
"""
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


def test_every_transformers_internal_holds_under_the_installed_release():
    pytest.importorskip("transformers")
    from pid_plugins.hf import internals

    older = versions._key(versions.installed_version("transformers")) < (5, 24)
    for internal in internals.INTERNALS:
        if internal is internals.TP_PLAN and older:  # from 5.24; below it TP with learnable parameters is refused
            assert not internal.check()
            continue
        assert internal.check(), internal.name


@pytest.fixture
def fresh_checks(monkeypatch):
    """Each internal is checked once per process; here every require checks again, as in a process started under
    the changed release (whatever this process imported and checked before the test changed the internal)."""
    monkeypatch.setattr(versions, "_holds", versions._holds.__wrapped__)


def test_a_changed_static_cache_internal_is_refused_before_anything_runs(monkeypatch, fresh_checks):
    """A release whose StaticLayer no longer keeps ``cumulative_length`` as a tensor: a method decoder is refused when
    it is built (discovery checks what its forwards will read), where it would otherwise read the wrong rows of the
    value buffer; and a model built before the change stops at its first static-cache forward."""
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from transformers import cache_utils

    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
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
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from pid_plugins.hf import internals

    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
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


def test_the_docs_list_every_internal_and_the_tested_range():
    """docs/architecture.md lists every internal an adapter reads; the getting-started page's table is TESTED."""
    import importlib

    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for zoo in ("hf", "timm", "mmseg", "fairseq"):
        try:
            module = importlib.import_module(f"pid_plugins.{zoo}.internals")
        except ImportError:  # the zoo is not installed, or its adapter lists no internals yet
            continue
        for internal in module.INTERNALS:
            assert internal.name in architecture, f"docs/architecture.md does not list {internal.name!r}"
    index = (ROOT / "docs" / "index.md").read_text()
    for dist, (low, high) in TESTED.items():
        assert re.search(rf"^\| {re.escape(dist)} \| {re.escape(low)} \| {re.escape(high)} \|", index, re.M), dist


def test_learnable_parameters_under_tensor_parallelism_need_the_tp_plan_style(monkeypatch, fresh_checks):
    """A release without the plan style that sums a replicated parameter's gradients (transformers < 5.24): a model
    with learnable parameters builds and runs, adds no plan entry, and its first forward under tensor parallelism is
    refused (the gains would drift apart on the ranks), before anything is computed."""
    import dataclasses

    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from pid_plugins.hf import discovery, gains, internals

    older = dataclasses.replace(internals.TP_PLAN, check=lambda: False)
    for module in (internals, discovery, gains):  # every module that reads it
        monkeypatch.setattr(module, "TP_PLAN", older)
    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
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


# ---------------------------------------------------------------- transformers' behavioural guards (probes)
def _tiny_config(T):
    return T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)


def test_a_release_whose_checkpointing_forgets_the_reentrant_choice_is_refused(monkeypatch, fresh_checks):
    """A release whose ``_set_gradient_checkpointing`` no longer keeps ``use_reentrant`` on the layers' function
    (the refusal of reentrant checkpointing reads it): the probe fails and a method model is refused when it is built
    (discovery checks what its forwards will read); a stock model still builds."""
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from pid_plugins.hf import internals
    from transformers import PreTrainedModel

    assert internals.CHECKPOINTING.check()
    original = PreTrainedModel._set_gradient_checkpointing

    def forgetful(self, enable=True, gradient_checkpointing_func=None, **kwargs):
        original(self, enable=enable, **kwargs)
        for m in self.modules():
            if getattr(m, "gradient_checkpointing", False):
                m._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint  # the keywords dropped

    monkeypatch.setattr(PreTrainedModel, "_set_gradient_checkpointing", forgetful)
    assert not internals.CHECKPOINTING.check()
    T.LlamaForCausalLM._from_config(_tiny_config(T))  # stock: nothing to refuse
    with pytest.raises(InternalChanged, match=r"_set_gradient_checkpointing"):
        T.LlamaForCausalLM._from_config(_tiny_config(T), attn_implementation="pid")


def test_a_continuous_batching_entry_that_skips_init_continuous_batching_is_refused(monkeypatch, fresh_checks):
    """A release whose ``generate_batch`` no longer starts at ``init_continuous_batching`` (where a method model is
    refused): the probe fails and building a method model stops with the message; a stock model still builds."""
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from pid_plugins.hf import internals
    from transformers.generation.continuous_batching import ContinuousMixin

    assert internals.CONTINUOUS_BATCHING.check()
    monkeypatch.setattr(ContinuousMixin, "generate_batch", lambda self, inputs, *args, **kwargs: {})
    assert not internals.CONTINUOUS_BATCHING.check()
    T.LlamaForCausalLM._from_config(_tiny_config(T))  # stock: nothing to refuse
    with pytest.raises(InternalChanged, match=r"init_continuous_batching"):
        T.LlamaForCausalLM._from_config(_tiny_config(T), attn_implementation="pid")


def test_an_attention_class_that_names_the_interface_but_bypasses_it_is_refused(monkeypatch, fresh_checks):
    """The discovery signal is text (the interface's name in the attention class's source, transformers' own
    heuristic); its guard is behaviour. A release whose Llama attention keeps that text but no longer dispatches
    through the registered function (here its module's interface always answers SDPA): the probe sees PID with
    parameters compute the stock model and refuses the method model, where it would otherwise silently run softmax."""
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from pid_plugins.hf import internals
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama import modeling_llama

    assert internals.INTERFACE_SOURCE.check()

    class AlwaysSdpa:
        def get_interface(self, name, default):
            return sdpa_attention_forward

    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", AlwaysSdpa())
    assert not internals.INTERFACE_SOURCE.check()
    with pytest.raises(InternalChanged, match=r"ALL_ATTENTION_FUNCTIONS"):
        T.LlamaForCausalLM._from_config(_tiny_config(T), attn_implementation="pid")


# ------------------------------------------------------------------- probes and the caller's context
def _probed_internals():
    """Every internal of the transformers and timm adapters whose check builds models (its own probe)."""
    pytest.importorskip("timm")
    import pid_plugins.hf  # noqa: F401
    import pid_plugins.timm  # noqa: F401
    from pid_plugins.hf import internals as hf
    from pid_plugins.timm import internals as tm

    return [hf.CHECKPOINTING, hf.CONTINUOUS_BATCHING, hf.INTERFACE_SOURCE, tm.BLOCK, tm.VIT_FORWARD, tm.XCIT]


@pytest.mark.parametrize("context", ["meta_device", "float64_default", "bfloat16_default", "no_grad"])
def test_a_probe_is_not_misled_by_the_device_or_dtype_a_caller_builds_under(context, fresh_checks):
    """Under ``torch.device("meta")`` (FSDP's meta init), another default dtype (``from_pretrained(dtype=...)`` sets
    one while it builds) or ``no_grad``, every probe still holds, and leaves torch's global RNG and default dtype as
    they were."""
    import contextlib

    internals = _probed_internals()
    dtype = {"float64_default": torch.float64, "bfloat16_default": torch.bfloat16}.get(context)
    before_dtype, before_rng = torch.get_default_dtype(), torch.random.get_rng_state()
    scope = torch.device("meta") if context == "meta_device" else (
        torch.no_grad() if context == "no_grad" else contextlib.nullcontext())
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with scope:
            for internal in internals:
                assert internal.check(), internal.name
                internal.require()
        assert torch.get_default_dtype() == (dtype or before_dtype)
    finally:
        torch.set_default_dtype(before_dtype)
    assert torch.equal(torch.random.get_rng_state(), before_rng)  # the probes drew from their own generator


def test_a_probe_under_a_process_wide_construction_context_says_so(monkeypatch, fresh_checks):
    """Under accelerate's ``init_empty_weights`` or ``deepspeed.zero.Init`` a probe cannot build its models: it raises
    ProbeUnavailable naming the context (never InternalChanged), caches nothing, and holds again outside; an answer
    the import settled is used inside the context."""
    accelerate = pytest.importorskip("accelerate")
    from pid_plugins.hf import internals

    internal = internals.INTERFACE_SOURCE
    with accelerate.init_empty_weights():
        with pytest.raises(versions.ProbeUnavailable, match=r"could not check transformers's attention classes .*"
                                                            r"init_empty_weights.*nothing was found changed"):
            internal.require()
    assert internal.check()
    zero = pytest.importorskip("deepspeed.runtime.zero.partition_parameters")
    monkeypatch.setattr(zero, "zero_init_context", 1)  # what deepspeed.zero.Init's __enter__ counts
    with pytest.raises(versions.ProbeUnavailable, match=r"deepspeed\.zero\.Init is active"):
        internal.require()
    monkeypatch.undo()
    versions._holds.cache_clear()
    versions.settle(internal)  # (what the import does)
    monkeypatch.setattr(zero, "zero_init_context", 1)
    internal.require()  # settled: the answer is kept


def test_a_probe_changes_nothing_another_thread_sees():
    """While a probe runs (and after it fails) another thread sees torch's default dtype, its global RNG, its
    intra-op thread count and the probing flag as they were."""
    import threading

    seen = {}

    def other_thread():
        seen.update(dtype=torch.get_default_dtype(), rng=torch.random.get_rng_state(), probing=versions._probing(),
                    threads=torch.get_num_threads())

    @versions.behaviour_probe
    def probe():
        torch.nn.Linear(4, 4, dtype=torch.float64)  # draws (from the probe's generator)
        assert versions._probing()
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        raise RuntimeError("a failing probe")

    rng = torch.random.get_rng_state()
    with pytest.raises(RuntimeError, match="a failing probe"):
        probe()
    assert seen["dtype"] == torch.get_default_dtype() and torch.equal(seen["rng"], rng) and not seen["probing"]
    assert seen["threads"] == torch.get_num_threads(), seen["threads"]
    assert not versions._probing() and torch.equal(torch.random.get_rng_state(), rng)


def test_settle_checks_on_one_intra_op_thread_and_restores_the_callers_count():
    """The import's checks run their kernels on one thread (no OpenMP pool started for a later fork to inherit), and
    the caller's thread count is back afterwards, also where a check fails or its probe is unavailable."""
    seen = []

    def check(answer):
        seen.append(torch.get_num_threads())
        if isinstance(answer, Exception):
            raise answer
        return answer

    internals = [versions.Internal("torch", f"settle's thread count ({label})", "this test", "-",
                                   functools.partial(check, answer))
                 for label, answer in (("holds", True), ("changed", False), ("fails", RuntimeError("gone")),
                                       ("unavailable", versions.ProbeUnavailable("a context")))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        versions.settle(*internals)
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


#: import each adapter (its probes run then), fork, and run intra-op parallel kernels in the child: a child of a
#: process whose OpenMP thread pool had started deadlocks in its first parallel kernel (GNU OpenMP is not fork-safe)
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
    """The adapters' probes build and run tiny models at import, on one intra-op thread: the import starts no
    OpenMP thread pool, so a process forked after it (``torch.multiprocessing.start_processes(start_method="fork")``,
    as docs/scaling.md's pipeline example does) computes instead of deadlocking. Two threads, as a user of a 2-core
    machine has by default: the test run's workers keep one per worker (tests/conftest.py)."""
    import os

    adapters = ["pid_plugins.hf", "pid_plugins.timm", "pid_plugins.mmseg", "pid_plugins.fairseq"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    proc = run_python_c(FORK_AFTER_IMPORT, cwd=tmp_path, env=env, timeout=600, fork=False, args=adapters)
    assert proc.returncode == 0, proc.stderr[-3000:]
    forked = [line.split()[2:] for line in proc.stdout.splitlines() if line.startswith("forked after ")]
    assert forked == [[a, "0"] for a in adapters], (proc.stdout, proc.stderr[-3000:])


def test_each_timm_probe_runs_once_per_process(monkeypatch):
    """Each probe belongs to one internal: checking every timm internal runs the block and the model probe once."""
    pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401
    from pid_plugins.timm import internals

    calls = []
    for name, probe in list(internals.PROBES.items()):
        monkeypatch.setitem(internals.PROBES, name, lambda probe=probe, name=name: calls.append(name) or probe())
    monkeypatch.setattr(versions, "_holds", functools.lru_cache(maxsize=None)(versions._holds.__wrapped__))
    versions.require(*internals.INTERNALS)
    versions.require(*internals.INTERNALS)
    assert sorted(calls) == ["block", "vit"]


def _without(name):
    def change(mapping):  # the mapping without ``name``
        return {k: v for k, v in mapping.items() if k != name}
    return change


HF_CHANGES = {  # internal: (module, attribute, the change of the attribute's current value)
    "CACHE_LAYERS": ("transformers.cache_utils", "DynamicLayer",
                     lambda layer: type("DynamicLayer", (layer,), {"crop": None})),  # a release without crop
    "TORCH_CHECKPOINT": ("torch.distributed._composable.contract", "_get_registry", lambda old: lambda module: None),
    "GLOBAL_MAPPING": ("transformers.AttentionInterface", "_global_mapping", _without("sdpa")),
    "TP_PLAN": ("transformers.distributed.tensor_parallel", "ALL_PARALLEL_STYLES",
                _without("replicated_with_grad_allreduce")),
}


@pytest.mark.parametrize("name", HF_CHANGES)
def test_each_transformers_check_refuses_a_release_that_changed_what_it_guards(name, monkeypatch, fresh_checks):
    """transformers' (and torch's) checks that no other test changes: each refuses, with the message, a release
    without what it guards."""
    pytest.importorskip("transformers")
    import importlib

    from pid_plugins.hf import internals

    where, attribute, change = HF_CHANGES[name]
    try:
        owner = importlib.import_module(where)
    except ImportError:
        module, cls = where.rsplit(".", 1)
        owner = getattr(importlib.import_module(module), cls)
    internal = getattr(internals, name)
    if not internal.check():
        pytest.skip(f"{internal.name}: not in transformers {versions.installed_version('transformers')}")
    monkeypatch.setattr(owner, attribute, change(getattr(owner, attribute)))
    assert not internal.check()
    zoo = "torch" if name == "TORCH_CHECKPOINT" else "transformers"
    with pytest.raises(InternalChanged, match=rf"{zoo} .* changed an internal pid-plugins reads: "
                                              rf"{re.escape(internal.name)}"):
        internal.require()
