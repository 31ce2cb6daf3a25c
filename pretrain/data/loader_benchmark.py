"""The loader benchmark: our streaming loader against the plain pipeline of the webdataset and
torchvision docs (same crop, flip and size), and the photo shards it is measured on."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List

from pretrain.data.loader import IMAGENET_MEAN, IMAGENET_STD, LoaderError

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
    from pretrain.data.info import DatasetInfoError
    from pretrain.data.loader import ShardSet

    try:
        return ShardSet.from_info(spec, split)
    except DatasetInfoError:
        import webdataset as wds
        urls = wds.shardlists.expand_urls(spec)
        if len(urls) == 1 and not os.path.exists(urls[0]) and "://" not in urls[0]:
            raise LoaderError(f"--shards {spec}: neither a directory with _info.json nor a shard "
                              f"pattern that exists; run `benchmark.py photos` to make one")
        return ShardSet.from_urls(urls)


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
    from torchvision import transforms as T

    transform = T.Compose([T.RandomResizedCrop(img_size, scale=REFERENCE_CROP_SCALE),
                           T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    dataset = (wds.WebDataset(urls, resampled=True, shardshuffle=False,
                              nodesplitter=wds.split_by_node)
               .shuffle(buffer).decode("pil").to_tuple("jpg", "cls")
               .map_tuple(transform, lambda c: c).batched(batch_size))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    return _time_batches(iter(loader), max(1, workers), batches, batch_size)
