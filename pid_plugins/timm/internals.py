"""Every timm internal the adapter reads, with its check (run where the internal is first read) and, for what the
method classes compute again, its probe (``pid-plugins doctor``: timm's part and the method's, bit for bit)."""
from __future__ import annotations

import inspect
import re
from typing import Callable, Dict

import torch

from ..versions import Internal, parameters, require

__all__ = ["INTERNALS", "require"]

ZOO = "timm"


def _attn_layers() -> bool:
    from timm.layers import Attention
    from timm.models import vision_transformer

    layers = vision_transformer.ATTN_LAYERS
    return isinstance(layers, dict) and all(isinstance(k, str) for k in layers) and layers.get("attn") is Attention


def _block() -> bool:
    from timm.layers import Attention
    from timm.models.vision_transformer import Block, _create_attn

    forward = ["self", "x", "attn_mask", "is_causal"]
    return ("attn_layer" in parameters(Block.__init__)
            and parameters(_create_attn)[:3] == ["attn_layer", "dim", "num_heads"]
            and parameters(Attention.forward) == forward and parameters(Block.forward) == forward)


def _vit_forward() -> bool:
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import VisionTransformer

    init = parameters(VisionTransformer.__init__)
    return ("block_fn" in init and "attn_layer" in init
            and parameters(VisionTransformer.forward_features) == ["self", "x", "attn_mask", "is_causal"]
            and parameters(VisionTransformer.forward_intermediates)[1:] == "x indices return_prefix_tokens norm "
            "stop_early output_fmt intermediates_only output_dict attn_mask is_causal".split()
            and not {"forward_features", "forward_intermediates"} & set(vars(VisionTransformerDistilled)))


#: the probes of what the method classes compute again (``pid-plugins doctor``), registered by
#: :mod:`pid_plugins.timm.probes` (it imports the method classes, which import this module)
PROBES: Dict[str, Callable[[], bool]] = {}


def _feature_take_indices() -> bool:
    from timm.models._features import feature_take_indices

    return (parameters(feature_take_indices)[:2] == ["num_features", "indices"]
            and feature_take_indices(3, None) == ([0, 1, 2], 2) and feature_take_indices(3, 1) == ([2], 2)
            and feature_take_indices(3, [0, -2]) == ([0, 1], 1))


def _checkpoint() -> bool:
    from timm.models._manipulate import checkpoint

    return "use_reentrant" in parameters(checkpoint)


def _checkpoint_probe() -> bool:
    """timm's checkpoint hands the call to torch's with the reentrant flag given."""
    from timm.models._manipulate import checkpoint

    with torch.inference_mode(False), torch.enable_grad():  # (whatever grad mode the caller imports under)
        x = torch.ones(2, requires_grad=True)
        nodes = [type(checkpoint(torch.mul, x, x, use_reentrant=r).grad_fn).__name__ for r in (True, False)]
    return nodes == ["CheckpointFunctionBackward", "MulBackward0"]


# Source text, where no probe sees the change (each says why):
def _squashed(obj: object) -> str:
    """``obj``'s source without whitespace and with one kind of quote (a reformatting is not a change)."""
    return re.sub(r"\s+", "", inspect.getsource(obj)).replace('"', "'")


def _pretrained_source() -> bool:
    from timm.models._builder import PretrainedCfg, _resolve_pretrained_source, resolve_pretrained_cfg

    fields = set(PretrainedCfg.__dataclass_fields__)
    return (parameters(resolve_pretrained_cfg)[:3] == ["variant", "pretrained_cfg", "pretrained_cfg_overlay"]
            and {"file", "state_dict", "url", "hf_hub_id", "source"} <= fields
            and _resolve_pretrained_source({"state_dict": {"w": 0}, "file": "a.pth"})[0] == "state_dict"
            and _resolve_pretrained_source({"file": "a.pth", "url": "http://x"}) == ("file", "a.pth"))


