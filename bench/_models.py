"""The models `make bench` compares, shared by its sections (run_all.py, op_counts.py, host_cost.py): the small
transformers Llamas and the method list of the decoding rows. Each pair is the stock model and the same weights
converted to a method."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

# a 12-layer hidden-768 Llama (the width of deit_base / GPT-2 small), grouped-query: the cost-by-size row
HF_BASE_CFG = dict(vocab_size=8000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)
HF_CFG = dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=1024)
# SmolLM2-135M's shape (random weights): 30 layers, hidden 576, 9 query / 3 key-value heads
SMOLLM2_CFG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)


#: the methods besides PID with a decoding row (their transformers parameters: Twicing in every layer, Elliptical's
#: causal prefix mean, ResFormer's 0.5/0.5)
HF_SIBLINGS = (("neutreno", None), ("twicing", {"from_layer": 0}), ("elliptical", {"mean": "prefix"}),
               ("value_residual", None))


def hf_pair(cfg: Optional[Dict[str, Any]] = None, method: str = "pid", params: Any = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf

    cfg = cfg or HF_CFG
    torch.manual_seed(0)
    stock = LlamaForCausalLM(LlamaConfig(**cfg))
    stock.set_attn_implementation("sdpa")
    pid = LlamaForCausalLM(LlamaConfig(**cfg))
    pid.load_state_dict(stock.state_dict())
    pid_plugins.hf.convert(pid, method, params)
    return stock, pid
