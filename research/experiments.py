"""Softmax vs PID on real data through the zoo adapters: the demo's and the reproduction's experiments.

Vision: a small DeiT (timm adapter) trained twice from the same initial weights and data order, softmax and
PID, on Fashion-MNIST (scikit-learn's digits when it is not installed); then clean accuracy, FGSM/PGD over an
eps sweep, Gaussian noise, corruptions and the per-layer collapse measures (``pid_plugins.analysis``).

Language: a small Llama (transformers adapter, grouped-query attention) trained softmax vs PID on the real
Wikipedia articles shipped with gensim, byte-level (vocabulary 256, so no tokenizer is needed); validation
perplexity, perplexity under token substitution, collapse measures.

Trained weights are cached in the output folder, one safetensors file per model whose metadata holds the
training key (a hash of the spec, the PID gains' values, the library versions and the source of the code that
builds and trains the model) and the training log. A rerun with the same key goes straight to evaluation; a
damaged file or another key is retrained, with a message. Files are written atomically (temporary file +
rename), and :func:`output_lock` keeps two runs from writing into one folder at once.

The models compared are the spec's ``arms`` (:func:`parse_arm`: the built-in :data:`ARMS` or any registered
attention method with its parameters; :func:`arm_choice` resolves them): every arm is built
from the softmax model's initial weights, trained, cached (``vision_<label>.safetensors``), evaluated and
reported in turn (with its ``method`` and ``attention_cfg``); the cache key covers every built-in arm's gains
and the method, parameters and code of the spec's method arms.
"""
from __future__ import annotations

import copy
import fcntl
import hashlib
import inspect
import json
import math
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VisionSpec", "LanguageSpec", "run_vision", "run_language", "ARMS", "Arm", "parse_arm", "split_arms",
           "arm_choice", "arm_config", "arm_record", "check_arms",
           "output_lock", "atomic_path", "write_atomic", "code_fingerprint"]

Log = Callable[[str], None]

#: The built-in arms, each trained from the softmax model's initial weights and data order: ``softmax``; ``pid``
#: (the spec's preset, first layer controlled, eq. 25 as written); ``pid_ref`` (the same gains with a
#: reference-only first layer, ``control_first_layer=False``); ``neutreno`` (the P-only special case of PID,
#: lambda 0.6 for vision and 0.4 for language, as in the NeuTRENO paper). Any registered attention method is an
#: arm too (:func:`parse_arm`).
ARMS = ("softmax", "pid", "pid_ref", "neutreno")


class Arm(NamedTuple):
    """One arm, read from its text by :func:`parse_arm`: ``label`` (its name in records and cached file names),
    ``method`` (``"softmax"`` or a registered attention method) and ``params`` (the method's parameters as given:
    None for its default preset, a preset name, or a dict of overrides; built-in arms: None)."""

    label: str
    method: str
    params: Any = None


def parse_arm(text: str) -> Arm:
    """An arm from its text: a built-in arm (:data:`ARMS`), or ``[label=]method[:params]`` with ``method`` a
    registered attention method (:func:`pid_plugins.list_methods`), ``params`` a JSON object of overrides of its
    default preset or a preset name, and ``label`` (default: the method's name) a Python identifier, e.g.
    ``scaled_reference``, ``sr2=scaled_reference:{"gamma": 2}``, ``p5=pid:{"lambda_p": 0.5}``."""
    from pid_plugins.core import SOFTMAX, get_method, list_methods

    text = text.strip()
    if text in ARMS:
        return Arm(text, SOFTMAX if text == SOFTMAX else "pid")
    head, sep, raw = text.partition(":")
    label, _, method = head.rpartition("=")
    label, method = (label or method).strip(), method.strip()
    if method not in list_methods():
        if method == SOFTMAX:
            raise ValueError(f"unknown arm {text!r}: softmax is the baseline arm 'softmax' (first, without a label "
                             "or parameters)")
        try:
            get_method(method)
        except ValueError as exc:
            raise ValueError(
                f"unknown arm {text!r}: not a built-in arm {list(ARMS)}, and {exc}; give a method as "
                "[label=]method[:params] (params: a JSON object or a preset name); a method your own module "
                "registers: --import MODULE"
            ) from None
    if not label.isidentifier():
        raise ValueError(f"arm {text!r}: its label {label!r} must be a Python identifier (it names files and columns)")
    if label in ARMS:
        raise ValueError(f"arm {text!r}: {label!r} is a built-in arm; give this one another label, e.g. "
                         f"{method}_m={method}{sep}{raw}")
    params: Any = None
    if sep:
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                params = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"arm {text!r}: its parameters are not a JSON object ({exc})") from None
            if not isinstance(params, dict):
                raise ValueError(f"arm {text!r}: its parameters must be a JSON object or a preset name")
        elif raw.isidentifier():
            params = raw
        else:
            raise ValueError(f"arm {text!r}: after ':' give a JSON object of parameters or a preset name, got {raw!r}")
    return Arm(label, method, params)