def _classifier_drop() -> bool:
    # source text: load_pretrained's classifier drop runs only with a pretrained checkpoint of another class count,
    # which pid-plugins cannot fetch (no download) to probe with
    from timm.models._builder import load_pretrained

    source = _squashed(load_pretrained)
    return ("classifiers=pretrained_cfg.get('classifier',None)" in source
            and "ifnum_classes!=pretrained_cfg['num_classes']:" in source
            and "state_dict.pop(classifier_name+'.weight',None)" in source)


def _build_model_with_cfg() -> bool:
    # source text: the 'getter' feature class is chosen inside build_model_with_cfg from feature_cfg; probing it
    # builds a features_only model, the work the check guards
    from timm.models import build_model_with_cfg

    return ({"pretrained_filter_fn", "feature_cfg"} <= set(parameters(build_model_with_cfg))
            and "feature_cls=='getter'" in _squashed(build_model_with_cfg))


def _vit_checkpoint_filter() -> bool:
    from timm.models.vision_transformer import checkpoint_filter_fn

    return parameters(checkpoint_filter_fn)[:3] == ["state_dict", "model", "adapt_layer_scale"]


def _xcit() -> bool:
    from timm.models import xcit

    takes = {xcit.ConvPatchEmbed: "img_size patch_size in_chans embed_dim act_layer", xcit.PositionalEncodingFourier:
             "dim", xcit.LPI: "in_features act_layer", xcit.ClassAttentionBlock: "dim num_heads mlp_ratio qkv_bias "
             "proj_drop attn_drop act_layer norm_layer eta tokens_norm"}
    return (all(set(f"{args} device dtype".split()) <= set(parameters(cls.__init__)) for cls, args in takes.items())
            and parameters(xcit.PositionalEncodingFourier.forward) == ["self", "B", "H", "W"]
            and parameters(xcit.LPI.forward) == ["self", "x", "H", "W"]
            and parameters(xcit.checkpoint_filter_fn)[:2] == ["state_dict", "model"])


def _xcit_probe() -> bool:
    from timm.models import xcit

    # what FAN reads of the patch embedding: it returns the tokens and the grid, proj[0][0] is its first convolution
    embed = xcit.ConvPatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=16)
    tokens, grid = embed(torch.zeros(1, 3, 32, 48))
    if not (isinstance(embed.proj[0][0], torch.nn.Conv2d) and embed.proj[0][0].in_channels == 3
            and tuple(grid) == (4, 6) and tuple(tokens.shape) == (1, 24, 16)):
        return False

    class Model:  # what the filter reads of the model: its position encoding, class-attention blocks, state_dict keys
        pos_embed, cls_attn_blocks = object(), [None]

        @staticmethod
        def state_dict():
            return {"cls_attn_blocks.0.attn.q.weight": None}

    official = {"pos_embeder.token_projection.weight": torch.zeros(1),
                "cls_attn_blocks.0.attn.qkv.weight": torch.arange(6.0).reshape(6, 1),
                "cls_attn_blocks.0.attn.qkv.bias": torch.arange(6.0)}
    out = xcit.checkpoint_filter_fn(official, Model())
    return (set(out) == {"pos_embed.token_projection.weight"} | {f"cls_attn_blocks.0.attn.{p}.{t}" for p in "qkv"
                                                                for t in ("weight", "bias")}
            and out["cls_attn_blocks.0.attn.k.bias"].tolist() == [2.0, 3.0])


def _default_cfgs() -> bool:
    # source text: read before the names are registered (at import), when no registered model exists to probe
    from timm.models import _registry

    source = _squashed(_registry.register_model)
    return "mod=sys.modules[fn.__module__]" in source and "mod.default_cfgs[model_name]" in source


ATTN_LAYERS = Internal(
    ZOO, "timm.models.vision_transformer.ATTN_LAYERS (a dict of attn_layer names)",
    "reserving timm's own attention layer names (attention= must not shadow attn_layer='diff')", "1.0.31", _attn_layers)
