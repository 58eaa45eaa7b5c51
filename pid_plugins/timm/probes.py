"""The probes of :mod:`pid_plugins.timm.internals` (``pid-plugins doctor``): timm's Block / ViT and the method's,
compared bit for bit."""
from __future__ import annotations

import torch
from timm.models.vision_transformer import Block, VisionTransformer

from ..core import MethodChoice, get_method
from ..versions import perturbed
from .internals import PROBES
from .vision_transformer import PIDAttention, PIDBlock, PIDVisionTransformer

__all__ = ["PROBE_BLOCK", "PROBE_VIT"]

#: the probes' stock ViT: every option of timm's Attention / Block / VisionTransformer the method classes recompute
PROBE_VIT = dict(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3, qk_norm=True,
                 init_values=0.5, reg_tokens=1, pre_norm=True)
PROBE_BLOCK = dict(dim=16, num_heads=2, qk_norm=True, init_values=0.5)


def _zero_pid() -> MethodChoice:
    method = get_method("pid")
    return MethodChoice(method, method.configure(dict(lambda_p=0.0, lambda_i=0.0, lambda_d=0.0), "timm"))


def _block_probe() -> bool:
    """timm's Block and the method's PIDBlock (PID at zero gains, the stock weights) compute the same, bit for bit."""
    stock = perturbed(Block(**PROBE_BLOCK))
    block = PIDBlock(**PROBE_BLOCK, choice=_zero_pid()).float().eval()
    block.load_state_dict(stock.state_dict())
    x = torch.randn(2, 5, PROBE_BLOCK["dim"], dtype=torch.float32)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        return (isinstance(block.attn, PIDAttention) and torch.equal(block(x), stock(x))
                and torch.equal(block(x, attn_mask=mask), stock(x, attn_mask=mask)))


def _vit_probe() -> bool:
    """The stock ViT and the method ViT (PID at zero gains) compute the same, bit for bit, on every path."""
    stock = perturbed(VisionTransformer(**PROBE_VIT))
    zero = _zero_pid()
    model = PIDVisionTransformer(**PROBE_VIT, attention=zero.method.name, attention_cfg=zero.config).float().eval()
    model.load_state_dict(stock.state_dict(), strict=False)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float32)
    tokens = 1 + 1 + (16 // 8) ** 2  # the class token, the register token, the patches
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    with torch.no_grad():
        if not (all(isinstance(b.attn, PIDAttention) for b in model.blocks) and torch.equal(model(x), stock(x))
                and torch.equal(model.forward_features(x, attn_mask=mask), stock.forward_features(x, attn_mask=mask))):
            return False
        (got, got_all), (want, want_all) = model.forward_intermediates(x), stock.forward_intermediates(x)
    return torch.equal(got, want) and len(got_all) == len(want_all) and all(map(torch.equal, got_all, want_all))


PROBES.update(block=_block_probe, vit=_vit_probe)
