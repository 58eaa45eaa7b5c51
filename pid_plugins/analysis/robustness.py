"""Robustness of image classifiers (clean, FGSM, PGD, SPSA, noise and ImageNet-C corruptions on pixels in [0, 1])
and language models (perplexity, clean and with noisy tokens)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PixelClassifier", "DEFAULT_CORRUPTIONS", "accuracy", "evaluate_image_robustness", "relative_mce",
           "lm_perplexity", "evaluate_lm_robustness"]

#: a fast, representative subset of the 19 ImageNet-C corruptions (noise, blur, weather, digital)
DEFAULT_CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "motion_blur", "fog",
                       "contrast", "brightness", "jpeg_compression", "pixelate", "elastic_transform")


def _model_input(model: nn.Module) -> tuple[int, tuple[int, int], tuple[float, ...], tuple[float, ...]]:
    """(channels, (H, W), mean, std) the model expects, from its patch embedding and pretrained config."""
    cfg, pe = getattr(model, "pretrained_cfg", None) or {}, getattr(model, "patch_embed", None)
    channels, img = getattr(getattr(pe, "proj", None), "in_channels", None), getattr(pe, "img_size", None)
    size = None if img is None else (img, img) if isinstance(img, int) else tuple(img)
    if (channels is None or size is None) and "input_size" in cfg:
        c, h, w = cfg["input_size"]
        channels, size = channels or c, size or (h, w)
    if channels is None or size is None:
        raise ValueError(f"cannot tell the input size of {type(model).__name__}: give a timm classifier")
    return channels, size, tuple(cfg.get("mean", (0.5,) * channels)), tuple(cfg.get("std", (0.5,) * channels))


class PixelClassifier(nn.Module):
    """``model`` taking images in [0, 1] at the data's size and channels: resize, match channels, normalise."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.channels, self.size, mean, std = _model_input(model)
        m, s = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
        if len(m) != self.channels:  # e.g. ImageNet statistics on a 1-channel model: use their average
            m, s = m.mean().repeat(self.channels), s.mean().repeat(self.channels)
        self.register_buffer("mean", m.view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", s.view(1, -1, 1, 1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-2:] != self.size:
            x = F.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        c = x.shape[1]
        if c != self.channels:
            if c == 1:
                x = x.expand(-1, self.channels, -1, -1)
            elif self.channels == 1:
                x = x.mean(1, keepdim=True)
            else:
                raise ValueError(f"images have {c} channels, the model takes {self.channels}")
        return self.model((x - self.mean) / self.std)


def _progress(iterable, progress: bool, desc: str):
    if not progress:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, leave=False)


def accuracy(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 64, topk: Sequence[int] = (1,),
             attack: Optional[Any] = None, progress: str = "") -> List[float]:
    """Top-k accuracies (fractions) of ``model`` on ``images`` in [0, 1], each batch first moved by ``attack(x, y)``
    where given (a progress bar named ``progress`` where given)."""
    correct = [0] * len(topk)
    for i in _progress(range(0, len(labels), batch_size), bool(progress), progress):
        x, y = images[i:i + batch_size], labels[i:i + batch_size]
        x = x if attack is None else attack(x, y)
        with torch.no_grad():
            logits = model(x)
        ranked = logits.topk(min(max(topk), logits.shape[-1]), dim=-1).indices
        for j, k in enumerate(topk):
            correct[j] += int((ranked[:, :k] == y[:, None]).any(-1).sum())
    return [c / len(labels) for c in correct]


