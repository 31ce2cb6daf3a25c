"""Real image bytes and raw dataset layouts, made on the spot, for tests, the benchmark and the demo.

* :func:`sample_photos`: JPEG photos (random crops of the two photos scikit-learn ships).
* :func:`class_image`: a procedural scene whose class a small ViT can learn (shape + texture).
* ``write_*``: the raw layouts ``launch/prepare_data.py`` reads, filled with class images.
"""
from __future__ import annotations

import colorsys
import io
import math
import pickle
import tarfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

Size = Tuple[int, int]  # (width, height), as PIL has it


@dataclass
class RawDataset:
    """What a writer put on disk: the ground truth a test compares the shards with."""

    root: Path
    classes: List[str]
    # key (as the prepared shards name the sample) -> (split, class name), readable images only
    samples: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    corrupt: List[str] = field(default_factory=list)  # keys of unreadable files
    special: Dict[str, str] = field(default_factory=dict)  # "gray" / "cmyk" / "png" -> key


def encode(img: Image.Image, fmt: str = "JPEG", quality: int = 90) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return out.getvalue()


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _photos() -> Tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(load_sample_images().images)  # two 640 x 427 RGB photos


def sample_photos(n: int, size: Size = (500, 375), seed: int = 0, quality: int = 90) -> Iterator[bytes]:
    """``n`` JPEG photos of ``size``: random crops (50-100 % of the area), flips, of real photos."""
    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(p) for p in _photos()]
    aspect = size[0] / size[1]
    for _ in range(n):
        photo = photos[rng.integers(len(photos))]
        pw, ph = photo.size
        area = pw * ph * rng.uniform(0.5, 1.0)
        w = min(pw, int(round(math.sqrt(area * aspect))))
        h = min(ph, int(round(w / aspect)))
        x, y = int(rng.integers(0, pw - w + 1)), int(rng.integers(0, ph - h + 1))
        img = photo.crop((x, y, x + w, y + h)).resize(size, Image.BICUBIC)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        yield encode(img, quality=quality)


SHAPES = ("disc", "square", "triangle", "ring", "cross")


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Pixels inside ``shape`` centred at 0 with radius 1, in offsets (dx, dy)."""
    if shape == "disc":
        return dx ** 2 + dy ** 2 <= 1
    if shape == "square":
        return np.maximum(abs(dx), abs(dy)) <= 0.8
    if shape == "triangle":
        return (dy <= 0.8) & (abs(dx) <= (dy + 0.9) * 0.55)
    if shape == "ring":
        return (dx ** 2 + dy ** 2 <= 1) & (dx ** 2 + dy ** 2 >= 0.35)
    return ((abs(dx) <= 0.3) & (abs(dy) <= 0.95)) | ((abs(dy) <= 0.3) & (abs(dx) <= 0.95))


def class_pixels(label: int, num_classes: int, rng: np.random.Generator, size: Size = (64, 48)) -> np.ndarray:
    """H x W x 3 uint8: a procedural scene whose class is the object's shape and texture.

    Shape (5 kinds) and texture (plain or striped) identify the class; the object's hue is
    centred on a class colour but jittered so that neighbouring classes overlap: colour alone
    gets a model part of the way, form the rest. Position, scale, stripe angle and background
    are random per image.
    """
    w, h = size
    shape, striped = SHAPES[label % len(SHAPES)], (label // len(SHAPES)) % 2 == 1
    spacing = 1.0 / max(1, num_classes)
    hue = (label * spacing + rng.normal(0, 0.6 * spacing)) % 1.0
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    radius = rng.uniform(0.25, 0.45) * min(w, h)
    cx, cy = rng.uniform(radius, w - radius), rng.uniform(radius, h - radius)
    mask = _shape_mask(shape, (xx - cx) / radius, (yy - cy) / radius)
    fg = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 1), rng.uniform(0.6, 1)), np.float32)
    bg = np.array(colorsys.hsv_to_rgb(rng.uniform(), rng.uniform(0, 0.5), rng.uniform(0.1, 0.5)),
                  np.float32)
    fg_img = np.broadcast_to(fg * 255, (h, w, 3)).copy()
    if striped:
        angle = rng.uniform(0, math.pi)
        wave = np.sin((xx * math.cos(angle) + yy * math.sin(angle)) * 2 * math.pi / 5.0)
        fg_img *= (0.55 + 0.45 * wave)[..., None]
    img = np.where(mask[..., None], fg_img, bg * 255) + rng.normal(0, 10, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def class_image(label: int, num_classes: int, rng: np.random.Generator, size: Size = (64, 48),
                fmt: str = "JPEG") -> bytes:
    """:func:`class_pixels` encoded (JPEG by default)."""
    return encode(Image.fromarray(class_pixels(label, num_classes, rng, size)), fmt)


def truncated_jpeg(rng: np.random.Generator, size: Size = (64, 48)) -> bytes:
    """A JPEG cut in half: the typical broken download."""
    data = class_image(0, 1, rng, size)
    return data[: len(data) // 2]


# --------------------------------------------------------------------------------------------
# Raw layouts
# --------------------------------------------------------------------------------------------
def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_synset_tars(root: str | Path, synsets: Sequence[str], per_class: int, *, size: Size = (64, 48),
                      seed: int = 0, oddities: bool = False) -> RawDataset:
    """``root/<synset>.tar`` holding ``<synset>_<n>.JPEG``, as ImageNet-21k is distributed.

    ``oddities`` adds what ImageNet has: a grayscale JPEG, a CMYK JPEG, a PNG named ``.JPEG``
    (in the first three synsets) and a truncated JPEG (in the last).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    raw = RawDataset(root, list(synsets))
    for label, synset in enumerate(synsets):
        with tarfile.open(root / f"{synset}.tar", "w") as tar:
            for i in range(per_class):
                key = f"{synset}_{i + 1}"
                _tar_add(tar, f"{key}.JPEG", class_image(label, len(synsets), rng, size))
                raw.samples[key] = ("train", synset)
            if not oddities:
                continue
            img = Image.fromarray(class_pixels(label, len(synsets), rng, size))
            odd = {0: ("gray", encode(img.convert("L"))), 1: ("cmyk", encode(img.convert("CMYK"))),
                   2: ("png", encode(img, "PNG"))}.get(label)
            if odd:
                key = f"{synset}_{odd[0]}"
                _tar_add(tar, f"{key}.JPEG", odd[1])
                raw.samples[key], raw.special[odd[0]] = ("train", synset), key
            if label == len(synsets) - 1:
                _tar_add(tar, f"{synset}_broken.JPEG", truncated_jpeg(rng, size))
                raw.corrupt.append(f"{synset}_broken")
    return raw


