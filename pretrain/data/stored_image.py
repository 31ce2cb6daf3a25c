"""One source image's bytes -> the JPEG a shard stores (``prepare_data.py``'s writer).

Every format PIL reads comes out as an RGB (or grayscale) JPEG that every training decoder reads
the same way: JPEGs that need nothing keep their bytes; the others are re-encoded upright (EXIF
orientation applied), in RGB (CMYK, palettes, alpha over white, 16-bit tones kept), within
``--max-size`` and within the pixel count the training loader reads.
"""
from __future__ import annotations

import contextlib
import io
import math
from typing import Optional, Tuple

import numpy as np
from PIL import Image

JPEG_QUALITY = 95

# The EXIF orientations (tag 0x0112) other than 1, as the turn that shows the image upright.
# A phone stores a portrait photo as landscape pixels plus this tag; the decoders that train
# (simplejpeg, PIL) ignore the tag, so the stored image is turned here once, as it was seen
# when it was labelled.
EXIF_ORIENTATION = 0x0112
TURNS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
         4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
         6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
         8: Image.Transpose.ROTATE_90}
# PIL refuses images over 179 M pixels as decompression bombs; scans and panoramas are real
# data, so sources may hold up to this many (about 1.6 GB decoded as RGB per worker)...
MAX_IMAGE_PIXELS = 1 << 29
# ... and are stored with at most this many, PIL's default limit, which the training loader
# keeps (above twice it, a sample would be skipped as undecodable in every epoch).
STORED_PIXELS = 89_478_485


def to_jpeg(data: bytes, max_size: Optional[int] = None) -> Tuple[bytes, int, int]:
    """(JPEG bytes, width, height as the image is shown); raises on an unreadable image.

    RGB and grayscale JPEGs within ``max_size`` and shown as stored keep their original bytes
    (every decoder turns grayscale into RGB); CMYK JPEGs, PNG/WebP (even when named .JPEG),
    images an EXIF orientation turns and larger images are re-encoded as RGB JPEG, upright, the
    shorter side resized down to ``max_size``.
    """
    with _own_pixel_limit(), Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        turn = TURNS.get(img.getexif().get(EXIF_ORIENTATION))
        if turn in (Image.Transpose.TRANSPOSE, Image.Transpose.TRANSVERSE,
                    Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_270):
            width, height = height, width
        size = _stored_size(width, height, max_size)
        too_big = size is not None
        if img.format == "JPEG" and img.mode in ("RGB", "L") and not too_big and turn is None:
            # A 1/8-scale decode still reads every byte, so truncated files are caught cheaply.
            img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            img.load()
            return data, width, height
        if size and img.format == "JPEG":
            # libjpeg decodes at a power-of-two scale no smaller than `size` (as stored)
            img.draft("RGB", size if (width, height) == img.size else size[::-1])
        rgb = _as_rgb(img)
        if turn is not None:
            rgb = rgb.transpose(turn)
        if size:
            rgb = rgb.resize(size, Image.BICUBIC, reducing_gap=3.0)
        out = io.BytesIO()
        rgb.save(out, format="JPEG", quality=JPEG_QUALITY, subsampling=0)  # 4:4:4 keeps small images sharp
        return out.getvalue(), width, height


@contextlib.contextmanager
def _own_pixel_limit():
    """PIL's decompression-bomb check (a global) off for one read, :data:`MAX_IMAGE_PIXELS`
    checked instead, then back: the process may be a training rank preparing its demo data,
    whose loader keeps PIL's own."""
    before = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = before


def _stored_size(width: int, height: int, max_size: Optional[int]) -> Optional[Tuple[int, int]]:
    """The size an image of ``width`` x ``height`` (as shown) is stored at; None: as it is."""
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} px is over the {MAX_IMAGE_PIXELS:,} pixels this reads")
    size = None
    if max_size is not None and min(width, height) > max_size:
        size = _shorter_side_to(width, height, max_size)
    w, h = size or (width, height)
    if w * h > STORED_PIXELS:
        scale = math.sqrt(STORED_PIXELS / (w * h))
        size = max(1, int(w * scale)), max(1, int(h * scale))
    return size


def _shorter_side_to(width: int, height: int, target: int) -> Tuple[int, int]:
    if width <= height:
        return target, max(1, round(height * target / width))
    return max(1, round(width * target / height)), target


def _as_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "F":  # PIL's convert clips at 255: values in [0, 1] came out black
        raise ValueError("floating-point pixels, whose range no file states: save the image "
                         "with 8 or 16 bits per channel")
    if img.mode.startswith("I;16") or img.mode == "I":
        # 16-bit grayscale (PNG, TIFF; 32-bit "I" read as 16-bit): PIL's convert clips it at
        # 255, so almost every pixel came out white; keep its top 8 bits, whatever the image
        # holds (a per-image rescale would make one tone differ from image to image)
        pixels = np.asarray(img, dtype=np.int64).clip(0, 65535) >> 8
        img = Image.fromarray(pixels.astype(np.uint8), mode="L")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
