"""A small segmentation dataset in the ADE20K folder layout, made from real images.

No pixel-labelled dataset installs offline here, so the labels are DERIVED: real Fashion-MNIST images
(Debian package ``dataset-fashion-mnist``; scikit-learn's real 8x8 digits when it is absent) are pasted
onto a canvas, and every pixel of a pasted item gets that item's class. Layout::

    root/images/{training,validation}/*.jpg
    root/annotations/{training,validation}/*.png   (1 = background, 2 + class = item; ADE20K's
                                                    reduce_zero_label maps them to 0 and 1 + class)
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Tuple

import numpy as np

__all__ = ["load_real_images", "make_ade20k_like", "FASHION_MNIST_DIR"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def load_real_images(limit: int = 2000) -> Tuple[np.ndarray, np.ndarray, str]:
    """(images uint8 [N, H, W], labels [N], source name): Fashion-MNIST if installed, else sklearn digits."""
    images_file = FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz"
    labels_file = FASHION_MNIST_DIR / "train-labels-idx1-ubyte.gz"
    if images_file.is_file() and labels_file.is_file():
        with gzip.open(images_file) as f:
            images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
        with gzip.open(labels_file) as f:
            labels = np.frombuffer(f.read(), np.uint8, offset=8)
        return images[:limit], labels[:limit].astype(np.int64), "Fashion-MNIST"
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0 * 255).astype(np.uint8)
    images = np.kron(images, np.ones((3, 3), np.uint8))  # 8x8 -> 24x24
    return images[:limit], digits.target[:limit].astype(np.int64), "scikit-learn digits"


def make_ade20k_like(root: str | Path, n_train: int = 16, n_val: int = 4, size: int = 64,
                     items: int = 3, seed: int = 0) -> str:
    """Write the dataset under ``root``; returns the image source used."""
    from PIL import Image

    images, labels, source = load_real_images()
    rng = np.random.default_rng(seed)
    root = Path(root)
    for split, n in (("training", n_train), ("validation", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            canvas = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
            label = np.ones((size, size), np.uint8)
            for _ in range(items):
                k = rng.integers(len(images))
                img = images[k]
                h, w = img.shape
                y, x = rng.integers(0, size - h + 1), rng.integers(0, size - w + 1)
                mask = img > 40
                patch = canvas[y:y + h, x:x + w]
                patch[mask] = np.stack([img] * 3, -1)[mask]
                label[y:y + h, x:x + w][mask] = 2 + labels[k]
            Image.fromarray(canvas).save(root / "images" / split / f"{split}_{i:04d}.jpg", quality=95)
            Image.fromarray(label).save(root / "annotations" / split / f"{split}_{i:04d}.png")
    return source
