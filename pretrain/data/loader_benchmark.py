"""The loader benchmark: our streaming loader against the plain pipeline of the webdataset and
torchvision docs (same crop, flip and size), the JPEG decoders we could use, and the photo shards
it is measured on."""
from __future__ import annotations

import io
import os
import random
import statistics
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from pretrain.data.shards import LoaderError

# Both pipelines get the inception crop torchvision's RandomResizedCrop uses by default.
REFERENCE_CROP_SCALE = (0.08, 1.0)


# --------------------------------------------------------------------------------------------
# photos: the benchmark data
# --------------------------------------------------------------------------------------------
def make_photos(count: int, out: Path, shard_size: int, seed: int = 0) -> Path:
    import webdataset as wds

    from pretrain.data.info import DatasetInfo, SplitInfo, write_info
    from pretrain.data.synthetic import sample_photos

    out.mkdir(parents=True, exist_ok=True)
    filenames, lengths = [], []
    photos = sample_photos(count, size=(500, 375), seed=seed)
    for i, start in enumerate(range(0, count, shard_size)):
        n = min(shard_size, count - start)
        name = f"photos-train-{i:06d}.tar"
        with wds.TarWriter(str(out / name)) as sink:
            for j in range(n):
                sink.write({"__key__": f"photo_{start + j:07d}", "jpg": next(photos),
                            "cls": str((start + j) % 1000).encode()})
        filenames.append(name)
        lengths.append(n)
    write_info(out, DatasetInfo("photos", {"train": SplitInfo("train", count, filenames, lengths)}))
    return out


# --------------------------------------------------------------------------------------------
# loader: ours against the reference pipeline
# --------------------------------------------------------------------------------------------
def resolve_shards(spec: str, split: str):
    from pretrain.data.info import InfoNotRead, read_info
    from pretrain.data.shards import ShardSet

    try:
        splits = read_info(spec).splits
    except InfoNotRead:  # no dataset folder: a shard pattern
        import webdataset as wds
        urls = wds.shardlists.expand_urls(spec)
        if len(urls) == 1 and not os.path.exists(urls[0]) and "://" not in urls[0]:
            raise LoaderError(f"--shards {spec}: neither a directory with _info.json nor a shard "
                              f"pattern that exists; run `benchmark.py photos` to make one")
        return ShardSet.from_urls(urls)
    if split not in splits:
        raise LoaderError(f"--split {split}: not a split of {spec} (its splits: "
                          f"{', '.join(splits)})")
    return ShardSet.from_info(spec, split)


def check_reference_reads(urls: List[str]) -> None:
    """The reference pipeline opens shards with webdataset's own opener, which has no s3://
    (and reads gs:// through gsutil, http(s):// through curl): refuse what it cannot open
    before anything is timed."""
    from webdataset.gopen import gopen_schemes

    scheme = urls[0].split("://", 1)[0] if "://" in urls[0] else ""
    if scheme not in ("", "file", *gopen_schemes):  # file: gopen's own, outside the table
        raise LoaderError(f"--shards {urls[0].rsplit('/', 1)[0]}: the reference pipeline "
                          f"(webdataset's own opener) cannot read {scheme}://; copy a few "
                          f"shards and their _info.json to a local folder and benchmark that")


def _time_batches(iterator, warmup: int, batches: int, batch_size: int) -> float:
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def bench_ours(shards, *, workers: int, batches: int, batch_size: int, img_size: int,
               buffer: int) -> float:
    from pretrain.data.loader import TrainLoader

    loader = TrainLoader(shards, img_size=img_size, batch_size=batch_size, num_workers=workers,
                         shuffle_buffer=buffer, crop_scale=REFERENCE_CROP_SCALE, hflip=0.5,
                         resample=len(shards.urls) < max(1, workers))
    # The first batch of every worker includes its start-up and shuffle-buffer fill.
    return _time_batches(iter(loader), max(1, workers), batches, batch_size)