def split_arms(text: str) -> Tuple[str, ...]:
    """The arms of a comma list such as ``softmax,pid,sr=scaled_reference:{"gamma": 2, "x": 1}`` (commas inside
    brackets or quotes belong to an arm's parameters)."""
    arms, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "{[":
            depth += 1
        elif not quoted and ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0 and not quoted:
            arms.append(text[start:i])
            start = i + 1
    arms.append(text[start:])
    return tuple(a.strip() for a in arms if a.strip())


def arm_choice(arm: str, preset: str, language: bool = False, control_first_layer: bool = True):
    """The attention method and parameters of an arm (a :class:`~pid_plugins.core.MethodChoice`; None for softmax).
    Built-in arms are PID gains (``control_first_layer`` applies to the ``pid`` arm; ``pid_ref`` is always
    reference-only); a method arm's parameters start from its default preset in the zoo (``timm`` for vision,
    ``hf`` for language), PID's from ``preset``."""
    from pid_plugins.core import PIDConfig, resolve_attention

    parsed = parse_arm(arm)
    if arm.strip() == "softmax":
        return None
    if parsed.label in ARMS:
        if parsed.label == "neutreno":
            gains = PIDConfig.preset("neutreno", **({"lambda_p": 0.4} if language else {}))
        else:
            gains = PIDConfig.preset(preset, control_first_layer=parsed.label == "pid" and control_first_layer)
        return resolve_attention("pid", gains, zoo="hf" if language else "timm")
    try:
        return resolve_attention(parsed.method, parsed.params, zoo="hf" if language else "timm",
                                 default=preset if parsed.method == "pid" else None, where=f"arm {arm!r}")
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(f"arm {arm!r}") else f"arm {arm!r}: {message}") from None


def arm_config(arm: str, preset: str, language: bool = False, control_first_layer: bool = True):
    """The parameters of an arm's method (``None`` for softmax; PID gains for the built-in arms), see
    :func:`arm_choice`."""
    choice = arm_choice(arm, preset, language, control_first_layer)
    return None if choice is None else choice.config


def arm_record(arm: str, preset: str, language: bool = False, control_first_layer: bool = True) -> Dict[str, Any]:
    """What a record says about an arm: ``{"method": name, "attention_cfg": its parameters as a dict or None}``."""
    from pid_plugins.analysis.models import method_record

    choice = arm_choice(arm, preset, language, control_first_layer)
    return method_record(None if choice is None else choice.method.name, None if choice is None else choice.config)


def check_arms(arms: Tuple[str, ...]) -> None:
    """Refuse an arm list that does not start with softmax, repeats an arm (or a label) or names an unknown one."""
    labels = [parse_arm(a).label for a in arms]
    if not arms or arms[0] != "softmax" or len(set(labels)) != len(labels):
        raise ValueError(f"arms must start with 'softmax' (the baseline) and not repeat, got {list(arms)}")
    for arm in arms:
        arm_choice(arm, "deit")


