"""Per-layer collapse diagnostics for any zoo model, without touching model code: forward hooks give the tokens,
a ``TorchFunctionMode`` recomputes each SDPA call's attention rows."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .measures import attention_sparsity as masked_row_sparsity
from .measures import consensus_distance, effective_rank, mean_pairwise_cosine, numerical_rank

__all__ = ["MEASURES", "find_layer_stack", "collect_layer_measures", "repeated_passes", "masked_row_sparsity",
           "AttentionRecorder"]

#: the per-layer measures of the tokens, in report order (then "attention_sparsity", from the attention calls)
MEASURES: Dict[str, Callable[[Tensor], Tensor]] = {
    "mean_cosine": mean_pairwise_cosine, "consensus_distance": consensus_distance, "numerical_rank": numerical_rank,
    "effective_rank": effective_rank}


def find_layer_stack(model: nn.Module, path: Optional[str] = None) -> Tuple[str, Sequence[nn.Module]]:
    """``(dotted path, layers)`` of the model's main stack of same-type blocks (or of ``path``)."""
    if path is not None:
        try:
            stack = model.get_submodule(path)
        except AttributeError as exc:
            raise ValueError(f"the model has no submodule {path!r} to use as its layer stack") from exc
        if not isinstance(stack, (nn.Sequential, nn.ModuleList)) or len(stack) == 0:
            raise ValueError(f"{path!r} is a {type(stack).__name__}, not a non-empty nn.Sequential/nn.ModuleList")
        return path, list(stack)
    best: Tuple[int, str, Sequence[nn.Module]] = (0, "", [])
    for name, module in model.named_modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) >= 2:
            children = list(module)
            if (len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters())
                    and len(children) > best[0]):
                best = (len(children), name, children)
    if not best[0]:
        raise ValueError(f"found no stack of same-type blocks in {type(model).__name__}: pass the stack's dotted "
                         "path (e.g. 'blocks', 'model.layers')")
    return best[1], best[2]


def _sdpa_probs(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: Optional[float] = None, **_: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """The attention probabilities an ``F.scaled_dot_product_attention`` call (its arguments) computes, and its
    allowed mask."""
    q, k = query, key
    if k.shape[-3] != q.shape[-3] and q.dim() >= 3:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    L, S = scores.shape[-2:]
    allowed = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=S - L) if is_causal else None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            scores = scores + attn_mask.float()
            finite = torch.isfinite(attn_mask) & (attn_mask > torch.finfo(attn_mask.dtype).min / 2)
            allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0), allowed


