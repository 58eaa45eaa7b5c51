"""What each transformers model the adapter sees gets as its own (instance attributes, never on a class):
``_initialize_weights`` and ``init_continuous_batching``, which transformers reads on the instance
(:func:`give_instance_methods`; :func:`pid_plugins.hf.discovery.hook` gives them, to every model built after
``import pid_plugins.hf`` and to every model :func:`~pid_plugins.hf.convert` switches)."""
from __future__ import annotations

import functools
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from ..core import GainWarmup
from . import gains as learned_gains
from .record import refresh as refresh_record
from .config import method_of

__all__ = ["continuous_batching_message", "give_instance_methods"]


# ------------------------------------------------------------------------------------------- continuous batching
def continuous_batching_message(name: str) -> str:
    return (f"attention method {name!r} cannot run under continuous batching (generate_batch, "
            "init_continuous_batching, continuous_batching_context_manager, generate(cache_implementation='paged')): "
            "it runs transformers' paged attention ('paged|eager', 'sdpa' or a flash kernel) over packed sequences, "
            "not the model's attention implementation, and would switch this model's attention to flash attention "
            f"where flash-attn is installed (with only a log warning), dropping {name!r}. Generate with "
            "model.generate() (dynamic or static cache), or switch the model back to its stock attention first "
            "(model.set_attn_implementation('sdpa'))")


def _init_continuous_batching(model: PreTrainedModel, *args: Any, **kwargs: Any):
    """``model.init_continuous_batching`` (where ``generate_batch``, ``continuous_batching_context_manager`` and
    ``generate(cache_implementation="paged")`` all start): refused while the model's config names a method, before
    transformers' ``switch_to_cb_friendly_attn`` can change its attention (transformers has no extension point
    there); else the class's own."""
    method = method_of(getattr(model, "config", None))
    if method is not None:
        raise ValueError(continuous_batching_message(method.name))
    return type(model).init_continuous_batching(model, *args, **kwargs)


# ------------------------------------------------------------------------ transformers' weight initialisation
def _initialize_weights(model: PreTrainedModel, module: nn.Module, *args: Any, **kwargs: Any):
    """``model._initialize_weights`` (the one place transformers 5 initialises every module of a model: at
    construction and for the missing keys of ``from_pretrained``): learnable parameters get their initial values
    (:func:`~pid_plugins.hf.gains.reset`) and the gain warm-up counter t = 0, leaving what transformers loaded alone
    (the model's own ``_init_weights`` does not know them and would leave ``torch.empty`` values); every other module
    the class's own."""
    refresh_record(module)  # a record transformers made with torch.empty (a folder saved without one)
    if learned_gains.reset(module):
        module._is_hf_initialized = True
        return None
    if isinstance(module, GainWarmup):
        from transformers import initialization as init

        init.zeros_(module.step)
        module._is_hf_initialized = True
        return None
    return type(model)._initialize_weights(model, module, *args, **kwargs)


def give_instance_methods(model: PreTrainedModel) -> None:
    """``model``'s own ``_initialize_weights`` and ``init_continuous_batching`` (instance attributes, which transformers
    reads on the instance: this model only, never its class), once. Given to every model built after the import (the
    construction hook) and to every model :func:`~pid_plugins.hf.convert` switches."""
    own = model.__dict__
    if "_initialize_weights" not in own:
        own["_initialize_weights"] = functools.partial(_initialize_weights, model)
    if "init_continuous_batching" not in own and hasattr(type(model), "init_continuous_batching"):
        own["init_continuous_batching"] = functools.partial(_init_continuous_batching, model)
