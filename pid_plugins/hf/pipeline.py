"""Pipeline parallelism (``torch.distributed.pipelining``) for a decoder-only model whose method carries state across
layers: :func:`pipeline_stage` makes a stage whose forward hands that state on (docs/scaling.md)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import PreTrainedModel

from .attention import EARLIER, ROLE, STAGE_PLACEHOLDER, STATE_KEYWORD, MethodForwardState
from .config import counter_of, method_of, model_method_config
from .discovery import discovered, rediscover, relayout

__all__ = ["PipelineStageModule", "pipeline_stage", "stage_layer_range"]

logger = logging.getLogger(__name__)


class NotInStage(nn.Module):
    """The placeholder of a module another stage owns: returns its first input unchanged."""

    def __init__(self, replaced: str = "") -> None:
        super().__init__()
        setattr(self, STAGE_PLACEHOLDER, True)
        self.replaced = replaced

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))

    def extra_repr(self) -> str:
        return f"replaced={self.replaced!r}"


def stage_layer_range(stage_index: int, num_stages: int, num_layers: int) -> Tuple[int, int]:
    """The layers ``[start, end)`` stage ``stage_index`` of ``num_stages`` owns by default: transformers' even split."""
    per_stage, remainder = divmod(num_layers, num_stages)
    start = stage_index * per_stage + min(stage_index, remainder)
    return start, start + per_stage + (stage_index < remainder)