@dataclass
class VisionSpec:
    data: str = "auto"  #: fashion-mnist, digits or auto
    img_size: int = 28
    patch_size: int = 4
    embed_dim: int = 96
    depth: int = 6
    num_heads: int = 3
    epochs: float = 2.0
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    train_limit: Optional[int] = None
    test_limit: int = 1000
    preset: str = "deit"
    seed: int = 0
    # evaluation
    eps_sweep: Tuple[float, ...] = (0.0, 1 / 255, 2 / 255, 3 / 255, 4 / 255)
    pgd_steps: int = 10
    noise_sigmas: Tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)
    corruptions: Tuple[str, ...] = ("gaussian_noise", "impulse_noise", "defocus_blur", "contrast", "pixelate",
                                    "elastic_transform")
    severities: Tuple[int, ...] = (1, 2, 3, 4, 5)
    diag_samples: int = 256
    arms: Tuple[str, ...] = ("softmax", "pid")  #: the arms to train and compare (:func:`parse_arm`)
    control_first_layer: bool = True  #: the ``pid`` arm's first-layer convention (False: reference-only)

    def training_key(self) -> str:
        keys = ("data", "img_size", "patch_size", "embed_dim", "depth", "num_heads", "epochs", "batch_size", "lr",
                "weight_decay", "train_limit", "preset", "seed", "control_first_layer")
        return _key(self, keys, "timm", language=False)


@dataclass
class LanguageSpec:
    corpus: str = "wiki"  #: wiki, shakespeare or a text file
    seq_len: int = 128
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    steps: int = 1200
    batch_size: int = 16
    lr: float = 2e-3
    weight_decay: float = 0.01
    preset: str = "lm"
    seed: int = 0
    valid_blocks: int = 96
    rates: Tuple[float, ...] = (0.0, 0.05, 0.1, 0.2)
    arms: Tuple[str, ...] = ("softmax", "pid")  #: the arms to train and compare (:func:`parse_arm`)
    control_first_layer: bool = True  #: the ``pid`` arm's first-layer convention (False: reference-only)

    def training_key(self) -> str:
        keys = ("corpus", "seq_len", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "steps",
                "batch_size", "lr", "weight_decay", "preset", "seed", "control_first_layer")
        return _key(self, keys, "hf", language=True)


# ----------------------------------------------------------------------------------------- caching
def code_fingerprint(zoo: str) -> str:
    """A hash of the code a cached model depends on: the core, the zoo's adapter, the model builders and
    training loops of this module, and the versions of torch and the zoo library."""
    import importlib
    import importlib.metadata

    root = Path(__file__).resolve().parents[1]  # the pid_plugins package
    h = hashlib.sha1()
    for folder in ("core", zoo):
        for f in sorted((root / folder).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    for fn in (parse_arm, arm_choice, vision_models, _train_classifier, language_models, _train_lm, _cosine_lr):
        h.update(inspect.getsource(fn).encode())
    for dist in ("torch", {"timm": "timm", "hf": "transformers"}[zoo]):
        try:
            h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(dist.encode())
    return h.hexdigest()[:12]


def _key(spec: Any, keys: Tuple[str, ...], zoo: str, language: bool) -> str:
    """The training key of a Vision/LanguageSpec: its training fields, every built-in arm's gains, the method,
    parameters and code of each of its method arms, and the code."""
    gains = {arm: arm_config(arm, spec.preset, language, spec.control_first_layer).to_dict()
             for arm in ARMS if arm != "softmax"}
    payload = {"spec": {k: getattr(spec, k) for k in keys}, "gains": gains, "code": code_fingerprint(zoo)}
    methods = {}
    for arm in spec.arms:
        if parse_arm(arm).label not in ARMS:
            choice = arm_choice(arm, spec.preset, language, spec.control_first_layer)
            try:  # a method registered outside pid_plugins: its own code too
                code = inspect.getsource(type(choice.method))
            except (OSError, TypeError):
                code = f"{type(choice.method).__module__}.{type(choice.method).__qualname__}"
            methods[parse_arm(arm).label] = {**arm_record(arm, spec.preset, language, spec.control_first_layer),
                                             "code": code}
    if methods:
        payload["methods"] = methods
    return hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix) that replaces ``path`` in one rename if the block succeeds
    and wrote something there (an empty temporary file leaves ``path`` as it was)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        yield Path(tmp)
        if os.path.getsize(tmp) > 0:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: readers see the old file or the new one, never a part."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