BLOCK = Internal(
    ZOO, "timm's Attention.forward and Block.forward (x, attn_mask, is_causal) and what they compute (the block "
    "probe); Block(attn_layer=...) building its attention with _create_attn",
    "PIDAttention and PIDBlock, which compute them again with the method's step", "1.0.31", _block,
    lambda: PROBES["block"]())
VIT_FORWARD = Internal(
    ZOO, "VisionTransformer.forward_features / forward_intermediates (their signatures, and what they compute: the "
    "model probe)", "the method ViT's (and a converted ViT's) versions of them, threading the method's state",
    "1.0.31", _vit_forward, lambda: PROBES["vit"]())
FEATURE_TAKE_INDICES = Internal(
    ZOO, "timm.models._features.feature_take_indices(num_features, indices)",
    "forward_intermediates / prune_intermediate_layers of the method ViT and FAN (timm's index rules)",
    "1.0.31", _feature_take_indices)
CHECKPOINT = Internal(
    ZOO, "timm.models._manipulate.checkpoint(function, *args, use_reentrant=...) hands the flag to torch's checkpoint",
    "gradient checkpointing of the method blocks with timm's reentrant setting (set_reentrant_ckpt)",
    "1.0.31", _checkpoint, _checkpoint_probe)
PRETRAINED_SOURCE = Internal(
    ZOO, "timm.models._builder.resolve_pretrained_cfg and _resolve_pretrained_source (state_dict, then file, first)",
    "refusing pretrained=True without a local file or state_dict (pid-plugins never downloads weights)",
    "1.0.31", _pretrained_source)
CLASSIFIER_DROP = Internal(
    ZOO, "timm.models._builder.load_pretrained drops pretrained_cfg['classifier'] when num_classes differs",
    "the strict key check of a pretrained load not counting the classifier keys timm drops", "1.0.31", _classifier_drop)
BUILD_MODEL_WITH_CFG = Internal(
    ZOO, "build_model_with_cfg(pretrained_filter_fn=..., feature_cfg=dict(feature_cls='getter'))",
    "building the pid_* and fan_* models (pretrained loading, features_only)", "1.0.31", _build_model_with_cfg)
VIT_CHECKPOINT_FILTER = Internal(
    ZOO, "timm.models.vision_transformer.checkpoint_filter_fn(state_dict, model, adapt_layer_scale)",
    "loading ViT/DeiT checkpoints into the method ViT (timm's unwrapping and position-embedding resampling)",
    "1.0.31", _vit_checkpoint_filter)
XCIT = Internal(
    ZOO, "timm.models.xcit's ConvPatchEmbed, PositionalEncodingFourier, LPI, ClassAttentionBlock and "
    "checkpoint_filter_fn (pos_embeder -> pos_embed, class-attention qkv split)",
    "FAN's stem, positions, MLP and class attention, and official FAN checkpoints", "1.0.31", _xcit, _xcit_probe)
DEFAULT_CFGS = Internal(
    ZOO, "timm.models._registry.register_model reads the registering module's default_cfgs",
    "the pretrained cfg of every registered pid_* / fan_* name", "1.0.31", _default_cfgs)

INTERNALS = (ATTN_LAYERS, BLOCK, VIT_FORWARD, FEATURE_TAKE_INDICES, CHECKPOINT, PRETRAINED_SOURCE, CLASSIFIER_DROP,
             BUILD_MODEL_WITH_CFG, VIT_CHECKPOINT_FILTER, XCIT, DEFAULT_CFGS)
#: what a method ViT (built by name, or converted) relies on, FEATURE_TAKE_INDICES before the model probe reads it
VIT = (BLOCK, FEATURE_TAKE_INDICES, CHECKPOINT, VIT_FORWARD)
#: what FAN relies on
FAN = (XCIT, FEATURE_TAKE_INDICES, CHECKPOINT)
