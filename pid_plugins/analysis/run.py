"""``pid-plugins diagnose`` and ``pid-plugins attack``: models by name, data by name, JSON + PNG out."""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .models import LoadedModel, attention_of, load_model

__all__ = ["ModelInputs", "model_inputs", "run_diagnose", "run_attack", "staged_output"]


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
        text, tokenizer = load_text(data), lm.tokenizer
        if tokenizer is not None:  # the model's tokenizer, or UTF-8 bytes when it has none
            ids, how = tokenizer(text[: 400 * seq_len * num_samples])["input_ids"], type(tokenizer).__name__
        elif getattr(lm.model.config, "vocab_size", 0) < 256:
            raise ValueError("the model has no tokenizer and a vocabulary of < 256 byte ids")
        else:
            ids = list(text.encode("utf-8")[: seq_len * num_samples])
            how = "UTF-8 bytes as token ids (the model has no tokenizer)"
        n = min(len(ids) // seq_len, num_samples)
        if n < 1:
            raise ValueError(f"the text is shorter than one block of {seq_len} tokens")
        blocks = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
        batches = [{"input_ids": blocks[i:i + batch_size]} for i in range(0, len(blocks), batch_size)]
        return ModelInputs(batches, lambda m, b: m(**b), f"{len(blocks)} blocks of {seq_len} tokens of {data} ({how})")
    if text_like:
        raise ValueError(f"{lm.label} is an image model: give images (fashion-mnist, digits, auto or a folder), "
                         f"not {data!r}")
    images = load_images(data, "test", limit=num_samples, seed=seed)
    if lm.kind == "segmentation":
        pre, size = lm.model.data_preprocessor, tuple(getattr(lm.model.backbone, "img_size", (64, 64)))
        mean = pre.mean.view(1, -1, 1, 1) if getattr(pre, "mean", None) is not None else 0.0
        std = pre.std.view(1, -1, 1, 1) if getattr(pre, "std", None) is not None else 1.0

        def fwd(m: nn.Module, x: Tensor) -> Any:
            x = F.interpolate(x.expand(-1, 3, -1, -1), size=size, mode="bilinear", align_corners=False)
            return m(((x * 255.0) - mean) / std, mode="tensor")

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


def _load_all(a: Any) -> List[LoadedModel]:
    """The models of ``a`` (the options of ``pid-plugins diagnose`` / ``attack``), labelled apart."""
    models, checkpoints, attention, attention_cfg = a.model, a.checkpoint or (), a.attention or (), a.attention_cfg
    torch.manual_seed(a.seed)
    if checkpoints and len(checkpoints) != len(models):
        raise ValueError(f"{len(checkpoints)} checkpoints for {len(models)} models: give one per --model, or none")
    if attention_cfg and len(attention_cfg) != len(attention):
        raise ValueError(f"{len(attention_cfg)} --attention-cfg for {len(attention)} --attention: give one per "
                         "--attention, in order, or none")
    methods = _per_model(attention, models, "--attention")
    cfgs = _per_model(attention_cfg, models, "--attention-cfg") if attention_cfg else [None] * len(models)
    loaded = [load_model(m, checkpoint=checkpoints[i] if checkpoints else None, kwargs=a.model_kwargs,
                         attention=methods[i], attention_cfg=cfgs[i]) for i, m in enumerate(models)]
    labels = [lm.label for lm in loaded]
    for i, lm in enumerate(loaded):
        if labels.count(lm.label) > 1:
            lm.label = f"{lm.label} #{i + 1}"
    return loaded


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A temporary folder for a run's files, moved into ``out`` only when the block succeeds."""
    out = Path(out)
    parent = out.parent if out.parent.is_dir() else None
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    try:
        yield stage
        out.mkdir(parents=True, exist_ok=True)
        for f in stage.iterdir():
            shutil.move(str(f), str(out / f.name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _finite(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (dict, list, tuple)):
        return {k: _finite(v) for k, v in obj.items()} if isinstance(obj, dict) else [_finite(v) for v in obj]
    return obj


def _prepared(a: Any, loaded: Sequence[LoadedModel], log: Callable[[str], None]) -> Iterator[Tuple[Any, Any]]:
    """Each model with its inputs, all prepared first (mistakes are reported before any work), logged in turn."""
    prepared = [(lm, model_inputs(lm, a.data, a.num_samples, a.batch_size, a.seq_len, a.seed)) for lm in loaded]
    for lm, inp in prepared:
        log(f"{lm.label}: {inp.description}")
        yield lm, inp


def _write(out: Path, name: str, report: Dict[str, Any], plot: Callable[..., Any], results: Any, title: str) -> None:
    with staged_output(out) as stage:
        (stage / f"{name}.json").write_text(json.dumps(report, indent=1))
        plot(results, stage / f"{name}.png", title=title)


def run_diagnose(a: Any, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Per-layer measures (and repeated passes) of each model of ``a`` (the options of ``pid-plugins diagnose``)
    on its data; writes diagnose.json / .png."""
    from .diagnostics import collect_layer_measures, repeated_passes
    from .plots import plot_diagnostics
    results: Dict[str, Any] = {}
    for lm, inp in _prepared(a, _load_all(a), log):
        stack = a.layer_stack or lm.layer_stack
        r = collect_layer_measures(lm.model, inp.batches, layer_stack=stack, forward=inp.forward)
        if a.passes:
            try:
                r["repeated_passes"] = repeated_passes(lm.model, inp.batches[0], a.passes, layer_stack=stack,
                                                       forward=inp.forward)
            except ValueError as exc:
                log(f"{lm.label}: no repeated passes ({exc})")
        results[lm.label] = dict(r, **attention_of(lm.model), data=inp.description)
    report = {"data": a.data, "models": _finite(results)}
    _write(a.out, "diagnose", report, plot_diagnostics, results, f"collapse diagnostics on {a.data}")
    return report


def run_attack(a: Any, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Robustness of each model of ``a`` (the options of ``pid-plugins attack``; ``a.baseline``: the index of the
    model the mCE is relative to, or None) on its data; writes attack.json / attack.png."""
    from .plots import plot_image_robustness, plot_lm_robustness
    from .robustness import PixelClassifier, evaluate_image_robustness, evaluate_lm_robustness, relative_mce
    loaded = _load_all(a)
    kinds = {lm.kind for lm in loaded}
    if len(kinds) > 1:
        raise ValueError(f"compare models of one kind: got {sorted(kinds)}")
    kind = kinds.pop()
    if kind not in ("image", "causal_lm"):
        raise ValueError(f"attack measures image classifiers and causal language models, not {kind} models")
    options = dict(attacks=a.attacks, eps=a.eps, eps_sweep=a.eps_sweep or None, pgd_steps=a.pgd_steps,
                   spsa_iters=a.spsa_iters, noise_sigmas=a.noise, corruptions=a.corruptions, severities=a.severities)
    results: Dict[str, Any] = {}
    for lm, inp in _prepared(a, loaded, log):
        if kind == "image":
            r = evaluate_image_robustness(PixelClassifier(lm.model), torch.cat(inp.batches), inp.labels,
                                          batch_size=a.batch_size, seed=a.seed, **options)
        else:
            blocks = torch.cat([b["input_ids"] for b in inp.batches])
            r = evaluate_lm_robustness(lm.model, blocks, rates=a.rates, batch_size=a.batch_size, seed=a.seed)
        results[lm.label] = dict(r, **attention_of(lm.model), data=inp.description)
    if kind == "image" and a.baseline is not None:
        base = loaded[a.baseline].label
        for r in results.values():
            if "corruptions" in r:
                r["corruptions"].update(mce_vs_baseline=relative_mce(r, results[base]), baseline=base)
    report = {"data": a.data, "kind": kind, "models": _finite(results)}
    if kind == "image":
        _write(a.out, "attack", report, plot_image_robustness, results, f"robustness on {a.data}")
    else:
        _write(a.out, "attack", report, plot_lm_robustness, results, f"perplexity under token substitution ({a.data})")
    return report
