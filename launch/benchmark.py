"""Throughput figures.

    # benchmark data: >= 2000 real photos of 500x375 (crops of scikit-learn's sample photos)
    python launch/benchmark.py photos --count 2048 --out /tmp/photos
    # loader images/s against a plain webdataset + torchvision pipeline, same crop/flip/size
    python launch/benchmark.py loader --shards /tmp/photos --workers 2 --batches 20 [--json]

``--shards`` is a directory (or URL prefix) holding ``_info.json``, or a shard pattern such as
``/data/shards-{000000..000019}.tar``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import List

import _bootstrap  # noqa: F401  (keeps launch/ from shadowing the pretrain package)

# Both pipelines get the inception crop torchvision's RandomResizedCrop uses by default.
REFERENCE_CROP_SCALE = (0.08, 1.0)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
            raise SystemExit(f"--shards {spec}: neither a directory with _info.json nor a shard "
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


def run_loader(args) -> dict:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    shards = resolve_shards(args.shards, args.split)
    common = dict(workers=args.workers, batches=args.batches, batch_size=args.batch_size,
                  img_size=args.img_size, buffer=args.shuffle_buffer)
    ours, reference = 0.0, 0.0
    # Alternating the two and keeping each one's best run evens out load from other processes.
    for _ in range(args.repeats):
        ours = max(ours, bench_ours(shards, **common))
        reference = max(reference, bench_reference(shards.urls, **common))
    return dict(images_per_sec=round(ours, 1), reference_images_per_sec=round(reference, 1),
                ratio=round(ours / reference, 3), workers=args.workers, repeats=args.repeats,
                batch_size=args.batch_size, batches=args.batches, img_size=args.img_size,
                shards=len(shards.urls))


def print_table(result: dict) -> None:
    print(f"{'pipeline':<34}{'images/s':>10}")
    print(f"{'ours (uint8, draft decode)':<34}{result['images_per_sec']:>10.1f}")
    print(f"{'reference (wds + torchvision)':<34}{result['reference_images_per_sec']:>10.1f}")
    print(f"{'ratio':<34}{result['ratio']:>10.2f}")
    print(f"({result['workers']} workers, {result['batches']} batches of {result['batch_size']}, "
          f"{result['img_size']} px, {result['shards']} shards)")


# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    photos = sub.add_parser("photos", help="write benchmark shards of real 500x375 photos")
    photos.add_argument("--count", type=int, default=2048)
    photos.add_argument("--out", type=Path, required=True)
    photos.add_argument("--shard-size", type=int, default=128)
    photos.add_argument("--seed", type=int, default=0)

    loader = sub.add_parser("loader", help="loader images/s against a reference pipeline")
    loader.add_argument("--shards", required=True,
                        help="directory with _info.json, or a shard pattern {000..009}")
    loader.add_argument("--split", default="train")
    loader.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    loader.add_argument("--batches", type=int, default=20, help="timed batches per pipeline")
    loader.add_argument("--batch-size", type=int, default=256)
    loader.add_argument("--img-size", type=int, default=224)
    loader.add_argument("--shuffle-buffer", type=int, default=1000)
    loader.add_argument("--repeats", type=int, default=1,
                        help="alternate the two pipelines this many times, keep each one's best")
    loader.add_argument("--json", action="store_true", help="print one JSON object")

    # The training-throughput and overhead figures ("train": images/s and MFU of the model
    # step; "overhead": data-loading share of a step) belong here as subcommands too; they
    # come with the performance work.
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "photos":
        out = make_photos(args.count, args.out, args.shard_size, args.seed)
        print(f"wrote {args.count} photos to {out}")
        return 0
    result = run_loader(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