LOCK_NAME = ".pid-plugins.lock"


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the folder ``out`` (created if needed) for the block, or refuse at once.

    The lock is ``fcntl.flock`` on ``out/.pid-plugins.lock`` (released by the system when the process ends, even
    when it is killed); the file names the holder's pid for the error message.
    """
    out = Path(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise ValueError(f"another pid-plugins run (pid {holder}) is writing into {out}: wait for it to finish "
                             "or give another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            if created and [p.name for p in out.iterdir()] == [LOCK_NAME]:  # a run that wrote nothing
                os.unlink(out / LOCK_NAME)
                out.rmdir()
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_cache(model: nn.Module, path: Path, key: str, log: Log) -> Optional[Dict[str, Any]]:
    """The training info of the cached ``path`` (weights loaded into ``model``), or None to retrain (with why)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("training_key") != key:
            log(f"{path}: trained with another spec or code (key {meta.get('training_key')}, now {key}); retraining")
            return None
        info = json.loads(meta["info"])
        state = load_file(str(path))
        expected = model.state_dict()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            raise ValueError("its tensors do not fit the model")
        model.load_state_dict(state, strict=True)
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as exc:
        log(f"{path}: the cached model is damaged or incomplete ({type(exc).__name__}: {exc}); retraining")
        return None
    return info


