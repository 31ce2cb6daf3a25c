"""The JPEG decoders behind the train/eval transforms: same crops and pixels whichever runs,
PIL for what simplejpeg cannot do, and nothing silent (the decoder in use, a fallback, a
missing simplejpeg are all logged)."""
from __future__ import annotations

import io
import logging
import random

import numpy as np
import pytest
import torch
from PIL import Image

from pretrain.data import transforms
from pretrain.data.synthetic import encode, sample_photos
from pretrain.data.transforms import (CorruptImage, EvalTransform, PilDecoder, SimpleJpegDecoder,
                                      TrainTransform, decoder_description)

TRANSFORM = "pretrain.data.transforms"  # the logger


def _both(make, data: bytes, seed: int = 0):
    """The outputs of the PIL and the simplejpeg decoder for the same sample and draws."""
    return tuple(make(decoder)(data, random.Random(seed))
                 for decoder in (PilDecoder(), SimpleJpegDecoder()))


def _mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.int() - b.int()).abs().float().mean().item()


@pytest.mark.parametrize("size", [(500, 375), (1600, 1200)])  # full decode; DCT-scaled decode
def test_simplejpeg_gives_the_crops_and_pixels_of_pil(size):
    # The draws happen before decoding, so both decoders crop the same box; pixels may differ
    # a little between libjpeg-turbo builds, the crop may not.
    train = lambda d: TrainTransform(96, (0.08, 1.0), decoder=d)  # noqa: E731
    evaluate = lambda d: EvalTransform(96, decoder=d)  # noqa: E731
    for i, data in enumerate(sample_photos(6, size=size, seed=1)):
        for make in (train, evaluate):
            a, b = _both(make, data, seed=i)
            assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (3, 96, 96)
            assert _mean_abs_diff(a, b) < 2


def test_grey_cmyk_png_and_trailing_bytes_decode_as_with_pil():
    data = next(sample_photos(1, size=(120, 90)))
    photo = Image.open(io.BytesIO(data))
    for sample in (encode(photo.convert("L")), encode(photo.convert("CMYK")),
                   encode(photo, "PNG"), data + b"\0" * 64 + b"camera trailer"):
        a, b = _both(lambda d: TrainTransform(48, decoder=d), sample)
        assert b.shape == (3, 48, 48) and _mean_abs_diff(a, b) < 2


