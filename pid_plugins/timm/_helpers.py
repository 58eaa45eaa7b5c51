"""What every timm family shares: the attention choice, the method's step and the block loop, local-only
pretrained sources, strict key checks, and registering the catalogue's entries with timm."""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from timm.layers import register_notrace_function
from timm.models import generate_default_cfgs, register_model

from .internals import ATTN_LAYERS, CHECKPOINT, CLASSIFIER_DROP, DEFAULT_CFGS, PRETRAINED_SOURCE

CHECKPOINT.require()  # a private module of timm, read from here on
from timm.models._manipulate import checkpoint  # noqa: E402

from ..catalogue import ModelEntry, load_catalogue  # noqa: E402
from ..core import (  # noqa: E402
    FX_LEAVES, SOFTMAX, AttentionContext, LayerCall, MethodChoice, MissingLayerState, check_keys, reserve_names,
    resolve_attention,
)
from ..core.layer import MethodLayer as CoreMethodLayer  # noqa: E402
from ..core.methods import calls_once, update_once  # noqa: E402


def _timm_names() -> Dict[str, str]:
    """timm's own names of ViT attention layers (``attn_layer='diff'``, ...), which ``attention=`` must not shadow."""
    from timm.models import vision_transformer

    ATTN_LAYERS.require()
    return {name: f"its attn_layer={name!r} (timm.models.vision_transformer.ATTN_LAYERS)"
            for name in vision_transformer.ATTN_LAYERS if name}


reserve_names("timm", _timm_names)


#: how to run a timm block with its method's state, named in core's MissingLayerState
STATE_ROUTE = (
    "With timm, build the model by its pid_* name (timm.create_model('pid_<name>', pretrained=True, "
    "pretrained_cfg_overlay=dict(file=...), attention=..., attention_cfg=...); a softmax checkpoint loads as is): its "
    "class threads the state in every path (forward, attn_mask / is_causal, set_grad_checkpointing, "
    "forward_intermediates, torch.fx feature extraction), and so does a stock VisionTransformer converted with "
    "pid_plugins.timm.convert. By hand (a pipeline stage): x, *state = block(x, *state, with_state=True), with "
    "warmup_scale= the forward's warm-up scale under warm-up (FAN: block(x, H, W, *state)), handing the state "
    "tensors on beside x."
)


class MethodLayer(CoreMethodLayer):
    """Core's :class:`~pid_plugins.core.layer.MethodLayer` with the timm attention call."""

    def method_attention(
        self, attend: Callable[[Tensor, Tensor], Tensor], q: Tensor, v: Tensor, state: Optional[Tuple[Any, ...]],
        scale: Optional[Tensor], causal: Any = False,
    ) -> Tuple[Tensor, Optional[tuple]]:
        """The layer's attention output ``(B, H, N, D)`` under its method and the state for the next layer."""
        if not self.method_active:
            return attend(q, v), state
        if scale is None and getattr(self.attention_config, "warmup_steps", 0):
            raise MissingLayerState(f"attention method {self.attention_method.name!r}: layer {self.layer_index} runs "
                                    "under gain warm-up (warmup_steps="
                                    f"{self.attention_config.warmup_steps}) but got no warm-up scale "
                                    "(warmup_scale=), which the model reads from its counter once per forward: it "
                                    f"would run at full scale. {STATE_ROUTE}")
        method = self.attention_method
        if scale is None and self.attention_params is None and calls_once(method) and not isinstance(v, torch.fx.Proxy):
            return update_once(method, self.attention_config, attend(q, v), v, state, -3, self.layer_index,
                               state_route=STATE_ROUTE)  # PID, NeuTRENO: the hot path, no LayerCall
        drop = getattr(self, "attn_drop", None)
        context = AttentionContext(causal=causal, dropout=self.training and drop is not None and drop.p > 0)
        return self.apply_method(LayerCall(attend, q, v, v, context=context, scale=scale, layer=self.layer_index,
                                           state_route=STATE_ROUTE), state)


for _leaf in FX_LEAVES:
    register_notrace_function(_leaf)


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, args: Sequence[Any], use_checkpoint: bool,
               take_indices: Optional[Sequence[int]] = None, norm: Optional[nn.Module] = None,
               warmup_scale: Optional[Tensor] = None, **kwargs: Any) -> Tuple[Tensor, List[Tensor]]:
    """``block(x, *args, *state, **kwargs) -> (x, *state)`` over the blocks: the output, the (normed) intermediates."""
    state: Tuple[Any, ...] = ()
    intermediates: List[Tensor] = []
    if warmup_scale is not None:
        kwargs = dict(kwargs, warmup_scale=warmup_scale)
    for i, blk in enumerate(blocks):
        if use_checkpoint and not torch.jit.is_scripting():
            out = checkpoint(partial(blk, **kwargs) if kwargs else blk, x, *args, *state)
        else:
            out = blk(x, *args, *state, **kwargs)
        x, state = out[0], tuple(out[1:])
        if take_indices is not None and i in take_indices:
            intermediates.append(norm(x) if norm is not None else x)
    return x, intermediates


