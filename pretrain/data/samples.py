"""One raw WebDataset sample -> (label, transformed image), or why it is skipped.

Both loaders decode samples alike; keeping it in one place keeps their skip causes (the
:data:`pretrain.data.shards.SKIP_CAUSES` of the decoding side) the same.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from pretrain.data.transforms import CorruptImage

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")


def decode_label(sample: dict, num_classes: Optional[int]) -> int:
    raw = sample.get("cls")
    if raw is None:
        raise CorruptImage("sample has no 'cls'")
    try:
        label = int(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError):
        raise CorruptImage(f"'cls' is not an integer: {raw[:20]!r}") from None
    if label < 0 or (num_classes and label >= num_classes):
        raise CorruptImage(f"'cls' {label} outside [0, {num_classes}): more classes in the data "
                           f"than model.num_classes={num_classes}?" if label >= 0 else
                           f"'cls' {label} is negative")
    return label


def image_bytes(sample: dict) -> bytes:
    for name in IMAGE_FIELDS:
        if name in sample:
            return sample[name]
    raise CorruptImage(f"sample has no image ({'/'.join(IMAGE_FIELDS)})")


class Skip(NamedTuple):
    cause: str  # one of SKIP_CAUSES
    reason: str


def decode_sample(sample: dict, num_classes: Optional[int], transform):
    """(label, transformed image) of a raw sample, or why it is skipped."""
    try:
        data = image_bytes(sample)
    except CorruptImage as e:
        return Skip("empty", str(e))
    if not data:
        return Skip("empty", "the image field holds 0 bytes")
    try:
        label = decode_label(sample, num_classes)
    except CorruptImage as e:
        return Skip("bad_label", str(e))
    try:
        return label, transform(data)
    except CorruptImage as e:
        return Skip("undecodable", str(e))
