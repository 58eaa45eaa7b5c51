"""Models, data and training loops shared by the distributed workers in this folder and tests/test_distributed.py.

Everything here is deterministic given its arguments, so a worker rank and the single-process reference in
the test build the same initial model and see the same global batches.
"""
from __future__ import annotations

import torch

TIMM_NAME = "pid_deit_tiny_patch16_224"
TIMM_TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
TIMM_GLOBAL_BATCH = 8
TIMM_STEPS = 4
TIMM_LR = 0.05


def timm_model(seed: int = 0):
    """A tiny PID DeiT with learnable gains (so the gains are DDP-synchronised parameters too)."""
    import timm
    import pid_plugins.timm  # noqa: F401  (registers the pid_* models)

    torch.manual_seed(seed)
    return timm.create_model(TIMM_NAME, pid=dict(learnable=True), **TIMM_TINY)


def timm_batch(step: int):
    """The global batch of `step`: images [8, 3, 32, 32] and labels [8]."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TIMM_GLOBAL_BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, TIMM_TINY["num_classes"], (TIMM_GLOBAL_BATCH,), generator=g)
    return x, y


def timm_optimizer(params):
    return torch.optim.SGD(params, lr=TIMM_LR, momentum=0.9)


HF_ROWS = 32
HF_PER_RANK = 4
HF_STEPS = 3
HF_LR = 0.5  # plain SGD (optim='sgd'): linear in the gradient, so one process reproduces DDP closely
HF_MAX_GRAD_NORM = 0.0  # no clipping: the single-process reference needs no global-norm bookkeeping


def hf_rows():
    return token_rows(HF_ROWS, seed=5)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                       attn_implementation="pid")


def llama_model(seed: int = 0):
    import pid_plugins.hf  # noqa: F401  (registers attn_implementation="pid")
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def token_rows(n: int, length: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n, length), generator=g)
