"""Image decoding and augmentation for the streaming loader: encoded bytes in, uint8 CHW out.

Everything here runs in CPU data-loader workers, which are the usual bottleneck of ViT
pretraining, so the work is arranged to be cheap:

* the crop box is chosen from the JPEG header before any pixel is decoded, so a large JPEG can
  be decoded at 1/2, 1/4 or 1/8 scale (libjpeg-turbo's DCT scaling) whenever the crop still has
  at least the output resolution afterwards -- quality is kept, decode work drops 4-64x (train;
  evaluation decodes at full scale, as timm's pipeline does);
* JPEGs are decoded by simplejpeg (libjpeg-turbo straight into a numpy array, with that DCT
  scaling): the whole train transform then runs ~1.4-1.5x as many ImageNet-sized images per
  core as with PIL decoding. PIL handles the other formats and CMYK JPEGs, and everything when
  simplejpeg is not installed (logged: the decoder in use, and any JPEG simplejpeg refused);
* the crop is resized with torch's uint8 antialiased bilinear kernel (the same filter as PIL's,
  vectorised) -- no float conversion and no normalisation on the CPU; the model side normalises
  the uint8 batch on the device (:func:`pretrain.data.device_batch.normalize`).

Train: inception-style random resized crop, horizontal flip, optional timm RandAugment.
Eval: resize so the centre crop is ``crop_pct`` of the shorter side, then centre crop.
:func:`decoder_description` names the decoder that runs, for the start-up log.
"""
from __future__ import annotations

import io
import logging
import math
import random
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import PIL
import torch
from PIL import Image

from pretrain.config import ConfigError
from pretrain.distributed import first_of_node
from torchvision.transforms.v2 import functional as TF

try:
    import simplejpeg
    _SIMPLEJPEG_ERROR = ""
except ImportError as e:  # a declared dependency; the loader still works without it, slower
    simplejpeg = None
    _SIMPLEJPEG_ERROR = f"{type(e).__name__}: {e}"

log = logging.getLogger(__name__)

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


def draft_reduction(box: Box, size: int) -> int:
    """Largest JPEG DCT reduction (8, 4, 2 or 1) keeping the crop at >= ``size`` px both ways."""
    _, _, w, h = box
    for factor in (8, 4, 2):
        if w // factor >= size and h // factor >= size:
            return factor
    return 1


ChooseBox = Callable[[int, int], Box]  # (full width, full height) -> crop box


def decode_crop_resize(data: bytes, size: int, choose_box: ChooseBox,
                       decoder: Optional[PilDecoder] = None) -> torch.Tensor:
    """Decode ``data``, crop the box ``choose_box(width, height)`` and resize it to size x size.

    Returns a uint8 (3, size, size) tensor. Raises :class:`CorruptImage` on undecodable bytes.
    """
    decoder = decoder or default_decoder()
    try:
        pixels, box = decoder.decode(data, size, choose_box)
    except CorruptImage:
        raise
    except Exception as e:  # noqa: BLE001 -- PIL/libjpeg raise many types for bad bytes
        raise CorruptImage(f"undecodable image ({type(e).__name__}: {e})") from None
    left, top, w, h = box
    region = pixels[:, top:top + h, left:left + w]
    return TF.resize(region, [size, size], interpolation=TF.InterpolationMode.BILINEAR,
                     antialias=True)


