"""vLLM serves a PID checkpoint with tensor_parallel_size=2 as transformers computes it on one process (make test-vllm)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REFS = Path(os.environ.get("PID_VLLM_REFS", HERE.parent.parent / ".cache" / "vllm-refs")).resolve()
TOL = 1e-4


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= TOL, f"{what}: vLLM {got}, transformers {want} (|diff| {abs(got - want):.2e} > {TOL})"


def test_vllm_serves_pid_with_tensor_parallel_size_2_as_transformers_computes_it(tmp_path):
    path = REFS / "llama_pid" / "reference.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: make test-vllm makes it (tests/vllm_serving/make_references.py)")
    ref = json.loads(path.read_text())
    runs = [{"name": "tp2", "model": str(REFS / "llama_pid"), "prompts": [p["prompt"] for p in ref["prompts"]],
             "engine": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
             "new_tokens": len(ref["prompts"][0]["generated"]), "top": 5}]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")  # (two worker processes on 2 cores)
    proc = subprocess.run([sys.executable, str(HERE / "serve.py"), str(tmp_path / "runs.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads((tmp_path / "out.json").read_text())["tp2"]
    assert "error" not in result, result.get("traceback", result.get("error"))
    print(f"vLLM llama_pid, tensor_parallel_size=2: {result['seconds']}")
    assert result["model_class"] == "pid_plugins.vllm.models.PidPluginsLlamaForCausalLM", result["model_class"]
    assert result["inner_class"] == "PidPluginsLlamaModel", result["inner_class"]
    for want, got in zip(ref["prompts"], result["passes"][0], strict=True):
        where = f"llama_pid, tensor_parallel_size=2, prompt of {len(want['prompt'])} tokens"
        assert got["generated"] == want["generated"], where
        for j, (g, w) in enumerate(zip(got["generated_logprobs"], want["generated_logprobs"], strict=True)):
            _close(g, w, f"{where}: generated token {j}")
        assert len(got["prompt_logprobs"]) == len(want["prompt_logprobs"]), where
        for i, (entries, w, top) in enumerate(zip(got["prompt_logprobs"], want["prompt_logprobs"],
                                                  want["prompt_top"])):
            given = dict((int(t), v) for t, v in entries)
            _close(given[want["prompt"][i + 1]], w, f"{where}: prompt token {i + 1}")
            for token, value in top:
                assert token in given, f"{where}: position {i + 1}: token {token} is not in vLLM's top 5"
                _close(given[token], value, f"{where}: position {i + 1}, top token {token}")
