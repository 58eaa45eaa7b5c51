"""``pid-plugins diagnose`` and ``pid-plugins attack``: models by name, data by name, JSON + PNG out."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .models import LoadedModel, attention_of, check_attention, load_model

__all__ = ["ModelInputs", "model_inputs", "run_diagnose", "run_attack", "text_blocks", "staged_output"]


def text_blocks(text: str, tokenizer: Any, seq_len: int, max_blocks: Optional[int],
                vocab_size: int) -> Tuple[Tensor, str]:
    """Token blocks ``(n, seq_len)`` of ``text``: the model's tokenizer, or UTF-8 bytes when it has none."""
    if tokenizer is not None:
        ids = tokenizer(text[: 400 * seq_len * (max_blocks or 64)])["input_ids"]
        how = f"{type(tokenizer).__name__}"
    else:
        if vocab_size < 256:
            raise ValueError(f"the model has no tokenizer and a vocabulary of {vocab_size} < 256 byte ids")
        ids = list(text.encode("utf-8")[: seq_len * (max_blocks or 10_000)])
        how = "UTF-8 bytes as token ids (the model has no tokenizer)"
    n = min(len(ids) // seq_len, max_blocks or len(ids))
    if n < 1:
        raise ValueError(f"the text is shorter than one block of {seq_len} tokens")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len), how


def _mmseg_forward(model: nn.Module) -> Tuple[Callable[[nn.Module, Any], Any], Tuple[int, int]]:
    pre = model.data_preprocessor
    size = tuple(getattr(model.backbone, "img_size", (64, 64)))
    mean = pre.mean.view(1, -1, 1, 1) if getattr(pre, "mean", None) is not None else 0.0
    std = pre.std.view(1, -1, 1, 1) if getattr(pre, "std", None) is not None else 1.0

    def fwd(m: nn.Module, x: Tensor) -> Any:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
        return m(((x * 255.0) - mean) / std, mode="tensor")

    return fwd, size


@dataclass
class ModelInputs:
    batches: List[Any]
    forward: Callable[[nn.Module, Any], Any]
    description: str
    labels: Optional[Tensor] = None  #: image labels, for classifiers


def model_inputs(lm: LoadedModel, data: str, num_samples: int, batch_size: int, seq_len: int,
                 seed: int = 0) -> ModelInputs:
    """The batches and forward function feeding ``data`` to the model; clear errors on a mismatch."""
    from .datasets import load_images, load_text

    text_like = data in ("wiki", "shakespeare") or (Path(data).is_file()
                                                    and Path(data).suffix in (".txt", ".md", ".raw", ""))
    if lm.kind in ("causal_lm", "encoder"):
        if not text_like:
            raise ValueError(f"{lm.label} is a language model: give text (wiki, shakespeare or a .txt file), "
                             f"not {data!r}")
        vocab = int(getattr(lm.model.config, "vocab_size", 0))
        blocks, how = text_blocks(load_text(data), lm.tokenizer, seq_len, max(1, num_samples), vocab)
        batches = [{"input_ids": blocks[i:i + batch_size]} for i in range(0, len(blocks), batch_size)]
        return ModelInputs(batches, lambda m, b: m(**b), f"{len(blocks)} blocks of {seq_len} tokens of {data} ({how})")
    if text_like:
        raise ValueError(f"{lm.label} is an image model: give images (fashion-mnist, digits, auto or a folder), "
                         f"not {data!r}")
    images = load_images(data, "test", limit=num_samples, seed=seed)
    if lm.kind == "segmentation":
        fwd, size = _mmseg_forward(lm.model)
        desc = f"{len(images)} {images.source} test images resized to {size[0]}x{size[1]}"
    else:
        from .robustness import PixelClassifier

        pc = PixelClassifier(lm.model)
        num_classes = getattr(lm.model, "num_classes", None)
        if num_classes and images.num_classes > num_classes:
            raise ValueError(f"{images.source} has {images.num_classes} classes but {lm.label} predicts "
                             f"{num_classes}: build the model with num_classes (e.g. --model-kwargs "
                             "'{\"num_classes\": 10}')")
        fwd = lambda m, x: pc(x)  # noqa: E731  (pc wraps lm.model, which the hooks see)
        desc = f"{len(images)} {images.source} test images"
    batches = [images.images[i:i + batch_size] for i in range(0, len(images), batch_size)]
    return ModelInputs(batches, fwd, desc, images.labels)


