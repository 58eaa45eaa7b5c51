"""Resolve a model for the analysis tools from a name, a local folder or a config file. Nothing is downloaded.

Accepted specs:
- a timm model name: a PID or FAN variant of the registry (``pid_deit_tiny_patch16_224``) or any timm name
  (``deit_tiny_patch16_224``), built by ``timm.create_model``; ``checkpoint`` is a local state_dict of that
  exact architecture (e.g. one you trained), loaded strictly (:func:`load_weights`). To start a PID model
  from a softmax checkpoint, use the timm adapter's ``pretrained_cfg_overlay=dict(file=...)`` instead;
- an HF variant of the registry (``pid_gpt2_wikitext103``): built from its config, randomly initialised;
- a local transformers folder (``config.json`` + weights, e.g. a ``save_pretrained`` output);
- an mmseg config file (``configs/mmseg/*.py``), built with ``mmseg.apis.init_model`` (checkpoint optional).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from torch import nn

__all__ = ["LoadedModel", "load_model", "load_weights"]


@dataclass
class LoadedModel:
    model: nn.Module
    kind: str  #: "image" (classifier), "causal_lm", "encoder" (HF encoder) or "segmentation"
    label: str
    tokenizer: Any = None
    layer_stack: Optional[str] = None  #: the stack to analyse, when the default search would pick another


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
    from mmseg.apis import init_model

    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    model = init_model(str(path), checkpoint, device="cpu")
    return LoadedModel(model, "segmentation", label, layer_stack="backbone.layers")


def load_model(
    name: str, *, checkpoint: Optional[str] = None, kwargs: Optional[Dict[str, Any]] = None
) -> LoadedModel:
    """Build the model ``name`` (see module doc) on the CPU, in eval mode."""
    kwargs = dict(kwargs or {})
    label = _label(name, checkpoint)
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json: not a transformers model folder")
        if checkpoint:
            raise ValueError("a transformers folder carries its own weights: drop --checkpoint")
        return _hf_folder(path, label)
    if path.suffix == ".py" and path.is_file():
        return _mmseg_config(path, checkpoint, label)
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")

    from ..catalogue import get_model_entry, list_models

    names = list_models("*")
    if name in names:
        entry = get_model_entry(name)
        if entry.zoo == "hf":
            import transformers

            import pid_plugins.hf

            if checkpoint:
                raise ValueError(
                    f"{name} is built from its registry config; to analyse trained weights, give the model's "
                    "save_pretrained folder instead of a name"
                )
            config = pid_plugins.hf.get_config(name, **kwargs)
            causal = entry.arch != "encoder"
            auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
            return LoadedModel(auto.from_config(config).eval(), "causal_lm" if causal else "encoder", label)
        if entry.zoo != "timm":
            raise ValueError(
                f"{name} is a {entry.zoo} model: the analysis tools take timm and transformers models by name "
                "and mmseg models by config file"
            )
    try:
        import timm
    except ImportError as exc:
        raise ValueError(f"{name!r} is not a registry or transformers name, and timm is not installed") from exc
    import pid_plugins.timm  # noqa: F401  (registers the PID and FAN variants)

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, names + timm.list_models(), n=5)
        raise ValueError(
            f"unknown model {name!r}: not a registry name, a timm model, a transformers folder or an mmseg "
            f"config file" + (f"; did you mean {', '.join(close)}?" if close else "")
        )
    model = timm.create_model(name, pretrained=False, **kwargs)
    if checkpoint:
        load_weights(model, checkpoint)
    return LoadedModel(model.eval(), "image", label)


def load_weights(model: nn.Module, checkpoint: str | Path) -> nn.Module:
    """Load a local state_dict file into ``model`` exactly (every key, nothing extra), safely.

    ``.safetensors`` files are read with safetensors, anything else with ``torch.load(weights_only=True)``;
    ``{"model": ...}`` / ``{"state_dict": ...}`` wrappers are unwrapped.
    """
    import torch

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path.name} does not fit {type(model).__name__}: missing keys {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; unexpected keys {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}. Build the model with the architecture and --model-kwargs "
            "the checkpoint was trained with"
        )
    shapes = [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if shapes:
        k = shapes[0]
        raise ValueError(
            f"{path.name} does not fit {type(model).__name__}: {len(shapes)} tensors differ in shape, e.g. {k} "
            f"{tuple(state[k].shape)} vs {tuple(expected[k].shape)}; check --model-kwargs"
        )
    model.load_state_dict(state, strict=True)
    return model
