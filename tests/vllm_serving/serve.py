"""Serve checkpoints with vLLM and write what it computed to JSON (run by tests/vllm_serving/test_vllm_serving.py in
.venv-vllm)."""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List


def _logprob_entries(entry: Dict[int, Any]) -> List[List[float]]:
    return [[int(token), float(lp.logprob)] for token, lp in entry.items()]


# (module-level: vLLM pickles them to its worker processes under tensor parallelism)
def _classes(model: Any) -> tuple:
    return f"{type(model).__module__}.{type(model).__qualname__}", type(getattr(model, "model", None)).__qualname__


def _compiled(model: Any) -> bool:
    inner = getattr(model, "model", None)
    return bool(getattr(inner, "compiled", False) or getattr(inner, "aot_compiled_fn", None) is not None)


def serve(run: Dict[str, Any]) -> Dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
                  max_num_seqs=8)
    engine.update(run.get("engine", {}))
    start = time.monotonic()
    saved = {name: os.environ.get(name) for name in run.get("env", {})}
    os.environ.update(run.get("env", {}))
    try:
        llm = LLM(model=run["model"], **engine)
    except Exception as exc:  # the refusals: the message is what the test reads
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                "plugin_loaded": "pid_plugins.vllm" in sys.modules}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    model_class, inner = llm.apply_model(_classes)[0]
    built, results = time.monotonic(), []
    for repeat in range(run.get("repeat", 1)):
        # a second pass over the same prompts reads the prefix cache, which vLLM does not use for a request that asks
        # for prompt log-probabilities: the second pass asks for the generated tokens' only
        params = SamplingParams(temperature=0.0, max_tokens=run["new_tokens"], ignore_eos=True,
                                logprobs=run["top"], prompt_logprobs=None if repeat else run["top"],
                                detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["prompts"]], params, use_tqdm=False)
        results.append([{
            "generated": list(out.outputs[0].token_ids),
            "generated_logprobs": [entry[token].logprob for entry, token in
                                   zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
            "prompt_logprobs": None if repeat else [_logprob_entries(entry) for entry in out.prompt_logprobs[1:]],
            "cached_tokens": getattr(out, "num_cached_tokens", None),
        } for out in outputs])
    served = time.monotonic()
    # vLLM's torch.compile wrapper of the inner model: compiled on the first forward (or loaded from its cache)
    compiled = llm.apply_model(_compiled)[0]
    del llm
    gc.collect()
    seconds = {"build": built - start, "serve": served - built, "close": time.monotonic() - served}
    return {"model_class": model_class, "inner_class": inner, "compiled": compiled, "passes": results,
            "seconds": seconds, "plugin_loaded": "pid_plugins.vllm" in sys.modules}


def main(argv: List[str]) -> None:
    runs = json.loads(open(argv[0]).read())
    out = {run["name"]: serve(run) for run in runs}
    with open(argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1:])