def write_outer_tar(path: str | Path, tars: Sequence[str | Path]) -> Path:
    """The tar of per-synset tars (``fall11_whole.tar``); gzip-compressed when ``path`` ends in .gz."""
    path = Path(path)
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as outer:
        for tar in tars:
            outer.add(str(tar), arcname=Path(tar).name)
    return path


def write_image_folder(root: str | Path, classes: Sequence[str], per_class: int, *, size: Size = (64, 48),
                       seed: int = 0) -> RawDataset:
    """``root/<class>/img<n>.<ext>``, extensions of every accepted kind and case, and a stray text file."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    exts = [(".jpg", "JPEG"), (".JPEG", "JPEG"), (".png", "PNG"), (".webp", "WEBP"), (".Jpg", "JPEG")]
    raw = RawDataset(root, sorted(classes))
    for cls in classes:
        folder = root / cls
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "notes.txt").write_text("not an image")
        for i in range(per_class):
            ext, fmt = exts[i % len(exts)]
            label = raw.classes.index(cls)
            (folder / f"img{i}{ext}").write_bytes(class_image(label, len(classes), rng, size, fmt))
            raw.samples[f"{cls}/img{i}"] = ("train", cls)
    return raw


def write_imagenet1k(root: str | Path, synsets: Sequence[str], per_class: int, val_per_class: int, *,
                     flat_val: bool = False, size: Size = (64, 48), seed: int = 0,
                     all_synsets: Optional[Sequence[str]] = None) -> RawDataset:
    """``train/<synset>/<synset>_<n>.JPEG`` and ``val/`` in synset folders, or flat with
    Kaggle's ``LOC_val_solution.csv``. Labels follow ``all_synsets`` (the 1000, sorted) when given."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    order = list(all_synsets or synsets)
    raw = RawDataset(root, order)
    rows = ["ImageId,PredictionString"]
    val_no = 0
    for synset in synsets:
        label = order.index(synset)
        (root / "train" / synset).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            key = f"{synset}_{i + 1}"
            (root / "train" / synset / f"{key}.JPEG").write_bytes(class_image(label, len(order), rng, size))
            raw.samples[key] = ("train", synset)
        for _ in range(val_per_class):
            val_no += 1
            key = f"ILSVRC2012_val_{val_no:08d}"
            folder = root / "val" if flat_val else root / "val" / synset
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{key}.JPEG").write_bytes(class_image(label, len(order), rng, size))
            raw.samples[key] = ("validation", synset)
            rows.append(f"{key},{synset} 1 2 30 40")
    if flat_val:
        (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    return raw


def write_cifar(root: str | Path, kind: str = "cifar10", n_train: int = 50, n_test: int = 10,
                seed: int = 0) -> RawDataset:
    """The python-pickle CIFAR layout (``cifar-10-batches-py`` / ``cifar-100-python``) with tiny N."""
    rng = np.random.default_rng(seed)
    n_classes = 10 if kind == "cifar10" else 100
    classes = [f"class{c:03d}" for c in range(n_classes)]
    if kind == "cifar10":
        folder, label_key = Path(root) / "cifar-10-batches-py", "labels"
        meta = ("batches.meta", "label_names")
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        files = {"train": train_files, "test": ["test_batch"]}
    else:
        folder, label_key, meta = Path(root) / "cifar-100-python", "fine_labels", ("meta", "fine_label_names")
        files = {"train": ["train"], "test": ["test"]}
    folder.mkdir(parents=True, exist_ok=True)
    raw = RawDataset(folder, classes)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, n_classes, n).tolist()
        pixels = np.stack([class_pixels(c, n_classes, rng, (32, 32)) for c in labels]) if n else \
            np.zeros((0, 32, 32, 3), np.uint8)
        data = pixels.transpose(0, 3, 1, 2).reshape(n, 3072)  # CIFAR rows are channel-major
        for i, c in enumerate(labels):
            raw.samples[f"{split}_{i:06d}"] = (split, classes[c])
        names = files[split]
        for filename, part in zip(names, np.array_split(np.arange(n), len(names))):
            batch = {"batch_label": filename, "data": data[part], label_key: [labels[i] for i in part],
                     "filenames": [f"img_{i}.png" for i in part]}
            (folder / filename).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / meta[0]).write_bytes(pickle.dumps({meta[1]: classes}, protocol=2))
    return raw