def _corrupt(images: Tensor, name: str, severity: int, seed: int) -> Tensor:
    import numpy as np
    from corrupt_tta import corrupt
    np.random.seed(seed)  # corrupt-tta draws from numpy's global generator
    out = []
    for img in images:
        arr = (img.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        if arr.shape[2] == 1:
            arr = np.repeat(arr, 3, axis=2)
        c = np.asarray(corrupt(arr, severity=severity, corruption_name=name), dtype=np.float32)
        t = torch.from_numpy(np.clip(c, 0, 255) / 255.0).permute(2, 0, 1)
        if img.shape[0] == 1:
            t = t.mean(0, keepdim=True)
        out.append(t.float())
    return torch.stack(out)


def evaluate_image_robustness(
    model: nn.Module, images: Tensor, labels: Tensor, *, batch_size: int = 64,
    attacks: Sequence[str] = ("fgsm", "pgd"), eps: float = 3 / 255, eps_sweep: Optional[Sequence[float]] = None,
    pgd_steps: int = 20, spsa_iters: int = 5, spsa_samples: int = 64,
    noise_sigmas: Sequence[float] = (0.02, 0.05, 0.1, 0.2), corruptions: Sequence[str] = DEFAULT_CORRUPTIONS,
    severities: Sequence[int] = (1, 2, 3, 4, 5), seed: int = 0, progress: bool = True,
) -> Dict[str, Any]:
    """Every robustness measure of a classifier taking images in [0, 1], as fractions, by attack and strength."""
    unknown = sorted(set(attacks) - {"fgsm", "pgd", "spsa"})
    if unknown:
        raise ValueError(f"unknown attacks {unknown}: choose from fgsm, pgd, spsa")
    model.eval()
    top1, top5 = accuracy(model, images, labels, batch_size, topk=(1, 5))
    result: Dict[str, Any] = {"num_samples": len(labels), "clean": {"top1": top1, "top5": top5}}
    sweep = list(eps_sweep) if eps_sweep else [eps]
    if attacks:
        import torchattacks
        for name in attacks:
            if name == "spsa":
                torch.manual_seed(seed)
                atk = torchattacks.SPSA(model, eps=eps, nb_iter=spsa_iters, nb_sample=spsa_samples,
                                        max_batch_size=spsa_samples)
                acc = accuracy(model, images, labels, batch_size, attack=atk,
                               progress=progress and f"SPSA eps={eps:.4f}")[0]
                result["spsa"] = {"eps": [eps], "top1": [acc], "iterations": spsa_iters, "samples": spsa_samples}
                continue
            accs = []
            for e in sweep:
                torch.manual_seed(seed)
                if e == 0:
                    accs.append(top1)
                    continue
                atk = (torchattacks.FGSM(model, eps=e) if name == "fgsm" else torchattacks.PGD(
                    model, eps=e, alpha=2.5 * e / pgd_steps, steps=pgd_steps, random_start=True))
                accs.append(accuracy(model, images, labels, batch_size, attack=atk,
                                     progress=progress and f"{name.upper()} eps={e:.4f}")[0])
            result[name] = {"eps": sweep, "top1": accs}
            if name == "pgd":
                result[name]["steps"] = pgd_steps
    if noise_sigmas:
        g = torch.Generator().manual_seed(seed)
        accs = [accuracy(model, (images + sigma * torch.randn(images.shape, generator=g)).clamp_(0, 1), labels,
                         batch_size)[0] for sigma in noise_sigmas]
        result["noise"] = {"sigma": list(noise_sigmas), "top1": accs}
    if corruptions:
        per: Dict[str, List[float]] = {}
        jobs = [(c, s) for c in corruptions for s in severities]
        for c, s in _progress(jobs, progress, "corruptions"):
            corrupted = _corrupt(images, c, s, seed)
            per.setdefault(c, []).append(accuracy(model, corrupted, labels, batch_size)[0])
        errors = [1.0 - a for accs in per.values() for a in accs]
        result["corruptions"] = {"severities": list(severities), "top1": per,
                                 "mean_corruption_error": sum(errors) / len(errors)}
    return result


def relative_mce(result: Dict[str, Any], baseline: Dict[str, Any]) -> float:
    """ImageNet-C mCE in percent: mean over corruptions c of sum_s E(model, c, s) / sum_s E(baseline, c, s)."""
    ours, base = result["corruptions"]["top1"], baseline["corruptions"]["top1"]
    if set(ours) != set(base):
        raise ValueError("the model and the baseline were measured on different corruptions")
    ratios = []
    for c in ours:
        e_model, e_base = sum(1.0 - a for a in ours[c]), sum(1.0 - a for a in base[c])
        ratios.append(e_model / e_base if e_base > 0 else (1.0 if e_model == 0 else math.inf))
    return 100.0 * sum(ratios) / len(ratios)


@torch.no_grad()
def lm_perplexity(model: nn.Module, blocks: Tensor, *, batch_size: int = 8, noise_rate: float = 0.0,
                  vocab_size: Optional[int] = None, seed: int = 0, progress: bool = False) -> float:
    """exp(mean next-token cross-entropy) of a causal LM on ``blocks`` ``(n, T)``, inputs noised at ``noise_rate``."""
    if not 0.0 <= noise_rate < 1.0:
        raise ValueError(f"noise rate must be in [0, 1), got {noise_rate}")
    if blocks.dim() != 2 or blocks.shape[1] < 2:
        raise ValueError("blocks must be (n, T) token ids with T >= 2")
    vocab_size = vocab_size or int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    model.eval()
    total, count = 0.0, 0
    batches = range(0, len(blocks), batch_size)
    for i in _progress(batches, progress, f"perplexity noise={noise_rate}"):
        clean = blocks[i:i + batch_size]
        inputs = clean.clone()
        if noise_rate > 0:
            swap = torch.rand(inputs.shape, generator=g) < noise_rate
            swap[:, 0] = False
            inputs[swap] = torch.randint(0, vocab_size, (int(swap.sum()),), generator=g)
        logits = model(input_ids=inputs).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += clean[:, 1:].numel()
    return math.exp(total / count)


def evaluate_lm_robustness(model: nn.Module, blocks: Tensor, *, rates: Sequence[float] = (0.0, 0.05, 0.1, 0.2),
                           batch_size: int = 8, seed: int = 0, progress: bool = True) -> Dict[str, Any]:
    """Perplexity of a causal LM at each token substitution rate (0 = clean)."""
    ppl = [lm_perplexity(model, blocks, batch_size=batch_size, noise_rate=r, seed=seed, progress=progress)
           for r in rates]
    return {"num_blocks": int(blocks.shape[0]), "block_tokens": int(blocks.shape[1]),
            "substitution_rate": list(rates), "perplexity": ppl}