def test_corrupt_bytes_raise_corrupt_image_without_a_fallback_warning(caplog):
    data = next(sample_photos(1, size=(120, 90)))
    with caplog.at_level(logging.WARNING, logger=TRANSFORM):
        for bad in (data[:len(data) // 2], data[:40], b"\xff\xd8\xff\xe0 not a jpeg", b"junk"):
            with pytest.raises(CorruptImage):
                TrainTransform(48, decoder=SimpleJpegDecoder())(bad, random.Random(0))
    assert not [r for r in caplog.records if "refused" in r.getMessage()]


def test_a_jpeg_only_pil_decodes_is_decoded_and_the_fallback_logged(caplog, monkeypatch):
    monkeypatch.setattr(transforms, "_fallbacks", 0)
    monkeypatch.setattr(transforms, "_next_report", 1)
    data = next(sample_photos(1, size=(120, 90)))
    scan = data.index(b"\xff\xda") + 40
    damaged = data[:scan] + b"\xff\xd3" + data[scan:]  # a stray restart marker: recoverable
    with caplog.at_level(logging.WARNING, logger=TRANSFORM):
        for _ in range(3):
            a, b = _both(lambda d: TrainTransform(48, decoder=d), damaged)
            assert torch.equal(a, b)  # PIL decoded it for both
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1 and "PIL" in warnings[0]  # the 1st, then the 10th, 100th...


def test_the_decoder_in_use_is_logged_once_per_process(caplog, monkeypatch):
    monkeypatch.setattr(transforms, "_announced", set())
    with caplog.at_level(logging.INFO, logger=TRANSFORM):
        TrainTransform(32)
        EvalTransform(32)
        TrainTransform(64)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("JPEG decoder")]
    assert lines == [decoder_description()]
    assert "simplejpeg" in lines[0] and "PIL" in lines[0]


def test_without_simplejpeg_pil_decodes_everything_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(transforms, "simplejpeg", None)
    monkeypatch.setattr(transforms, "_SIMPLEJPEG_ERROR", "ModuleNotFoundError: no simplejpeg")
    monkeypatch.setattr(transforms, "_announced", set())
    with caplog.at_level(logging.INFO, logger=TRANSFORM):
        transform = TrainTransform(48)
    assert type(transform.decoder) is PilDecoder
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "not importable" in warned[0].getMessage()
    out = transform(next(sample_photos(1, size=(120, 90))), random.Random(0))
    assert out.dtype == torch.uint8 and out.shape == (3, 48, 48)


def test_randaugment_is_applied_and_replays_with_the_samples_draws():
    """data.randaugment changes the pixels, and the same per-sample draws give the same image:
    a resumed run (or another worker count) augments a sample exactly as before."""
    plain, augmented = TrainTransform(64), TrainTransform(64, randaugment="rand-m15-n2")
    changed = 0
    for i, data in enumerate(sample_photos(8, size=(160, 120), seed=3)):
        once = augmented(data, random.Random(i))
        assert torch.equal(once, augmented(data, random.Random(i)))
        assert once.shape == plain(data, random.Random(i)).shape == (3, 64, 64)
        changed += not torch.equal(once, plain(data, random.Random(i)))  # the same crop
    # each of the 2 ops runs with timm's default probability 0.5: some images come out as cropped
    assert changed >= 4


def _one_op(spec: str, name: str, magnitude_std: float = 0.0):
    from pretrain.data.transforms import _build_randaugment
    [op] = [op for op in _build_randaugment(spec, 64).ops if op.name == name]
    op.prob, op.magnitude_std = 1.0, magnitude_std
    return op


def test_randaugment_magnitudes_above_10_are_applied_as_given():
    """The AugReg recipes' m15 ("medium") and m20 ("strong") are stronger than m10, as in the
    papers' TF RandAugment; timm alone caps them at 10 unless -mmax is given."""
    photo = Image.open(io.BytesIO(next(sample_photos(1, size=(64, 64), seed=5)))).convert("RGB")
    rotated = {}
    for spec in ("rand-m10-n2", "rand-m15-n2", "rand-m20-n2", "rand-m20-n2-mmax10"):
        random.seed(0)  # the same sign of the rotation for each
        rotated[spec] = np.asarray(_one_op(spec, "Rotate")(photo))
    assert not np.array_equal(rotated["rand-m10-n2"], rotated["rand-m15-n2"])
    assert not np.array_equal(rotated["rand-m15-n2"], rotated["rand-m20-n2"])
    assert np.array_equal(rotated["rand-m10-n2"], rotated["rand-m20-n2-mmax10"])  # -mmax wins


def test_randaugment_increasing_posterize_never_asks_pil_for_zero_bits():
    """DeiT's rand-m9-mstd0.5-inc1 draws magnitude 10 now and then, where timm's increasing
    Posterize asks PIL for 0 bits: PIL refused, the loader worker raised and the run stopped."""
    photo = Image.open(io.BytesIO(next(sample_photos(1, size=(64, 64), seed=5)))).convert("RGB")
    for spec in ("rand-m9-mstd0.5-inc1", "rand-m10-inc1", "rand-m20-inc1", "rand-m9-mmax30-inc1"):
        op = _one_op(spec, "PosterizeIncreasing", magnitude_std=100.0)
        for seed in range(50):
            random.seed(seed)
            out = np.asarray(op(photo))
            assert out.shape == (64, 64, 3)
    # the strongest setting PIL allows, 1 bit, as timm gives it from magnitude 7.5 up
    random.seed(0)
    assert np.unique(np.asarray(_one_op("rand-m20-inc1", "PosterizeIncreasing")(photo))).size <= 2