def state_outputs(state: Optional[tuple], size: int) -> Tuple[Any, ...]:
    """The state as a block's output tail, indexed field by field (torch.fx proxies too), before the block's x: the
    block's last traced operation is x (fx feature extraction by module name)."""
    return () if state is None else tuple(state[i] for i in range(size))


def check_pretrained_source(name: str, base: str, kwargs: Dict[str, Any]) -> None:
    """Refuse ``pretrained=True`` unless a local file (or an in-memory state_dict) is given."""
    PRETRAINED_SOURCE.require()
    CLASSIFIER_DROP.require()  # read when the checkpoint's keys are checked (finish_state_dict)
    from timm.models._builder import resolve_pretrained_cfg

    cfg = resolve_pretrained_cfg(name, pretrained_cfg=kwargs.get("pretrained_cfg"),
                                 pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay"))
    hint = (
        f"pid-plugins never downloads weights: point {name} at a local checkpoint with "
        "create_model(..., pretrained=True, pretrained_cfg_overlay=dict(file='/path/to/weights.pth')) "
        "(.pth, .pth.tar or .safetensors; timm train.py: --pretrained --pretrained-path PATH). A softmax "
        f"checkpoint of {base} loads as is"
    )
    if cfg.state_dict is not None:
        return
    if not cfg.file:
        raise FileNotFoundError(f"no pretrained weights file given for {name}. {hint}")
    if not os.path.isfile(cfg.file):
        raise FileNotFoundError(f"pretrained weights file not found: {cfg.file!r}. {hint}")


def finish_state_dict(out: Dict[str, Tensor], model: nn.Module, hint: str) -> Dict[str, Tensor]:
    """Fill the learnable parameters and warm-up counter a softmax checkpoint lacks; check the keys strictly."""
    CLASSIFIER_DROP.require()
    expected = model.state_dict()
    for name, value in expected.items():
        if ".attention_params." in name and name not in out:
            out[name] = value.detach().clone()
        elif name == "attention_warmup.step" and name not in out:  # no warm-up counter in the checkpoint: t starts at 0
            out[name] = torch.zeros_like(value)
    cfg = getattr(model, "pretrained_cfg", None) or {}  # timm's load_pretrained drops another num_classes' classifier
    heads = cfg.get("classifier") if getattr(model, "num_classes", None) != cfg.get("num_classes") else None
    dropped = {f"{c}.{w}" for c in ((heads,) if isinstance(heads, str) else heads or ()) for w in ("weight", "bias")}
    check_keys(expected, out, type(model).__name__, hint, ignore=dropped)
    return out


def entry_choice(entry: ModelEntry, default_attention: str, kwargs: Dict[str, Any],
                 name: str) -> Optional[MethodChoice]:
    """Pop and resolve ``attention`` / ``attention_cfg`` (the entry's method starts from the entry's parameters)."""
    attention = kwargs.pop("attention", default_attention)
    default = entry.default_config() if attention == entry.method else None
    return resolve_attention(attention, kwargs.pop("attention_cfg", None), zoo="timm", default=default,
                             where=f"timm model {name!r}")


def register_entries(module_name: str, entries: Iterable[ModelEntry], create: Callable[..., nn.Module],
                     pretrained_cfg: Callable[[ModelEntry], Dict[str, Any]], with_base: bool = False) -> Dict[str, Any]:
    """Register each entry's name (``with_base``: its softmax base name too) into timm; the ``default_cfgs``."""
    import sys

    DEFAULT_CFGS.require()
    entries = list(entries)
    names = [(e, e.name, e.method) for e in entries] + ([(e, e.base, SOFTMAX) for e in entries] if with_base else [])
    module = sys.modules[module_name]
    module.default_cfgs = generate_default_cfgs({name: pretrained_cfg(e) for e, name, _ in names})
    for entry, name, attention in names:
        register_model(_entrypoint(module_name, entry, name, attention, create))
    return module.default_cfgs


def _entrypoint(module_name: str, entry: ModelEntry, name: str, attention: str, create: Callable[..., nn.Module]):
    def model_fn(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return create(entry, name, attention, pretrained, **kwargs)

    kind = f"{attention} attention, preset `{entry.preset}`" if attention != SOFTMAX else "softmax attention"
    model_fn.__name__ = model_fn.__qualname__ = name
    model_fn.__module__, model_fn.__doc__ = module_name, f"{entry.description} ({kind})."
    return model_fn


def catalogue_entries(arches: Iterable[str]) -> list[ModelEntry]:
    arches = set(arches)
    return [e for e in load_catalogue().values() if e.zoo == "timm" and e.arch in arches]