def _write_cache(model: nn.Module, path: Path, info: Dict[str, Any]) -> None:
    """The weights and their training info (key included) in one safetensors file, written atomically."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {"training_key": info["training_key"], "info": json.dumps(info)}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())


def _trained(model: nn.Module, path: Path, spec: Any, train: Callable[[], Dict[str, Any]], log: Log) -> Dict[str, Any]:
    """Load ``model`` from ``path`` if it was trained with this spec and code, else train it and save it there."""
    key = spec.training_key()
    info = _read_cache(model, path, key, log)
    if info is not None:
        log(f"{path.stem.replace('_', ' ')}: loaded the cached model {path}")
        return {**info, "cached": True}
    info = {"training_key": key, "spec": asdict(spec), **train()}
    _write_cache(model, path, info)
    return {**info, "cached": False}


def _cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------------------- vision
def vision_models(spec: VisionSpec, num_classes: int) -> Dict[str, nn.Module]:
    """The softmax DeiT and its PID twins of ``spec.arms`` (timm adapter), with identical initial weights."""
    import timm

    import pid_plugins.timm  # noqa: F401

    check_arms(spec.arms)
    kwargs = dict(img_size=spec.img_size, patch_size=spec.patch_size, in_chans=1, num_classes=num_classes,
                  embed_dim=spec.embed_dim, depth=spec.depth, num_heads=spec.num_heads)
    torch.manual_seed(spec.seed)
    models = {"softmax": timm.create_model("deit_tiny_patch16_224", **kwargs)}
    for arm in spec.arms[1:]:
        choice = arm_choice(arm, spec.preset, False, spec.control_first_layer)
        model = timm.create_model("pid_deit_tiny_patch16_224", attention=choice.method.name,
                                  attention_cfg=choice.config, **kwargs)
        models[parse_arm(arm).label] = _with_weights_of(model, models["softmax"])
    return models


def _with_weights_of(model: nn.Module, softmax: nn.Module) -> nn.Module:
    """``model`` holding ``softmax``'s weights; its method's own learnable parameters keep their initial values."""
    missing, unexpected = model.load_state_dict(softmax.state_dict(), strict=False)
    foreign = [k for k in missing
               if ".attention_params." not in k and not k.endswith("attention_warmup.step")] + unexpected
    if foreign:
        raise ValueError(f"the arm's model does not match the softmax model: keys {foreign[:8]}")
    return model


def _train_classifier(clf: nn.Module, train, spec: VisionSpec, label: str, log: Log) -> Dict[str, Any]:
    from tqdm.auto import tqdm

    n = len(train)
    steps_per_epoch = math.ceil(n / spec.batch_size)
    total = max(1, int(round(spec.epochs * steps_per_epoch)))
    opt = torch.optim.AdamW(clf.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine_lr(s, total, max(1, total // 20)))
    g = torch.Generator().manual_seed(spec.seed)  # the same data order for softmax and PID
    losses: List[float] = []
    clf.train()
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc=f"vision {label}", leave=False)
    step = 0
    while step < total:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, spec.batch_size):
            if step >= total:
                break
            idx = perm[i:i + spec.batch_size]
            loss = F.cross_entropy(clf(train.images[idx]), train.labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
    bar.close()
    seconds = time.perf_counter() - t0
    log(f"vision {label}: {total} steps in {seconds:.0f} s, final loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return {"train_loss": losses, "train_seconds": seconds, "steps": total}


def run_vision(spec: VisionSpec, out: Path, log: Log = print) -> Dict[str, Any]:
    """Train (or load cached) softmax and PID, then evaluate robustness and collapse; returns the results."""
    from pid_plugins.analysis.diagnostics import collect_layer_measures, repeated_passes
    from pid_plugins.analysis.robustness import PixelClassifier, evaluate_image_robustness
    from pid_plugins.analysis.datasets import load_images

    out.mkdir(parents=True, exist_ok=True)
    train = load_images(spec.data, "train", limit=spec.train_limit, seed=spec.seed)
    test = load_images(spec.data, "test", limit=spec.test_limit, seed=spec.seed)
    if train.source != "Fashion-MNIST":
        log(f"vision: Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist); using {train.source}")
    img_size = spec.img_size if train.images.shape[-1] >= 16 else train.images.shape[-1]
    if img_size != spec.img_size:  # digits are 8x8: patches of 2 pixels
        spec = replace(spec, img_size=img_size, patch_size=2)
    models = vision_models(spec, train.num_classes)
    results: Dict[str, Any] = {"spec": asdict(spec), "data": train.source, "train_size": len(train),
                               "test_size": len(test), "models": {}}
    for arm, (label, model) in zip(spec.arms, models.items()):
        clf = PixelClassifier(model)
        info = _trained(model, out / f"vision_{label}.safetensors", spec,
                        lambda: _train_classifier(clf, train, spec, label, log), log)
        clf.eval()
        robust = evaluate_image_robustness(
            clf, test.images, test.labels, attacks=("fgsm", "pgd"), eps_sweep=list(spec.eps_sweep),
            pgd_steps=spec.pgd_steps, noise_sigmas=spec.noise_sigmas, corruptions=spec.corruptions,
            severities=spec.severities, seed=spec.seed, progress=True,
        )
        diag_x = test.images[: spec.diag_samples]
        fwd = lambda m, x, clf=clf: clf(x)  # noqa: E731
        batches = [diag_x[i:i + 64] for i in range(0, len(diag_x), 64)]
        diag = collect_layer_measures(model, batches, forward=fwd)
        diag["repeated_passes"] = repeated_passes(model, batches[0], 12, forward=fwd)
        results["models"][label] = {
            **arm_record(arm, spec.preset, False, spec.control_first_layer),
            "robustness": robust, "collapse": diag, "train_loss": info["train_loss"],
            "train_seconds": info["train_seconds"], "cached": info["cached"],
            "params": sum(p.numel() for p in model.parameters()),
        }
        log(f"vision {label}: clean top-1 {100 * robust['clean']['top1']:.1f}%")
    from pid_plugins.analysis.robustness import relative_mce

    base = results["models"]["softmax"]["robustness"]
    for r in results["models"].values():
        r["robustness"]["corruptions"]["mce_vs_softmax"] = relative_mce(r["robustness"], base)
    return results


# ----------------------------------------------------------------------------------------- language
def language_models(spec: LanguageSpec) -> Dict[str, nn.Module]:
    """A small byte-level Llama (grouped-query attention) and its PID twins of ``spec.arms``, identical weights."""
    import transformers

    import pid_plugins.hf

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=spec.hidden_size, intermediate_size=int(spec.hidden_size * 8 / 3) // 8 * 8,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.seq_len, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    check_arms(spec.arms)
    torch.manual_seed(spec.seed)
    softmax = transformers.LlamaForCausalLM(config)
    softmax.config._attn_implementation = "sdpa"
    models = {"softmax": softmax}
    for arm in spec.arms[1:]:
        choice = arm_choice(arm, spec.preset, True, spec.control_first_layer)
        models[parse_arm(arm).label] = pid_plugins.hf.convert(copy.deepcopy(softmax), choice.method.name, choice.config)
    return models


def byte_blocks(spec: LanguageSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, valid) blocks of ``seq_len`` bytes of the corpus; validation is its last 10%."""
    from pid_plugins.analysis.datasets import load_text, split_blocks

    data = load_text(spec.corpus).encode("utf-8")
    train, valid = split_blocks(list(data), spec.seq_len, valid_fraction=0.1)
    g = torch.Generator().manual_seed(1234)
    valid = valid[torch.randperm(len(valid), generator=g)[: spec.valid_blocks]]
    return train, valid


