"""A model for the analysis tools (nothing is downloaded): a timm name (with a local checkpoint, loaded strictly), a
transformers registry variant, a local transformers folder, or an mmseg config file."""
from __future__ import annotations

import dataclasses
import difflib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from torch import nn

__all__ = ["LoadedModel", "load_model", "load_weights", "attention_of", "method_record", "check_attention"]


@dataclass
class LoadedModel:
    model: nn.Module
    kind: str  #: "image" (classifier), "causal_lm", "encoder" (HF encoder) or "segmentation"
    label: str
    tokenizer: Any = None
    layer_stack: Optional[str] = None  #: the stack to analyse, when the default search would pick another


def method_record(method: Optional[str], config: Any = None) -> Dict[str, Any]:
    """``{"method": name, "attention_cfg": parameters}`` for records (``"softmax"`` and None: stock)."""
    if method is None or method == "softmax":
        return {"method": "softmax", "attention_cfg": None}
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return {"method": method, "attention_cfg": config if isinstance(config, (dict, str, type(None))) else repr(config)}


def attention_of(model: nn.Module) -> Dict[str, Any]:
    """The attention ``model`` runs, as :func:`method_record`."""
    from ..core import get_method, list_methods
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None:  # transformers
        if implementation in list_methods():
            from pid_plugins.hf import model_method_config
            method = get_method(implementation)
            return method_record(method.name, model_method_config(config, method))
        return method_record(None)
    for module in model.modules():
        method = getattr(module, "attention_method", None)
        if method is not None:
            return method_record(method.name, getattr(module, "attention_config", None))
    return method_record(None)


def check_attention(attention: Optional[str]) -> None:
    """Refuse an attention name that is neither ``"softmax"`` nor a registered method, saying which exist."""
    from ..core import SOFTMAX, list_methods
    if attention is not None and attention != SOFTMAX and attention not in list_methods():
        raise ValueError(f"unknown attention method {attention!r}: choose from {', '.join([SOFTMAX, *list_methods()])} "
                         "(pid_plugins.register_method adds one)")


def _label(name: str, checkpoint: Optional[str]) -> str:
    path = Path(name)
    if path.exists():
        name = path.stem if path.suffix == ".py" else path.name
    return f"{name} ({Path(checkpoint).name})" if checkpoint else name


def _hf_folder(path: Path, label: str) -> LoadedModel:
    import transformers

    import pid_plugins.hf  # noqa: F401  (registers attn_implementation="pid")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(path, local_files_only=True)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, "causal_lm" if causal else "encoder", label, tokenizer)


def _mmseg_config(path: Path, checkpoint: Optional[str], label: str) -> LoadedModel:
    import pid_plugins.mmseg  # noqa: F401  (registers the PID backbone, the mmcv stand-in)
    from mmengine.config import Config
    from mmseg.apis import init_model

    from pid_plugins.mmseg.checkpoint import weights_only_schemes
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    try:
        cfg = Config.fromfile(str(path))
    except Exception as exc:  # noqa: BLE001  (any error raised by running the user's config file)
        raise ValueError(f"cannot read the mmseg config {path}: {type(exc).__name__}: {exc}") from None
    try:
        with weights_only_schemes():  # mmseg's init_model loads through mmengine's CheckpointLoader
            model = init_model(cfg, checkpoint, device="cpu")
    except (KeyError, TypeError, AttributeError, AssertionError, RuntimeError, EOFError, pickle.UnpicklingError,
            OSError) as exc:
        # unregistered types or bad arguments in the config; a damaged or refused checkpoint file
        what = f" with the checkpoint {checkpoint}" if checkpoint else ""
        raise ValueError(f"cannot build a model from the mmseg config {path}{what}: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:700]}") from None
    return LoadedModel(model, "segmentation", label, layer_stack="backbone.layers")


def _hf_attention(lm: LoadedModel, attention: Optional[str], attention_cfg: Any) -> LoadedModel:
    """A transformers model switched to ``attention`` (None: as built), weights untouched."""
    if attention is None:
        return lm
    from ..core import resolve_attention
    from pid_plugins.hf import convert
    choice = resolve_attention(attention, attention_cfg, zoo="hf", where=lm.label)
    convert(lm.model, *(("softmax",) if choice is None else (choice.method.name, choice.config)))
    return lm