def bench_reference(urls: List[str], *, workers: int, batches: int, batch_size: int,
                    img_size: int, buffer: int) -> float:
    """The plain pipeline of the webdataset and torchvision docs, float output, normalised."""
    import torch
    import webdataset as wds
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from torchvision import transforms as T

    transform = T.Compose([T.RandomResizedCrop(img_size, scale=REFERENCE_CROP_SCALE),
                           T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
    dataset = (wds.WebDataset(urls, resampled=True, shardshuffle=False,
                              nodesplitter=wds.split_by_node)
               .shuffle(buffer).decode("pil").to_tuple("jpg", "cls")
               .map_tuple(transform, lambda c: c).batched(batch_size))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    return _time_batches(iter(loader), max(1, workers), batches, batch_size)


# --------------------------------------------------------------------------------------------
# decoders: per-image decode + train transform on one core, for each candidate decoder
# --------------------------------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def _full_resolution_decoder(name: str, version: str, decode: Callable):
    """A decoder without DCT scaling, used the way the old fast path used torchvision's:
    PIL ``draft`` for crops that allow a reduced decode, ``decode(bytes)`` (uint8 CHW) else."""
    from PIL import Image

    from pretrain.data.transforms import PilDecoder, draft_reduction

    class FullResolution(PilDecoder):
        def describe(self) -> str:
            return f"{name} {version}, PIL draft for reducible crops"

        def decode(self, data, size, choose_box):
            img = Image.open(io.BytesIO(data))
            box = choose_box(*img.size)
            if img.format == "JPEG" and img.mode == "RGB" and draft_reduction(box, size) == 1:
                return decode(data), box
            return self.decode_opened(img, box, size)

    return FullResolution()


def _turbojpeg_decoder():
    import torch
    import turbojpeg

    from pretrain.data.transforms import PilDecoder, draft_reduction, reduced_box

    tj = turbojpeg.TurboJPEG()  # raises when no usable libturbojpeg is installed

    class TurboJpeg(PilDecoder):
        def describe(self) -> str:
            return f"PyTurboJPEG {_version('PyTurboJPEG')} (DCT downscale)"

        def decode(self, data, size, choose_box):
            width, height, _, _ = tj.decode_header(data)
            box = choose_box(width, height)
            factor = draft_reduction(box, size)
            pixels = tj.decode(data, pixel_format=turbojpeg.TJPF_RGB,
                               scaling_factor=(1, factor) if factor > 1 else None)
            if factor > 1:
                box = reduced_box(box, (width, height), (pixels.shape[1], pixels.shape[0]), size)
            return torch.from_numpy(pixels).permute(2, 0, 1), box

    return TurboJpeg()


def _torchvision_decode():
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchvision.io import ImageReadMode, decode_jpeg

    def decode(data: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                               mode=ImageReadMode.RGB)
    return decode


def _torchcodec_decode():
    from torchcodec.decoders import decode_jpeg

    return lambda data: decode_jpeg(data, mode="RGB")


def decoder_candidates() -> List[Tuple[str, str, Optional[object], str]]:
    """(name, version, decoder or None when unavailable, notes) for each candidate."""
    from pretrain.data.transforms import PilDecoder, SimpleJpegDecoder, simplejpeg

    rows = [("PIL", _version("pillow"), PilDecoder(),
             "libjpeg-turbo via PIL, DCT downscale (draft)")]
    if simplejpeg is not None:
        rows.append(("simplejpeg", _version("simplejpeg"), SimpleJpegDecoder(),
                     "libjpeg-turbo, DCT downscale (min_width/min_height); the default"))
    else:
        rows.append(("simplejpeg", "-", None, "unavailable (not installed)"))
    for name, dist, make, notes in (
            ("torchvision.io.decode_jpeg", "torchvision", _torchvision_decode,
             "deprecated since torchvision 0.29 (decode_image too); no DCT downscale, PIL "
             "draft for reducible crops"),
            ("torchcodec.decoders.decode_jpeg", "torchcodec", _torchcodec_decode,
             "no DCT downscale on the CPU, PIL draft for reducible crops")):
        try:
            rows.append((name, _version(dist), _full_resolution_decoder(name, _version(dist),
                                                                        make()), notes))
        except Exception as e:  # noqa: BLE001 -- an optional candidate: report why, go on
            rows.append((name, _version(dist), None, f"unavailable ({type(e).__name__}: {e})"))
    try:
        rows.append(("PyTurboJPEG", _version("PyTurboJPEG"), _turbojpeg_decoder(),
                     "needs the system libturbojpeg, DCT downscale (scaling_factor)"))
    except Exception as e:  # noqa: BLE001 -- ImportError, or no usable libturbojpeg
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        rows.append(("PyTurboJPEG", _version("PyTurboJPEG"), None,
                     f"unavailable ({type(e).__name__}: {first})"))
    return rows


def _reference_transform(img_size: int):
    """The reference pipeline's per-image work: PIL full decode, crop, float, normalise."""
    import torch
    from PIL import Image
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    from torchvision import transforms as T

    transform = T.Compose([T.RandomResizedCrop(img_size, scale=REFERENCE_CROP_SCALE),
                           T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])

    def run(data: bytes, rng: random.Random) -> torch.Tensor:
        return transform(Image.open(io.BytesIO(data)).convert("RGB"))
    return run


def bench_decoders(*, img_size: int, photo_size: Tuple[int, int], quality: int = 90,
                   count: int = 200, rounds: int = 5) -> dict:
    """Images per CPU-second (images/s per core) of decode + :class:`TrainTransform` (the loader
    benchmark's crop scale, flip) for each candidate decoder, on ``count`` photos as
    :func:`make_photos` writes them (the same photos at 500x375, quality 90). Rounds alternate
    the decoders; each one's median round is reported, with the mean |difference| of its
    pixels from PIL's (0-255 scale)."""
    import numpy as np
    import torch

    from pretrain.data.synthetic import sample_photos
    from pretrain.data.transforms import TrainTransform

    photos = list(sample_photos(count, size=photo_size, quality=quality))
    rows = decoder_candidates()
    runners = {name: TrainTransform(img_size, REFERENCE_CROP_SCALE, 0.5, decoder=decoder)
               for name, _, decoder, _ in rows if decoder is not None}
    reference_name = "reference (PIL full decode, float, normalised)"
    runners[reference_name] = _reference_transform(img_size)

    def one_pass(run) -> float:
        # CPU time, not wall time: on a machine shared with other work, a wall clock counts
        # the time this process waits for a core; images per CPU-second is images/s per core.
        start = time.process_time()
        for i, data in enumerate(photos):
            run(data, random.Random(i))
        return len(photos) / (time.process_time() - start)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pil_out = [runners["PIL"](data, random.Random(i)) for i, data in enumerate(photos)]
        diffs, failed = {}, {}
        for name, run in list(runners.items()):
            if name == reference_name:
                continue
            try:
                diffs[name] = float(np.mean([
                    (run(data, random.Random(i)).int() - pil_out[i].int()).abs().float().mean()
                    for i, data in enumerate(photos)]))
            except Exception as e:  # noqa: BLE001 -- an optional candidate's own failure
                failed[name] = f"unavailable (failed: {type(e).__name__}: {e})"
                del runners[name]
        speeds = {name: [] for name in runners}
        for r in range(rounds):
            # Alternate the order too, so no decoder always runs right after the same one.
            for name in (list(runners) if r % 2 == 0 else list(reversed(runners))):
                speeds[name].append(one_pass(runners[name]))
    finally:
        torch.set_num_threads(threads)
    table = [dict(decoder=name, version=version,
                  images_per_sec=(round(statistics.median(speeds[name]), 1)
                                  if name in speeds else None),
                  mean_abs_diff_vs_pil=(round(diffs[name], 3) if name in diffs else None),
                  notes=failed.get(name, notes))
             for name, version, _, notes in rows]
    table.append(dict(decoder=reference_name, version=_version("torchvision"),
                      images_per_sec=round(statistics.median(speeds[reference_name]), 1),
                      mean_abs_diff_vs_pil=None,
                      notes="what the loader benchmark compares against, per image"))
    return dict(photo_size=f"{photo_size[0]}x{photo_size[1]}", quality=quality, photos=count,
                mean_photo_kb=round(sum(map(len, photos)) / len(photos) / 1024, 1),
                rounds=rounds, img_size=img_size, decoders=table)