def _train_lm(model: nn.Module, train: torch.Tensor, spec: LanguageSpec, label: str, log: Log) -> Dict[str, Any]:
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine_lr(s, spec.steps, max(1, spec.steps // 20)))
    g = torch.Generator().manual_seed(spec.seed)
    losses: List[float] = []
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=f"language {label}", leave=False)
    for step in bar:
        idx = torch.randint(0, len(train), (spec.batch_size,), generator=g)
        x = train[idx]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 20 == 19:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
    seconds = time.perf_counter() - t0
    log(f"language {label}: {spec.steps} steps in {seconds:.0f} s, final loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return {"train_loss": losses, "train_seconds": seconds, "steps": spec.steps}


def run_language(spec: LanguageSpec, out: Path, log: Log = print) -> Dict[str, Any]:
    """Train (or load cached) softmax and PID byte-level LMs; perplexity, noisy perplexity, collapse."""
    from pid_plugins.analysis.diagnostics import collect_layer_measures, repeated_passes
    from pid_plugins.analysis.robustness import evaluate_lm_robustness

    out.mkdir(parents=True, exist_ok=True)
    train, valid = byte_blocks(spec)
    results: Dict[str, Any] = {"spec": asdict(spec), "train_blocks": len(train), "valid_blocks": len(valid),
                               "models": {}}
    for arm, (label, model) in zip(spec.arms, language_models(spec).items()):
        info = _trained(model, out / f"language_{label}.safetensors", spec,
                        lambda: _train_lm(model, train, spec, label, log), log)
        model.eval()
        robust = evaluate_lm_robustness(model, valid, rates=spec.rates, batch_size=16, seed=spec.seed, progress=True)
        batches = [{"input_ids": valid[i:i + 16]} for i in range(0, min(len(valid), 64), 16)]
        diag = collect_layer_measures(model, batches)
        diag["repeated_passes"] = repeated_passes(model, batches[0], 12)
        ppl = robust["perplexity"][0]
        results["models"][label] = {
            **arm_record(arm, spec.preset, True, spec.control_first_layer), "valid_perplexity": ppl, "bits_per_byte": math.log2(ppl), "robustness": robust, "collapse": diag,
            "train_loss": info["train_loss"], "train_seconds": info["train_seconds"], "cached": info["cached"],
            "params": sum(p.numel() for p in model.parameters()),
        }
        log(f"language {label}: validation perplexity {ppl:.3f} ({math.log2(ppl):.3f} bits/byte)")
    return results