def load_model(name: str, *, checkpoint: Optional[str] = None, kwargs: Optional[Dict[str, Any]] = None,
               attention: Optional[str] = None, attention_cfg: Any = None) -> LoadedModel:
    """Build the model ``name`` (see module doc) on the CPU, in eval mode, with ``attention`` and ``attention_cfg``."""
    kwargs = dict(kwargs or {})
    check_attention(attention)
    if attention is None and attention_cfg is not None:
        raise ValueError(f"attention parameters {attention_cfg!r} are given without an attention method: "
                         "name the method too (--attention)")
    if attention is not None and {"attention", "attention_cfg", "pid"} & set(kwargs):
        raise ValueError(f"--model-kwargs {sorted({'attention', 'attention_cfg', 'pid'} & set(kwargs))} and "
                         "--attention both choose the attention: give it once, with --attention / --attention-cfg")
    label = _label(name, checkpoint) + (f" [{attention}]" if attention is not None else "")
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json: not a transformers model folder")
        if checkpoint:
            raise ValueError("a transformers folder carries its own weights: drop --checkpoint")
        if kwargs:
            raise ValueError(f"{path} is a transformers folder: its config.json sets the model, so --model-kwargs "
                             f"{sorted(kwargs)} would be ignored; drop --model-kwargs (or edit config.json)")
        return _hf_attention(_hf_folder(path, label), attention, attention_cfg)
    if path.suffix == ".py" and path.is_file():
        if kwargs:
            raise ValueError(f"{path} is an mmseg config: it sets the model, so --model-kwargs {sorted(kwargs)} would "
                             "be ignored; drop --model-kwargs (or edit the config)")
        if attention is not None:
            raise ValueError(f"{path} is an mmseg config: it sets the attention (the backbone's attention= and "
                             "attention_cfg=), so drop --attention (or edit the config)")
        return _mmseg_config(path, checkpoint, label)
    if path.suffix == ".py":
        raise FileNotFoundError(f"mmseg config not found: {path}")

    from ..catalogue import get_model_entry, list_models
    names = list_models("*")
    if name in names:
        entry = get_model_entry(name)
        if entry.zoo == "hf":
            import transformers

            import pid_plugins.hf
            if checkpoint:
                raise ValueError(f"{name} is built from its registry config; to analyse trained weights, give the "
                                 "model's save_pretrained folder instead of a name")
            config = pid_plugins.hf.get_config(name)
            unknown = sorted(set(kwargs) - set(config.to_dict()))
            if unknown:
                raise ValueError(f"--model-kwargs: {type(config).__name__} has no option {', '.join(unknown)}; "
                                 f"options include {', '.join(sorted(config.to_dict())[:12])} ...")
            config = pid_plugins.hf.get_config(name, **kwargs)
            causal = entry.arch != "encoder"
            auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
            lm = LoadedModel(auto.from_config(config).eval(), "causal_lm" if causal else "encoder", label)
            return _hf_attention(lm, attention, attention_cfg)
        if entry.zoo != "timm":
            raise ValueError(f"{name} is a {entry.zoo} model: the analysis tools take timm and transformers models by "
                             "name and mmseg models by config file")
    try:
        import timm
    except ImportError as exc:
        raise ValueError(f"{name!r} is not a registry or transformers name, and timm is not installed") from exc
    import pid_plugins.timm
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, names + timm.list_models(), n=5)
        raise ValueError(f"unknown model {name!r}: not a registry name, a timm model, a transformers folder or an "
                         "mmseg config file" + (f"; did you mean {', '.join(close)}?" if close else ""))
    # pid_plugins' own names (pid_*, fan_*) are built with the attention; a stock model is converted after loading
    built_with = attention is not None and timm.models.model_entrypoint(name).__module__.startswith("pid_plugins.")
    choice = dict(attention=attention, attention_cfg=attention_cfg) if built_with else {}
    try:
        model = timm.create_model(name, pretrained=False, **kwargs, **choice)
    except TypeError as exc:
        if not kwargs:
            raise
        raise ValueError(f"--model-kwargs {sorted(kwargs)} do not fit {name}: {exc}") from None
    if checkpoint:
        load_weights(model, checkpoint)
    if attention is not None and not built_with and (attention != "softmax" or attention_cfg is not None):
        try:
            model = pid_plugins.timm.convert(model, attention, attention_cfg)
        except TypeError as exc:
            raise ValueError(f"--attention {attention!r} needs a ViT/DeiT or a pid_*/fan_* model: {exc}") from None
    return LoadedModel(model.eval(), "image", label)


def load_weights(model: nn.Module, checkpoint: str | Path) -> nn.Module:
    """Load a local state_dict file (safetensors, or weights-only ``torch.load``) into ``model`` strictly."""
    import torch
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {path} as safetensors ({exc}): the file is damaged or not a "
                             "safetensors file; save the weights again") from None
    else:
        try:  # explicit weights_only=True: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot turn it off
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            detail = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Please file",
                                                               "Check the documentation"))]
            reason = (detail or lines or ["unreadable pickle"])[0]
            if "global" not in reason.lower():  # not a refused class: bytes that are no pickle at all
                raise ValueError(f"cannot read {path} as a torch checkpoint ({reason}): the file is damaged or "
                                 "not a torch.save file; save the weights again") from None
            raise ValueError(f"refused to load {path}: not a plain state_dict file ({reason}); checkpoints are "
                             "read with weights_only=True, so give tensors only (torch.save(model.state_dict()) or "
                             ".safetensors)") from None
        except (RuntimeError, EOFError, OSError) as exc:
            raise ValueError(f"cannot read {path} as a torch checkpoint ({' '.join(str(exc).split())[:200]}): the "
                             "file is damaged or not a torch.save file; save the weights again") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state_dict (a dict of tensors)")
    for key in ("model", "state_dict"):
        if isinstance(state.get(key), dict):
            state = state[key]
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path.name} does not fit {type(model).__name__}: missing keys {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; unexpected keys {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}. Build the model with the architecture and "
                         "--model-kwargs the checkpoint was trained with")
    shapes = [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if shapes:
        k = shapes[0]
        raise ValueError(f"{path.name} does not fit {type(model).__name__}: {len(shapes)} tensors differ in shape, "
                         f"e.g. {k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}; check --model-kwargs")
    model.load_state_dict(state, strict=True)
    return model