class PilDecoder:
    """Every format PIL reads; a JPEG whose crop allows it is decoded at reduced DCT scale.

    ``decode`` calls ``choose_box`` exactly once, with the full image size, in every decoder:
    the crop of a sample, hence its random draws, must not depend on which decoder runs.
    """

    def describe(self) -> str:
        return f"PIL {PIL.__version__} (DCT downscale) for all formats"

    def decode(self, data: bytes, size: int, choose_box: ChooseBox,
               reduce: bool = True) -> Tuple[torch.Tensor, Box]:
        """Pixels as uint8 CHW (possibly a channels-last view) and the crop box in them;
        ``reduce=False``: at full scale, whatever the crop's size."""
        img = Image.open(io.BytesIO(data))
        return self.decode_opened(img, choose_box(*img.size), size, reduce)

    def decode_opened(self, img: Image.Image, box: Box, size: int,
                      reduce: bool = True) -> Tuple[torch.Tensor, Box]:
        if img.format == "JPEG" and reduce:
            factor = draft_reduction(box, size)
            if factor > 1:
                full = img.size
                img.draft("RGB", (full[0] // factor, full[1] // factor))
                return _pil_pixels(img), reduced_box(box, full, img.size, size)
        return _pil_pixels(img), box


class SimpleJpegDecoder(PilDecoder):
    """JPEGs through simplejpeg (libjpeg-turbo, DCT downscale); PIL for everything else."""

    def describe(self) -> str:
        return (f"simplejpeg {simplejpeg.__version__} (DCT downscale), "
                f"PIL {PIL.__version__} for other formats")

    def decode(self, data: bytes, size: int, choose_box: ChooseBox,
               reduce: bool = True) -> Tuple[torch.Tensor, Box]:
        # The SOI marker alone (simplejpeg.is_jpeg also wants the final EOI, which would send
        # a JPEG with trailing bytes, as some cameras write, to the slower path).
        if data[:2] != b"\xff\xd8":
            return super().decode(data, size, choose_box, reduce)
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as e:
            return _pil_instead(e, lambda: super(SimpleJpegDecoder, self).decode(
                data, size, choose_box, reduce))
        # libjpeg-turbo cannot convert CMYK to RGB, and PIL's decompression-bomb guard (an
        # error, so a skipped sample) must hold whichever decoder runs.
        if colorspace in ("CMYK", "YCCK") or _too_large(width, height):
            return super().decode(data, size, choose_box, reduce)
        box = choose_box(width, height)
        factor = draft_reduction(box, size) if reduce else 1
        try:
            # libjpeg-turbo picks the smallest scale meeting both minimums: exactly 1/factor
            pixels = simplejpeg.decode_jpeg(data, "RGB", min_width=-(-width // factor),
                                            min_height=-(-height // factor))
        except ValueError as e:
            return _pil_instead(e, lambda: self.decode_opened(Image.open(io.BytesIO(data)),
                                                              box, size, reduce))
        if factor > 1:
            box = reduced_box(box, (width, height), (pixels.shape[1], pixels.shape[0]), size)
        return torch.from_numpy(pixels).permute(2, 0, 1), box


def default_decoder() -> PilDecoder:
    """The fastest maintained decoder installed: simplejpeg, else PIL (slower, warned about)."""
    return SimpleJpegDecoder() if simplejpeg is not None else PilDecoder()


def decoder_description(decoder: Optional[PilDecoder] = None) -> str:
    """One line naming the decoder that runs (``decoder``, default the default one)."""
    decoder = decoder or default_decoder()
    text = f"JPEG decoder: {decoder.describe()}"
    if simplejpeg is None:
        text += f"; simplejpeg is not importable ({_SIMPLEJPEG_ERROR}), JPEGs decode slower"
    return text


_announced = set()


def _announce(decoder: PilDecoder) -> None:
    """Log the decoder once per process (transforms are built once per loader, in the parent
    process; workers receive them pickled). A missing simplejpeg is a fact of a node's
    installation: warned about by the first rank of each node, not by all 64 ranks of a job."""
    text = decoder_description(decoder)
    if text not in _announced:
        _announced.add(text)
        warn = simplejpeg is None and first_of_node()
        log.log(logging.WARNING if warn else logging.INFO, "%s", text)


_fallbacks = 0
_next_report = 1


def _pil_instead(error: Exception, decode_with_pil):
    """PIL decides on a JPEG simplejpeg refused (truncated data, or a variant libjpeg-turbo's
    strict mode rejects): if PIL raises too, the sample is corrupt and the loader reports it;
    if PIL decodes it, the fast path was missed, which is logged (1st, 10th, 100th... time)."""
    global _fallbacks, _next_report
    result = decode_with_pil()
    _fallbacks += 1
    if _fallbacks == _next_report:
        _next_report *= 10
        log.warning("simplejpeg refused %d JPEG(s) that PIL decodes, in this process (latest: "
                    "%s); those take the slower PIL path", _fallbacks, error)
    return result


def _too_large(width: int, height: int) -> bool:
    limit = Image.MAX_IMAGE_PIXELS  # PIL raises DecompressionBombError above twice this
    return limit is not None and width * height > 2 * limit


def reduced_box(box: Box, full: Tuple[int, int], reduced: Tuple[int, int], size: int) -> Box:
    """``box`` (in full-size pixels) in an image decoded at reduced size, still >= ``size``."""
    sx, sy = reduced[0] / full[0], reduced[1] / full[1]
    left, top, w, h = box
    box = (int(left * sx), int(top * sy), max(size, int(w * sx)), max(size, int(h * sy)))
    return _clip(box, *reduced)


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
                 randaugment: Optional[str] = None, decoder: Optional[PilDecoder] = None):
        self.size, self.scale, self.hflip = size, tuple(scale), hflip
        self.randaugment = _build_randaugment(randaugment, size) if randaugment else None
        self.decoder = decoder or default_decoder()
        _announce(self.decoder)

    def __call__(self, data: bytes, rng: random.Random) -> torch.Tensor:
        out = decode_crop_resize(
            data, self.size, lambda w, h: random_resized_crop_box(w, h, self.scale, rng),
            self.decoder)
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
    """timm's eval transform: the shorter side resized to ``floor(size / crop_pct)``
    (bilinear, antialiased), then a centred size x size crop -> uint8 (3, size, size).

    The same geometry and rounding of sizes and offsets as ``timm.data.create_transform(
    input_size=size, crop_pct=crop_pct, interpolation="bilinear")``; only the resampling code
    differs (torch's here, PIL's there: a level of uint8 rounding on some pixels). So a model
    exported in timm's layout scores the same under timm's own pipeline as under our
    evaluator. (Cropping first and resizing the crop would be cheaper, but rounds the crop
    differently: on 32 px CIFAR images that moved several predictions in a hundred.) JPEGs
    decode at full scale for the same reason: a reduced DCT scale, which training's crops use,
    gives other pixels than timm's PIL decode of large photos (it moved 11 of 500 predictions
    of 256 px images evaluated at 48 px), and evaluation is a small share of a run's decoding.
    """

    def __init__(self, size: int, crop_pct: float = EVAL_CROP_PCT,
                 decoder: Optional[PilDecoder] = None):
        self.size, self.crop_pct = size, crop_pct
        self.scale = math.floor(size / crop_pct)
        self.decoder = decoder or default_decoder()
        _announce(self.decoder)

    def __call__(self, data: bytes, rng: Optional[random.Random] = None) -> torch.Tensor:
        full = []

        def whole(width: int, height: int) -> Box:
            full.append((width, height))
            return 0, 0, width, height
        try:
            pixels, (left, top, w, h) = self.decoder.decode(data, self.scale, whole,
                                                            reduce=False)
        except CorruptImage:
            raise
        except Exception as e:  # noqa: BLE001 -- PIL/libjpeg raise many types for bad bytes
            raise CorruptImage(f"undecodable image ({type(e).__name__}: {e})") from None
        width, height = full[0]  # torchvision's rounding, on the image's own size
        short, long = min(width, height), max(width, height)
        new_long = int(self.scale * long / short)
        new_w, new_h = (self.scale, new_long) if width <= height else (new_long, self.scale)
        region = pixels[:, top:top + h, left:left + w]
        resized = TF.resize(region, [new_h, new_w], interpolation=TF.InterpolationMode.BILINEAR,
                            antialias=True)
        return TF.center_crop(resized, [self.size, self.size])


POSTERIZE_MAX_MAGNITUDE = 9.99


def _build_randaugment(spec: str, size: int):
    from timm.data.auto_augment import rand_augment_transform
    # The hyper-parameters timm's own transform factory passes for ImageNet-sized inputs.
    hparams = dict(translate_const=int(size * 0.45), img_mean=(124, 116, 104))
    try:
        augment = rand_augment_transform(spec, hparams)
    except Exception as e:  # noqa: BLE001 -- timm raises assorted errors for bad strings
        raise ConfigError(f"data.randaugment='{spec}' is not a timm RandAugment string "
                         f"({e}); use e.g. 'rand-m15-n2'") from None
    for op in augment.ops:  # the settings as timm parsed them from the string
        if op.magnitude_max is None and op.magnitude > 10:
            # timm caps the magnitude at 10 unless told otherwise (-mmax); the TF RandAugment
            # of the ViT and AugReg papers applies 15 or 20 as given. With -mstd, room above
            # for the draws' upper tail (timm's uniform draw, mstd > 100, stays below it)
            std = op.magnitude_std if math.isfinite(op.magnitude_std) else 0.0
            op.magnitude_max = op.magnitude + 3 * std
        if op.name == "PosterizeIncreasing":
            # -inc1's Posterize keeps 4 - int(0.4 x magnitude) bits: none from magnitude 10 up,
            # which PIL refuses (DeiT's rand-m9-mstd0.5-inc1 draws 10 now and then, and the
            # run stopped). Below 10 it already keeps 1 bit, the strongest PIL allows.
            op.magnitude_max = min(op.magnitude_max or 10, POSTERIZE_MAX_MAGNITUDE)
    return augment
