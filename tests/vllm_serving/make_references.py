"""The references of the vLLM tests, made with transformers and pid_plugins.hf in the MAIN environment."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

import pid_plugins.hf  # noqa: F401  (attn_implementation="<method>")
import transformers as T

T.logging.set_verbosity_error()  # (the stock reload of a method checkpoint warns that it is one: wanted here)

#: token ids of the prompts (different lengths in one batch; the first and third share a prefix of 36 tokens, more
#: than one block of 32 of vLLM's CPU prefix cache)
_SHARED = [5, 17, 42, 99, 3, 250, 7, 64, 81, 12, 33, 190, 2, 45, 150, 77, 9, 201, 66, 31, 140, 18, 93, 205, 61, 7, 88,
           240, 13, 56, 101, 177, 29, 4, 212, 70]
PROMPTS: List[List[int]] = [
    _SHARED,
    [11, 200, 37],
    _SHARED + [8, 120, 45, 230, 19],
    [144, 2, 91, 16, 70, 4, 222],
]
NEW_TOKENS = 8
TOP = 5
SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
#: case -> (config class, method or None, its parameters (None: absent, the preset), config fields beside SIZES (None:
#: the field left out)); the first ten are served by the plugin's native classes, the rest through vLLM's Transformers
#: backend (one method per family, in rotation)
CASES: Dict[str, tuple] = {
    "llama_pid": (T.LlamaConfig, "pid", {"lambda_p": 0.3, "lambda_i": 0.2, "lambda_d": 0.15, "beta": 0.4}, {}),
    "llama_neutreno": (T.LlamaConfig, "neutreno", {"alpha": 0.5}, {}),
    "llama_value_residual": (T.LlamaConfig, "value_residual", {"lambda_1": 0.3, "lambda_2": 0.9}, {}),
    "llama_stock": (T.LlamaConfig, None, None, {}),
    "llama_twicing": (T.LlamaConfig, "twicing", {"from_layer": 1}, {}),  # layer 0 once, then twice (GQA 4/2)
    "qwen3_pid": (T.Qwen3Config, "pid", None, {"head_dim": 32}),  # config.pid absent: the lm preset
    "qwen2_value_residual": (T.Qwen2Config, "value_residual", None, {}),  # the resformer preset; q/k/v biases
    "mistral_neutreno": (T.MistralConfig, "neutreno", None, {"head_dim": 32, "sliding_window": None}),
    # Elliptical's causal form: every layer but the first rescales (GQA 4/2); Qwen3 at the lm preset (delta 1)
    "llama_elliptical": (T.LlamaConfig, "elliptical", {"mean": "prefix"}, {}),
    "qwen3_elliptical": (T.Qwen3Config, "elliptical", "lm", {"head_dim": 32}),
    "phi3_pid": (T.Phi3Config, "pid", {"lambda_p": 0.3, "lambda_i": 0.2, "lambda_d": 0.15, "beta": 0.4},
                 {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "granite_neutreno": (T.GraniteConfig, "neutreno", {"alpha": 0.5}, {}),
    "phi3_elliptical": (T.Phi3Config, "elliptical", {"mean": "prefix", "from_layer": 3},  # the last layer rescales
                        {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2_value_residual": (T.Olmo2Config, "value_residual", {"lambda_1": 0.3, "lambda_2": 0.9}, {"pad_token_id": 0}),
    "gpt_neox_pid": (T.GPTNeoXConfig, "pid", None,  # fused query_key_value, partial rotary, parallel residual
                     {"num_key_value_heads": None, "rms_norm_eps": None, "layer_norm_eps": 1e-5}),
    "qwen3_moe_neutreno": (T.Qwen3MoeConfig, "neutreno", None, {"head_dim": 32, "num_experts": 4,
                                                               "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
    "starcoder2_value_residual": (T.Starcoder2Config, "value_residual", None, {"rms_norm_eps": None,
                                                                              "norm_epsilon": 1e-5}),
    # attention logit softcapping (the adapter's eager base), every other layer a sliding window of 16 tokens
    "gemma2_neutreno": (T.Gemma2Config, "neutreno", {"alpha": 0.5},
                        {"head_dim": 32, "pad_token_id": 0, "query_pre_attn_scalar": 32, "sliding_window": 16}),
}
VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


#: the least gap between the most and the second most likely token at every greedy step: a near tie could flip with
#: rounding (vLLM's kernels against transformers'), so the seed of a case is moved until there is none
MARGIN = 1e-3


def build(case: str, attempt: int = 0) -> T.PreTrainedModel:
    config_cls, method, params, extra = CASES[case]
    torch.manual_seed(sum(map(ord, case)) + 1000 * attempt)
    fields = {**SIZES, **extra}
    config = config_cls(**{key: value for key, value in fields.items() if value is not None})
    kwargs: Dict[str, Any] = {"attn_implementation": method} if method else {}
    if method and params is not None:
        setattr(config, method, params)  # the method's parameters: config.<method>
    model = T.AutoModelForCausalLM.from_config(config, **kwargs).eval()
    with torch.no_grad():  # random weights large enough that the method's term moves the log-probs
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
            elif not torch.all(param == 1.0):  # biases (Qwen2's q/k/v); norms keep their ones
                param.normal_(0.0, 0.1)
    return model


def log_probs(model: T.PreTrainedModel, ids: List[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


def reference(model: T.PreTrainedModel, stock: Optional[T.PreTrainedModel]) -> Dict[str, Any]:
    prompts, margin = [], float("inf")
    for prompt in PROMPTS:
        with torch.no_grad():
            # no end token: NEW_TOKENS tokens, as vLLM's ignore_eos
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0].tolist()
        generated = out[len(prompt):]
        lp = log_probs(model, out)
        best = lp[len(prompt) - 1: len(out) - 1].topk(2, dim=-1).values
        margin = min(margin, (best[:, 0] - best[:, 1]).min().item())
        top = lp[: len(prompt) - 1].topk(TOP, dim=-1)
        entry = {
            "prompt": prompt,
            "generated": generated,
            # log p(prompt[i] | prompt[:i]) for i >= 1, as vLLM's prompt_logprobs
            "prompt_logprobs": [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))],
            "prompt_top": [[[int(t), float(v)] for t, v in zip(ids, vals)]
                           for ids, vals in zip(top.indices.tolist(), top.values.tolist())],
            "generated_logprobs": [lp[len(prompt) - 1 + j, tok].item() for j, tok in enumerate(generated)],
        }
        if stock is not None:  # how far the method moves the log-probs (the tests' margin is far below it)
            slp = log_probs(stock, prompt)
            entry["softmax_distance"] = max(abs(slp[i - 1, prompt[i]].item() - entry["prompt_logprobs"][i - 1])
                                            for i in range(1, len(prompt)))
        prompts.append(entry)
    return {"version": VERSION, "transformers": T.__version__, "prompts": prompts, "greedy_margin": margin}


def make(out: Path, case: str) -> None:
    folder = out / case
    done = folder / "reference.json"
    if done.exists() and json.loads(done.read_text()).get("version") == VERSION:
        return
    method = CASES[case][1]
    for attempt in range(10):
        shutil.rmtree(folder, ignore_errors=True)
        model = build(case, attempt)
        model.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        assert config.get("attn_implementation") == method, (case, config.get("attn_implementation"))
        stock = None
        if method is not None:  # the same weights with the stock attention
            stock = T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ref = reference(model, stock)
        if ref["greedy_margin"] > MARGIN:
            break
    else:
        raise AssertionError(f"{case}: every seed tried has a near tie in its greedy continuations")
    if stock is not None:
        distance = min(p["softmax_distance"] for p in ref["prompts"])
        assert distance > 1e-2, f"{case}: the method moves the log-probs by only {distance}"
    done.write_text(json.dumps(ref))
    print(f"made {case}: {folder}")


def main(argv: List[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: make_references.py OUT")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        make(out, case)


if __name__ == "__main__":
    main(sys.argv[1:])