def _per_model(values: Sequence[Any], models: Sequence[str], what: str) -> List[Any]:
    """One value per model: none given (None each), one for every model, or one per model in order."""
    if len(values) not in (0, 1, len(models)):
        raise ValueError(f"{len(values)} {what} for {len(models)} models: give one for all, one per --model, or none")
    return list(values) * len(models) if len(values) == 1 else list(values) or [None] * len(models)


def _load_all(models: Sequence[str], checkpoints: Sequence[str], kwargs: Dict[str, Any],
              attention: Sequence[Optional[str]] = (), attention_cfg: Sequence[Any] = ()) -> List[LoadedModel]:
    if checkpoints and len(checkpoints) != len(models):
        raise ValueError(f"{len(checkpoints)} checkpoints for {len(models)} models: give one per --model, or none")
    if attention_cfg and len(attention_cfg) != len(attention):
        raise ValueError(f"{len(attention_cfg)} --attention-cfg for {len(attention)} --attention: give one per "
                         "--attention, in order, or none")
    methods = _per_model(attention, models, "--attention")
    cfgs = _per_model(attention_cfg, models, "--attention-cfg") if attention_cfg else [None] * len(models)
    for method in methods:  # every name is checked before any model is built
        check_attention(method)
    loaded = [load_model(m, checkpoint=checkpoints[i] if checkpoints else None, kwargs=kwargs, attention=methods[i],
                         attention_cfg=cfgs[i]) for i, m in enumerate(models)]
    labels = [lm.label for lm in loaded]
    for i, lm in enumerate(loaded):
        if labels.count(lm.label) > 1:
            lm.label = f"{lm.label} #{i + 1}"
    return loaded


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A temporary folder for a run's files, moved into ``out`` only when the block succeeds."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder: give --out a new or existing folder")
    parent = out.parent if out.parent.is_dir() else None
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    try:
        yield stage
        out.mkdir(parents=True, exist_ok=True)
        for f in stage.iterdir():
            if parent is not None:
                os.replace(f, out / f.name)
            else:
                shutil.move(str(f), str(out / f.name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _start(out: str | Path, seed: int, **sizes: Tuple[int, int]) -> Path:
    """Check the sizes (each ``(value, lowest)``) and the output folder, and seed torch; the folder."""
    for name, (value, lo) in sizes.items():
        if int(value) != value or value < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {value}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder: give --out a new or existing folder")
    torch.manual_seed(seed)
    return out


def _finite(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def run_diagnose(models: Sequence[str], data: str, out: str | Path, *, checkpoints: Sequence[str] = (),
                 model_kwargs: Optional[Dict[str, Any]] = None, num_samples: int = 64, batch_size: int = 16,
                 seq_len: int = 128, passes: int = 20, layer_stack: Optional[str] = None, seed: int = 0,
                 attention: Sequence[Optional[str]] = (), attention_cfg: Sequence[Any] = (),
                 log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Per-layer measures (and repeated passes) of each model on ``data``; writes diagnose.json / .png."""
    from tqdm.auto import tqdm

    from .diagnostics import collect_layer_measures, repeated_passes
    from .plots import plot_diagnostics

    out = _start(out, seed, num_samples=(num_samples, 1), batch_size=(batch_size, 1), seq_len=(seq_len, 2),
                 passes=(passes, 0))
    results: Dict[str, Any] = {}
    # every model and its data first: mistakes are reported before any work
    prepared = [(lm, model_inputs(lm, data, num_samples, batch_size, seq_len, seed))
                for lm in _load_all(models, checkpoints, model_kwargs or {}, attention, attention_cfg)]
    for lm, inp in tqdm(prepared, desc="models"):
        log(f"{lm.label}: {inp.description}")
        stack = layer_stack or lm.layer_stack
        r = collect_layer_measures(lm.model, inp.batches, layer_stack=stack, forward=inp.forward)
        if passes:
            try:
                r["repeated_passes"] = repeated_passes(lm.model, inp.batches[0], passes, layer_stack=stack,
                                                       forward=inp.forward)
            except ValueError as exc:
                log(f"{lm.label}: no repeated passes ({exc})")
        r.update(attention_of(lm.model), data=inp.description)
        results[lm.label] = r
    report = {"data": data, "models": _finite(results)}
    with staged_output(out) as stage:
        (stage / "diagnose.json").write_text(json.dumps(report, indent=1))
        plot_diagnostics(results, stage / "diagnose.png", title=f"collapse diagnostics on {data}")
    return report


def run_attack(models: Sequence[str], data: str, out: str | Path, *, checkpoints: Sequence[str] = (),
               model_kwargs: Optional[Dict[str, Any]] = None, baseline: Optional[int] = None,
               num_samples: int = 256, batch_size: int = 64, seq_len: int = 128, seed: int = 0,
               image_options: Optional[Dict[str, Any]] = None, rates: Sequence[float] = (0.0, 0.05, 0.1, 0.2),
               attention: Sequence[Optional[str]] = (), attention_cfg: Sequence[Any] = (),
               log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Robustness of each model on ``data``, mCE relative to model ``baseline``; writes attack.json / attack.png."""
    from .plots import plot_image_robustness, plot_lm_robustness
    from .robustness import PixelClassifier, evaluate_image_robustness, evaluate_lm_robustness, relative_mce

    options = dict(image_options or {})
    out = _start(out, seed, num_samples=(num_samples, 1), batch_size=(batch_size, 1), seq_len=(seq_len, 2),
                 **{k: (options[k], 1) for k in ("pgd_steps", "spsa_iters") if k in options})
    for name, values, hi in (("noise_sigmas", options.get("noise_sigmas", ()), math.inf), ("rates", rates, 1.0),
                             ("eps_sweep", options.get("eps_sweep") or (), 1.0),
                             ("eps", [options.get("eps", 0.0)], 1.0)):
        bad = [v for v in values if not (math.isfinite(v) and 0.0 <= v <= hi)]
        if bad:
            raise ValueError(f"{name} must be finite and in [0, {hi:g}], got {bad}")
    loaded = _load_all(models, checkpoints, model_kwargs or {}, attention, attention_cfg)
    kinds = {lm.kind for lm in loaded}
    if len(kinds) > 1:
        raise ValueError(f"compare models of one kind: got {sorted(kinds)}")
    kind = kinds.pop()
    if kind not in ("image", "causal_lm"):
        raise ValueError(f"attack measures image classifiers and causal language models, not {kind} models")
    results: Dict[str, Any] = {}
    prepared = [(lm, model_inputs(lm, data, num_samples, batch_size, seq_len, seed)) for lm in loaded]
    for lm, inp in prepared:
        log(f"{lm.label}: {inp.description}")
        if kind == "image":
            r = evaluate_image_robustness(PixelClassifier(lm.model), torch.cat(inp.batches), inp.labels,
                                          batch_size=batch_size, seed=seed, **options)
        else:
            blocks = torch.cat([b["input_ids"] for b in inp.batches])
            r = evaluate_lm_robustness(lm.model, blocks, rates=rates, batch_size=batch_size, seed=seed)
        r.update(attention_of(lm.model), data=inp.description)
        results[lm.label] = r
    if kind == "image" and baseline is not None:
        base = results[loaded[baseline].label]
        for label, r in results.items():
            if "corruptions" in r:
                r["corruptions"]["mce_vs_baseline"] = relative_mce(r, base)
                r["corruptions"]["baseline"] = loaded[baseline].label
    report = {"data": data, "kind": kind, "models": _finite(results)}
    with staged_output(out) as stage:
        (stage / "attack.json").write_text(json.dumps(report, indent=1))
        if kind == "image":
            plot_image_robustness(results, stage / "attack.png", title=f"robustness on {data}")
        else:
            plot_lm_robustness(results, stage / "attack.png", title=f"perplexity under token substitution ({data})")
    return report
