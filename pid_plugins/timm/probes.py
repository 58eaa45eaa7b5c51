"""The behavioural probes of :mod:`pid_plugins.timm.internals` (registered in its ``PROBES`` on import): the method
classes compute timm's Attention, Block and VisionTransformer forwards again, and each probe builds timm's module and
the method's on the same perturbed weights, PID at zero gains, and compares their outputs bit for bit. A timm release
that computes differently fails its probe, whatever its source text; one that only rewrites the text passes."""
from __future__ import annotations

import torch
from timm.models.vision_transformer import Block, VisionTransformer

from ..core import MethodChoice, get_method
from ..versions import behaviour_probe, perturbed
from .internals import PROBES
from .vision_transformer import PIDAttention, PIDBlock, PIDVisionTransformer

__all__ = ["PROBE_BLOCK", "PROBE_VIT"]

#: the probe's stock ViT: every option of timm's Attention / Block / VisionTransformer the method classes recompute
PROBE_VIT = dict(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3, qk_norm=True,
                 init_values=0.5, reg_tokens=1, pre_norm=True)
PROBE_BLOCK = dict(dim=16, num_heads=2, qk_norm=True, init_values=0.5)


def _zero_pid() -> MethodChoice:
    method = get_method("pid")
    return MethodChoice(method, method.configure(dict(lambda_p=0.0, lambda_i=0.0, lambda_d=0.0), "timm"))


@behaviour_probe
def _block_probe() -> bool:
    """timm's Block and the method's PIDBlock (PID at zero gains, the stock weights) compute the same, bit for bit."""
    stock = perturbed(Block(**PROBE_BLOCK))
    block = PIDBlock(**PROBE_BLOCK, choice=_zero_pid()).eval()
    block.load_state_dict(stock.state_dict())
    x = torch.randn(2, 5, PROBE_BLOCK["dim"])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        return (isinstance(block.attn, PIDAttention) and torch.equal(block(x), stock(x))
                and torch.equal(block(x, attn_mask=mask), stock(x, attn_mask=mask)))


@behaviour_probe
def _vit_probe() -> bool:
    """The stock ViT and the method ViT (PID at zero gains, the stock weights) compute the same, bit for bit: forward,
    forward_features with a mask, and every intermediate of forward_intermediates."""
    stock = perturbed(VisionTransformer(**PROBE_VIT))
    zero = _zero_pid()
    model = PIDVisionTransformer(**PROBE_VIT, attention=zero.method.name, attention_cfg=zero.config).eval()
    model.load_state_dict(stock.state_dict(), strict=False)
    x = torch.randn(2, 3, 16, 16)
    tokens = 1 + 1 + (16 // 8) ** 2  # the class token, the register token, the patches
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    with torch.no_grad():
        if not (all(isinstance(b.attn, PIDAttention) for b in model.blocks) and torch.equal(model(x), stock(x))
                and torch.equal(model.forward_features(x, attn_mask=mask), stock.forward_features(x, attn_mask=mask))):
            return False
        got, want = model.forward_intermediates(x), stock.forward_intermediates(x)
    return torch.equal(got[0], want[0]) and len(got[1]) == len(want[1]) and all(
        torch.equal(a, b) for a, b in zip(got[1], want[1]))


PROBES.update(block=_block_probe, vit=_vit_probe)
