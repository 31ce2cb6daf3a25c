"""Image decoding and augmentation for the streaming loader: encoded bytes in, uint8 CHW out.

Everything here runs in CPU data-loader workers, which are the usual bottleneck of ViT
pretraining, so the work is arranged to be cheap:

* the crop box is chosen from the JPEG header before any pixel is decoded, so a large JPEG can
  be decoded at 1/2, 1/4 or 1/8 scale (libjpeg DCT scaling via PIL ``draft``) whenever the crop
  still has at least the output resolution afterwards -- quality is kept, decode work drops 4-64x;
* JPEGs that need full resolution go through torchvision's libjpeg-turbo decoder straight into a
  tensor, and the crop is resized with torch's uint8 antialiased bilinear kernel (the same
  filter as PIL's, vectorised) -- no float conversion and no normalisation on the CPU; the model
  side normalises the uint8 batch on the device (:func:`pretrain.data.loader.normalize`).

Train: inception-style random resized crop, horizontal flip, optional timm RandAugment.
Eval: resize so the centre crop is ``crop_pct`` of the shorter side, then centre crop.
"""
from __future__ import annotations

import io
import math
import random
import warnings
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

try:  # deprecated in torchvision 0.29 in favour of torchcodec; PIL takes over once it is gone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover -- depends on the installed torchvision
    decode_jpeg = None

Box = Tuple[int, int, int, int]  # left, top, width, height in source pixels

# Aspect-ratio range of the inception crop (Szegedy et al.; timm and torchvision defaults).
CROP_RATIO = (3 / 4, 4 / 3)
# Eval: the centre crop covers this fraction of the shorter side (224 out of 256).
EVAL_CROP_PCT = 0.875


class CorruptImage(ValueError):
    """The bytes are not a decodable image."""


def random_resized_crop_box(width: int, height: int, scale: Sequence[float],
                            rng: random.Random, ratio: Sequence[float] = CROP_RATIO) -> Box:
    """An inception crop: area fraction uniform in ``scale``, log-uniform aspect ratio.

    Tries a few draws and falls back to the largest centred crop whose aspect ratio lies in
    ``ratio``, the behaviour torchvision and timm share, so results are comparable to both.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_crop_box(width: int, height: int, crop_pct: float = EVAL_CROP_PCT) -> Box:
    """Equivalent to "resize the shorter side to size/crop_pct, then centre-crop size"."""
    side = max(1, int(round(min(width, height) * crop_pct)))
    return (width - side) // 2, (height - side) // 2, side, side


def draft_reduction(box: Box, size: int) -> int:
    """Largest JPEG DCT reduction (8, 4, 2 or 1) keeping the crop at >= ``size`` px both ways."""
    _, _, w, h = box
    for factor in (8, 4, 2):
        if w // factor >= size and h // factor >= size:
            return factor
    return 1


def decode_crop_resize(data: bytes, size: int, choose_box) -> torch.Tensor:
    """Decode ``data``, crop the box ``choose_box(width, height)`` and resize it to size x size.

    Returns a uint8 (3, size, size) tensor. Raises :class:`CorruptImage` on undecodable bytes.
    """
    try:
        img = Image.open(io.BytesIO(data))
        box = choose_box(*img.size)
        pixels, box = _decode(data, img, box, size)
    except CorruptImage:
        raise
    except Exception as e:  # noqa: BLE001 -- PIL/libjpeg raise many types for bad bytes
        raise CorruptImage(f"undecodable image ({type(e).__name__}: {e})") from None
    left, top, w, h = box
    region = pixels[:, top:top + h, left:left + w]
    return TF.resize(region, [size, size], interpolation=TF.InterpolationMode.BILINEAR,
                     antialias=True)


def _decode(data: bytes, img: Image.Image, box: Box, size: int) -> Tuple[torch.Tensor, Box]:
    """Pixels as uint8 CHW (possibly a channels-last view) and the box in those pixels."""
    if img.format == "JPEG":
        factor = draft_reduction(box, size)
        if factor > 1:
            full_w, full_h = img.size
            img.draft("RGB", (full_w // factor, full_h // factor))
            sx, sy = img.size[0] / full_w, img.size[1] / full_h
            left, top, w, h = box
            box = (int(left * sx), int(top * sy), max(size, int(w * sx)), max(size, int(h * sy)))
            box = _clip(box, *img.size)
            return _pil_pixels(img), box
        if decode_jpeg is not None:
            try:
                return _torch_decode(data), box
            except RuntimeError:
                pass  # e.g. an exotic JPEG variant: PIL below decides whether it is corrupt
    return _pil_pixels(img), box


def _torch_decode(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # see the import above
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                           mode=ImageReadMode.RGB)


def _pil_pixels(img: Image.Image) -> torch.Tensor:
    if img.mode != "RGB":
        img = img.convert("RGB")
    else:
        img.load()
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def _clip(box: Box, width: int, height: int) -> Box:
    left, top, w, h = box
    w, h = min(w, width), min(h, height)
    return min(left, width - w), min(top, height - h), w, h


class TrainTransform:
    """Inception crop + horizontal flip (+ RandAugment) -> uint8 (3, size, size).

    Randomness comes only from the ``rng`` passed per sample, so a sample's augmentation is a
    function of its position in the stream and an exact resume reproduces it.
    """

    def __init__(self, size: int, scale: Sequence[float] = (0.05, 1.0), hflip: float = 0.5,
                 randaugment: Optional[str] = None):
        self.size, self.scale, self.hflip = size, tuple(scale), hflip
        self.randaugment = _build_randaugment(randaugment, size) if randaugment else None

    def __call__(self, data: bytes, rng: random.Random) -> torch.Tensor:
        out = decode_crop_resize(
            data, self.size, lambda w, h: random_resized_crop_box(w, h, self.scale, rng))
        if rng.random() < self.hflip:
            out = out.flip(-1)
        if self.randaugment is not None:
            out = self._apply_randaugment(out, rng)
        return out

    def _apply_randaugment(self, img: torch.Tensor, rng: random.Random) -> torch.Tensor:
        # timm's RandAugment draws from the global `random` and `numpy.random` generators;
        # seeding them from the per-sample rng keeps the augmentation reproducible.
        seed = rng.getrandbits(32)
        random.seed(seed)
        np.random.seed(seed)
        pil = Image.fromarray(img.permute(1, 2, 0).contiguous().numpy())
        return torch.from_numpy(np.array(self.randaugment(pil))).permute(2, 0, 1)


class EvalTransform:
    """Resize + centre crop (``crop_pct`` of the shorter side) -> uint8 (3, size, size)."""

    def __init__(self, size: int, crop_pct: float = EVAL_CROP_PCT):
        self.size, self.crop_pct = size, crop_pct

    def __call__(self, data: bytes, rng: Optional[random.Random] = None) -> torch.Tensor:
        return decode_crop_resize(data, self.size,
                                  lambda w, h: center_crop_box(w, h, self.crop_pct))


def _build_randaugment(spec: str, size: int):
    from timm.data.auto_augment import rand_augment_transform
    # The hyper-parameters timm's own transform factory passes for ImageNet-sized inputs.
    hparams = dict(translate_const=int(size * 0.45), img_mean=(124, 116, 104))
    try:
        return rand_augment_transform(spec, hparams)
    except Exception as e:  # noqa: BLE001 -- timm raises assorted errors for bad strings
        raise ValueError(f"data.randaugment='{spec}' is not a timm RandAugment string "
                         f"({e}); use e.g. 'rand-m15-n2'") from None