class _ContiguousGrad(torch.autograd.Function):
    """The identity whose backward makes the gradient contiguous (gloo sends only contiguous tensors)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


@dataclass
class _Carry:
    """One stage forward: what enters (the previous stage's hidden states and state) and what leaves."""

    hidden_in: Optional[Tensor]
    state_in: Optional[tuple]
    hidden_out: Optional[Tensor] = None
    state_out: Optional[tuple] = None


class PipelineStageModule(nn.Module):
    """One pipeline stage made by :func:`pipeline_stage`, the module to give ``PipelineStage``."""

    def __init__(self, model: PreTrainedModel, stage_index: int, num_stages: int,
                 layer_range: Tuple[int, int]) -> None:
        super().__init__()
        self.model = model
        self.stage_index, self.num_stages = stage_index, num_stages
        self.layer_range = layer_range
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        base = model.base_model
        layers = base.layers[layer_range[0]:layer_range[1]]
        attentions = [m for layer in layers for m in layer.modules()  # its self-attention (discovery's order)
                      if isinstance(getattr(m, ROLE, None), int) and getattr(m, ROLE) >= 0]
        # the index of the layer whose state this stage receives (None: it starts the stack), and of its last one
        earlier = getattr(attentions[0], EARLIER, ()) if attentions else ()
        self._entry: Optional[int] = earlier[0] if earlier else None
        self._exit: Optional[int] = getattr(attentions[-1], ROLE) if attentions else None
        self.__dict__["_carry"] = None  # the forward under way
        self.__dict__["_swaps"] = WeakIdKeyDictionary()  # a recomputed first layer: hidden states got -> given
        if not self.is_first:
            layers[0].register_forward_pre_hook(self._enter, with_kwargs=True)
        if not self.is_last:
            layers[-1].register_forward_hook(self._leave, with_kwargs=True)

    def state_fields(self) -> Tuple[str, ...]:
        """The names of the state tensors that cross this stage's boundaries."""
        config = self.model.config
        method = method_of(config)
        if method is None or not method.state_fields or method.is_identity(model_method_config(config, method)):
            return ()
        return tuple(method.state_fields)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        """Before this stage's first layer: its input and the forward's method state become the previous stage's."""
        arriving = args[0] if args else kwargs.get("hidden_states")
        carry: Optional[_Carry] = self.__dict__["_carry"]
        if carry is None or carry.hidden_in is None:
            replacement = self.__dict__["_swaps"].get(arriving) if isinstance(arriving, Tensor) else None
            if replacement is None:  # a forward of the model outside the stage
                return None
        else:
            replacement = carry.hidden_in
            if isinstance(arriving, Tensor):
                self.__dict__["_swaps"][arriving] = replacement
            run = kwargs.get(STATE_KEYWORD)
            if carry.state_in is not None:
                if not isinstance(run, MethodForwardState) or self._entry is None:
                    raise RuntimeError(
                        f"pipeline stage {self.stage_index}: the model's forward gave its layers no state of attention "
                        f"method {getattr(method_of(self.model.config), 'name', None)!r}: was the model switched to "
                        "another attention after pipeline_stage?"
                    )
                run.carry_in(self._entry, carry.state_in)
        if args:
            return (replacement, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": replacement}

    def _leave(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After this stage's last layer: its hidden states and the method's state leave the stage."""
        carry: Optional[_Carry] = self.__dict__["_carry"]
        if carry is None:
            return
        carry.hidden_out = output[0] if isinstance(output, (tuple, list)) else output
        run = kwargs.get(STATE_KEYWORD)
        if isinstance(run, MethodForwardState) and self._exit is not None:
            carry.state_out = run.layers.get(self._exit)

    def forward(self, *inputs: Tensor, **kwargs: Any) -> Any:
        fields = self.state_fields()
        for key in ("input_ids", "inputs_embeds", "labels", "use_cache", "cache", "past_key_values"):
            if key in kwargs:
                raise TypeError(f"pipeline stage {self.stage_index}: {key}= is not a stage keyword (the first stage "
                                "takes the input ids positionally; the stages run without a KV cache)")
        if self.is_first:
            if len(inputs) != 1:
                raise TypeError(f"pipeline stage 0 takes the input ids, one tensor; got {len(inputs)} tensors")
            feed, carry = {"input_ids": inputs[0]}, _Carry(None, None)
        else:
            if len(inputs) != 1 + len(fields):
                raise TypeError(
                    f"pipeline stage {self.stage_index} takes (hidden_states, *state) with the state of attention "
                    f"method {getattr(method_of(self.model.config), 'name', 'softmax')!r}: {1 + len(fields)} tensors "
                    f"(hidden_states{''.join(', ' + f for f in fields)}); got {len(inputs)}"
                )
            hidden, *state = (_ContiguousGrad.apply(t) if t.requires_grad else t for t in inputs)
            state = tuple(None if t.numel() == 0 else t for t in state)
            feed, carry = {"inputs_embeds": hidden}, _Carry(hidden, state if fields else None)
        self.__dict__["_carry"] = carry
        try:
            if self.is_last:
                output = self.model(**feed, use_cache=False, **kwargs)
                logits = getattr(output, "logits", None)
                return output.last_hidden_state if logits is None else logits
            self.model.base_model(**feed, use_cache=False, **kwargs)
        finally:
            self.__dict__["_carry"] = None
        if carry.hidden_out is None:
            raise RuntimeError(f"pipeline stage {self.stage_index}: its last layer did not run")
        out = [carry.hidden_out.contiguous()]
        if fields:
            if carry.state_out is None:
                raise RuntimeError(f"pipeline stage {self.stage_index}: its last layer handed on no state of attention "
                                   f"method {method_of(self.model.config).name!r}")
            out.extend(t.contiguous() if t is not None else out[0].new_empty(0) for t in carry.state_out)
        return tuple(out)

    def extra_repr(self) -> str:
        return f"stage_index={self.stage_index}, num_stages={self.num_stages}, layer_range={self.layer_range}"


def pipeline_stage(model: PreTrainedModel, stage_index: int, num_stages: int, *,
                   layer_range: Optional[Tuple[int, int]] = None) -> PipelineStageModule:
    """Stage ``stage_index`` of ``num_stages`` of ``model`` (its method chosen; changed in place, other stages'
    modules becoming placeholders), owning ``layer_range`` of ``base_model.layers`` (:func:`stage_layer_range`).

    The first stage takes ``input_ids``, a later one ``(hidden_states, *state)``; the last returns the logits, the
    others ``(hidden_states, *state)``, where ``state`` is the method's ``state_fields`` (an empty tensor for None).
    Keyword arguments go to ``schedule.step`` on every rank; stages run without a KV cache.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"pipeline_stage: a transformers PreTrainedModel, got {type(model).__name__}")
    where = type(model).__name__
    base = model.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"pipeline_stage: {where} has no base_model.layers (a ModuleList of decoder layers), which the stages "
            "split, as transformers' own pipeline parallelism does: a decoder-only family such as Llama, Mistral, "
            "Qwen2, Gemma or Phi-3"
        )
    if not (isinstance(num_stages, int) and num_stages >= 1 and isinstance(stage_index, int)
            and 0 <= stage_index < num_stages):
        raise ValueError(f"pipeline_stage: stage_index must be in [0, num_stages), got {stage_index} of {num_stages}")
    if any(getattr(m, STAGE_PLACEHOLDER, False) for m in model.modules()):
        raise ValueError(f"pipeline_stage: {where} is a pipeline stage already (its other stages' modules are "
                         "placeholders): split a whole model")
    n = len(layers)
    start, end = layer_range if layer_range is not None else stage_layer_range(stage_index, num_stages, n)
    if not 0 <= start < end <= n:
        raise ValueError(f"pipeline_stage: stage {stage_index} must own at least one of the {n} layers; got "
                         f"layers [{start}, {end})")
    if stage_index == 0 and start != 0 or stage_index == num_stages - 1 and end != n:
        raise ValueError(f"pipeline_stage: the first stage starts at layer 0 and the last ends at layer {n}; stage "
                         f"{stage_index} of {num_stages} got [{start}, {end})")
    method = method_of(model.config)
    if method is not None:
        params = model_method_config(model.config, method)
        if getattr(params, "warmup_steps", 0) or counter_of(model) is not None:
            raise ValueError(
                f"pipeline_stage: {where} warms its {method.name!r} parameters up (warmup_steps), a counter of the "
                "model's forwards, which a pipeline schedule runs once per stage and microbatch: finish the warm-up "
                "first (pid_plugins.finish_warmup(model)) or train with warmup_steps=0"
            )
        if any(isinstance(m, PreTrainedModel) and not discovered(m) for m in model.modules()):
            rediscover(model)  # number the layers while they are all there
    first, last = stage_index == 0, stage_index == num_stages - 1
    for index in range(n):
        if not start <= index < end:
            layers[index] = NotInStage(f"layers.{index}")
    if not first and isinstance(getattr(base, "embed_tokens", None), nn.Module):
        base.embed_tokens = NotInStage("embed_tokens")
    if not last:
        if isinstance(getattr(base, "norm", None), nn.Module):
            base.norm = NotInStage("norm")
        if isinstance(getattr(model, "lm_head", None), nn.Module) and model is not base:
            model.lm_head = NotInStage("lm_head")
    relayout(model)  # the layers keep their numbers
    if getattr(model.config, "tie_word_embeddings", False) and num_stages > 1 and (first or last):
        logger.warning("pipeline_stage: %s ties its output head to the input embedding; the first and the last "
                       "stage each keep a copy, which training updates separately unless their gradients are summed",
                       where)
    return PipelineStageModule(model, stage_index, num_stages, (start, end))

