"""vLLM's OpenAI-compatible server serves a method checkpoint as transformers computes it, and refuses one it cannot
serve with the reason as the last line of its output (make test-vllm)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

HERE = Path(__file__).resolve().parent
REFS = Path(os.environ.get("PID_VLLM_REFS", HERE.parent.parent / ".cache" / "vllm-refs")).resolve()
TOL = 1e-4
TOP = 5
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
#: float32 and a short context as the offline tests; eager (the compiled path is tested offline)
ARGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
        "--enforce-eager", "--seed", "0"]
START_TIMEOUT = 420  # seconds: the server's start on a loaded 2-core machine (measured: about 60 s unloaded)
REQUEST_TIMEOUT = 120


def _env() -> Dict[str, str]:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                VLLM_WORKER_MULTIPROC_METHOD="spawn", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and everything it started (its own process group), waiting a bounded time."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # what is left of the group (the engine core), also on a clean exit
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def _server(model: Path, log: Path) -> Iterator[str]:
    """A running server for ``model`` (its base URL), stopped when the block ends, however it ends."""
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([*SERVER, "--model", str(model), "--port", str(port), *ARGS], env=_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode} before it was ready:\n{_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready after {START_TIMEOUT} s:\n{_tail(log)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            time.sleep(2)
        yield url
    finally:
        _stop(proc)


def _reference(case: str) -> Dict[str, Any]:
    path = REFS / case / "reference.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: make test-vllm makes it (tests/vllm_serving/make_references.py)")
    return json.loads(path.read_text())


def _with_tokenizer(case: str, tmp: Path) -> Path:
    """A copy of the reference checkpoint ``case`` with a tokenizer (one word per token id, ``t<id>``), as a served
    model has one: the server echoes prompts and returns log-probabilities through it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp / case
    shutil.copytree(REFS / case, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(folder)
    return folder


def _token(key: str) -> int:
    assert key.startswith("token_id:"), key  # return_tokens_as_token_ids
    return int(key.split(":", 1)[1])


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= TOL, f"{what}: vLLM {got}, transformers {want} (|diff| {abs(got - want):.2e} > {TOL})"


def test_the_openai_server_serves_a_pid_checkpoint_as_transformers_computes_it(tmp_path):
    import openai

    ref = _reference("llama_pid")
    folder = _with_tokenizer("llama_pid", tmp_path)
    model = str(folder)
    start = time.monotonic()
    with _server(folder, tmp_path / "server.log") as url:
        ready = time.monotonic()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
        assert [m.id for m in client.models.list().data] == [model]
        completions: List[Any] = []
        for want in ref["prompts"]:
            completions.append(client.completions.create(
                model=model, prompt=want["prompt"], max_tokens=len(want["generated"]), temperature=0.0,
                echo=True, logprobs=TOP,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}))
    print(f"vLLM server: ready in {ready - start:.0f} s, {len(completions)} requests and stop in "
          f"{time.monotonic() - ready:.0f} s")
    for want, completion in zip(ref["prompts"], completions, strict=True):
        prompt, generated = want["prompt"], want["generated"]
        where = f"llama_pid through the server, prompt of {len(prompt)} tokens"
        logprobs = completion.choices[0].logprobs
        tokens = [_token(t) for t in logprobs.tokens]
        assert tokens == prompt + generated, where  # echo: the prompt, then the greedy continuation
        assert logprobs.token_logprobs[0] is None, where  # (the first prompt token has no log-probability)
        for i in range(1, len(prompt)):
            _close(logprobs.token_logprobs[i], want["prompt_logprobs"][i - 1], f"{where}: prompt token {i}")
            given = {_token(t): v for t, v in logprobs.top_logprobs[i].items()}
            for token, value in want["prompt_top"][i - 1]:  # the server's top 5 are transformers' top 5
                assert token in given, f"{where}: position {i}: token {token} is not in the server's top {TOP}"
                _close(given[token], value, f"{where}: position {i}, top token {token}")
        for j, value in enumerate(want["generated_logprobs"]):
            _close(logprobs.token_logprobs[len(prompt) + j], value, f"{where}: generated token {j}")


def test_the_openai_server_refuses_elliptical_sequence_mean_and_says_why_last(tmp_path):
    """An Elliptical checkpoint with the whole-sequence mean (not causal): the command exits non-zero, and the error it ends with (the last exception of its output,
    what a user reads first) is the refusal; vLLM's "Engine core initialization failed" is not in it."""
    folder = _with_tokenizer("llama_pid", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["attn_implementation"], config["elliptical"] = "elliptical", {"mean": "sequence"}
    (folder / "config.json").write_text(json.dumps(config))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*SERVER, "--model", str(folder), "--port", str(_free_port()), *ARGS], env=_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {START_TIMEOUT} s:\n{_tail(log)}")
    finally:
        _stop(proc)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    assert proc.returncode != 0, _tail(log)
    # the last exception line and its message (pydantic's ValidationError for vLLM's ModelConfig shows the
    # refusal, a ValueError, on the next lines)
    last = max((i for i, line in enumerate(lines) if re.match(r"[\w.]+(Error|Exception)\b", line)), default=0)
    final = "\n".join(lines[last:])
    assert len(lines) - last <= 4, "\n".join(lines[-40:])
    assert "Engine core initialization failed" not in final, final
    assert "attention method 'elliptical' with mean='sequence' is not causal" in final, "\n".join(lines[-40:])