class AttentionRecorder(TorchFunctionMode):
    """Records the mean attention-row sparsity of every attention call, tagged with the current layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: Optional[int] = None
        self.sums: Dict[int, float] = {}
        self.counts: Dict[int, int] = {}

    def _record(self, probs: Tensor, allowed: Optional[Tensor]) -> None:
        s = masked_row_sparsity(probs, allowed)
        s = s[torch.isfinite(s)]
        if s.numel():
            self.sums[self.layer] = self.sums.get(self.layer, 0.0) + float(s.sum())
            self.counts[self.layer] = self.counts.get(self.layer, 0) + s.numel()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.layer is not None:
            with torch.no_grad():
                self._record(*_sdpa_probs(*args, **kwargs))
        elif func is F.multi_head_attention_forward and self.layer is not None:
            out = func(*args, **kwargs)
            with torch.no_grad():
                weights = func(*args, **dict(kwargs, need_weights=True, average_attn_weights=False))[1]
            if weights is not None:
                self._record(weights, None)
            return out
        return func(*args, **kwargs)

    def per_layer(self, n_layers: int) -> List[Optional[float]]:
        return [self.sums[i] / self.counts[i] if self.counts.get(i) else None for i in range(n_layers)]


def _first_tensor(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    raise TypeError(f"cannot find the token tensor in a layer output of type {type(output).__name__}")


def _as_tokens(x: Tensor) -> Tensor:
    """``(B, N, D)`` tokens from a layer output; ``(B, D, H, W)`` feature maps become ``(B, H*W, D)``."""
    if x.dim() == 4:
        return x.flatten(2).transpose(1, 2)
    if x.dim() != 3:
        raise ValueError(f"layer output of shape {tuple(x.shape)} is not a (batch, tokens, dim) tensor")
    return x


@contextmanager
def _hooked(layers: Sequence[nn.Module], recorder: AttentionRecorder,
            outputs: List[Optional[Tensor]]) -> Iterator[None]:
    handles = []
    for i, layer in enumerate(layers):
        def pre(_m, _args, i=i):
            recorder.layer = i

        def post(_m, _args, out, i=i):
            outputs[i] = _as_tokens(_first_tensor(out)).detach()
            recorder.layer = None

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _run(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


@torch.no_grad()
def collect_layer_measures(model: nn.Module, batches: Sequence[Any], *, layer_stack: Optional[str] = None,
                           forward: Callable[[nn.Module, Any], Any] = _run) -> Dict[str, Any]:
    """Run ``model`` on ``batches`` (eval mode); each measure per layer of its stack, averaged over sequences."""
    path, layers = find_layer_stack(model, layer_stack)
    L = len(layers)
    recorder = AttentionRecorder()
    totals = {m: [0.0] * L for m in MEASURES}
    count = 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            outputs: List[Optional[Tensor]] = [None] * L
            with _hooked(layers, recorder, outputs), recorder:
                forward(model, batch)
            missing = [i for i, o in enumerate(outputs) if o is None]
            if missing:
                raise RuntimeError(f"layers {missing} of {path!r} did not run in the forward pass")
            for i, tokens in enumerate(outputs):
                for m, measure in MEASURES.items():
                    totals[m][i] += float(measure(tokens).sum())
            count += outputs[0].shape[0]
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no batches: give at least one input batch")
    result: Dict[str, Any] = {"layer_stack": path, "num_layers": L, "num_sequences": count}
    result.update({m: [v / count for v in vals] for m, vals in totals.items()})
    result["attention_sparsity"] = recorder.per_layer(L)
    return result


@torch.no_grad()
def repeated_passes(model: nn.Module, batch: Any, passes: int = 20, *, layer_stack: Optional[str] = None,
                    forward: Callable[[nn.Module, Any], Any] = _run) -> List[float]:
    """Consensus distance E of the stack's output after each of ``passes`` passes, each fed the last output."""
    if passes < 1:
        raise ValueError("passes must be at least 1")
    path, layers = find_layer_stack(model, layer_stack)
    first, last = layers[0], layers[-1]
    carried: List[Optional[Tensor]] = [None]
    produced: List[Optional[Tensor]] = [None]

    def feed(_m, args, kwargs):
        prev = carried[0]
        if prev is None:
            return None
        if args and isinstance(args[0], Tensor):
            if args[0].shape != prev.shape:
                raise ValueError(f"cannot feed the stack's output {tuple(prev.shape)} back as its input "
                                 f"{tuple(args[0].shape)}: input and output widths differ")
            return (prev,) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=prev)
        raise ValueError(f"cannot find the token input of {type(_m).__name__} to feed back")

    def grab(_m, _args, out):
        produced[0] = _first_tensor(out).detach()

    energies: List[float] = []
    was_training = model.training
    model.eval()
    h1 = first.register_forward_pre_hook(feed, with_kwargs=True)
    h2 = last.register_forward_hook(grab)
    try:
        for _ in range(passes):
            forward(model, batch)
            if produced[0] is None:
                raise RuntimeError(f"the last layer of {path!r} did not run")
            energies.append(float(consensus_distance(_as_tokens(produced[0])).mean()))
            carried[0] = produced[0]
    finally:
        h1.remove()
        h2.remove()
        model.train(was_training)
    return energies
